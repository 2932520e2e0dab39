"""The memory tier (checkpoint/memory.py, partners.py, memory_tier.py): copies in shared
memory, partners on other nodes, and a restart from the nearest complete copy.

The node-loss and whole-job cases run in ``drill --tier memory`` (tests/test_drill.py).
"""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import pytest
import torch
from test_recovery import ROOT, losses, start_resume, worker

from conftest import finish, project_module, read_events, run_module, wait_until

memory = project_module("checkpoint.memory")
partners = project_module("checkpoint.partners")
integrity = project_module("checkpoint.integrity")


class Part:
    """A Stateful as the trainer's adapters are: state_dict() views, load_state_dict()."""

    def __init__(self, **values) -> None:
        self.values = values
        self.loaded = None

    def state_dict(self):
        return self.values

    def load_state_dict(self, state):
        self.loaded = state


def state_of(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"app": Part(weight=torch.randn(300, 40), bias=torch.randn(40),
                        optim={"step": torch.tensor(3.0), "betas": (0.9, 0.95), "lr": 1e-3,
                               "empty": torch.empty(0)}),
            "progress": Part(step=7, samples_consumed=112),
            "rng": Part(rank0={"cpu": torch.get_rng_state()})}


def write_copy(folder: Path, state: dict, step: int, rank: int = 0) -> memory.Copy:
    tree, tensors = memory.flatten(state)
    slot = memory.slots_of(folder, rank)[0]
    table = slot.stage(tensors)
    skeleton = io.BytesIO()
    torch.save(tree, skeleton)
    copy = slot.commit(rank=rank, step=step, table=table, skeleton=skeleton.getvalue(),
                       extra={"world_size": 1, "device_type": "cpu", "training": {}})
    slot.close()
    return copy


# ------------------------------------------------------------ fast checks --
def test_a_copy_comes_back_bit_for_bit_into_the_live_state(tmp_path):
    saved = state_of(0)
    copy = write_copy(tmp_path, saved, step=7)
    live = state_of(1)   # other values, the same shapes
    fitted = memory.fit(live, *memory.read_copy(copy))
    memory.apply(live, fitted)
    assert torch.equal(live["app"].values["weight"], saved["app"].values["weight"])
    assert torch.equal(live["app"].values["bias"], saved["app"].values["bias"])
    optim = live["app"].loaded["optim"]
    assert optim["betas"] == (0.9, 0.95) and optim["lr"] == 1e-3
    assert torch.equal(optim["step"], torch.tensor(3.0))
    assert live["progress"].loaded == {"step": 7, "samples_consumed": 112}
    assert torch.equal(live["rng"].loaded["rank0"]["cpu"], saved["rng"].values["rank0"]["cpu"])


def test_a_copy_without_its_record_or_with_a_changed_byte_is_never_used(tmp_path):
    copy = write_copy(tmp_path, state_of(0), step=7)
    assert memory.inventory(tmp_path, 1) == {(0, 7): copy}
    with open(copy.path / memory.DATA, "r+b") as data:   # one bit, in the second block
        data.seek(integrity.BLOCK_BYTES - 1 if copy.record["sizes"]["data"]
                  > integrity.BLOCK_BYTES else 100)
        byte = data.read(1)
        data.seek(-1, os.SEEK_CUR)
        data.write(bytes([byte[0] ^ 1]))
    with pytest.raises(integrity.ChecksumMismatch, match="does not match its checksum"):
        memory.read_copy(copy)
    (copy.path / memory.RECORD).unlink()   # cut off before its commit record
    assert memory.inventory(tmp_path, 1) == {}


def test_a_copy_of_another_shape_is_refused_before_anything_is_written(tmp_path):
    copy = write_copy(tmp_path, state_of(0), step=7)
    live = state_of(1)
    live["app"].values["weight"] = torch.zeros(300, 41)
    before = live["app"].values["bias"].clone()
    with pytest.raises(memory.MemoryCopyError, match=r"app.weight is \(300, 40\)"):
        memory.fit(live, *memory.read_copy(copy))
    assert torch.equal(live["app"].values["bias"], before)


def test_partners_are_on_another_node_and_one_node_has_none():
    two = partners.Partners.of(["a", "a", "b", "b"])
    assert two.partner == (2, 3, 0, 1) and two.nodes == 2
    three = partners.Partners.of(["a", "b", "c", "a", "b", "c"])
    for rank, partner in enumerate(three.partner):
        assert three.node[partner] != three.node[rank]
    assert sorted(three.partner) == list(range(6))   # every rank holds one copy
    uneven = partners.Partners.of(["a", "a", "a", "b"])
    assert all(uneven.node[p] != uneven.node[r] for r, p in enumerate(uneven.partner))
    assert uneven.sources(3) == [0, 1, 2]
    assert partners.Partners.of(["a", "a"]).partner == (None, None)


def test_a_memory_dir_that_cannot_hold_copies_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = run_module("train",
                        "checkpoint.memory_interval_steps=2",
                        f"checkpoint.memory_dir={blocker}",
                        f"checkpoint.dir={tmp_path / 'ckpt'}", f"log.dir={tmp_path / 'logs'}",
                        "model.d_model=32", "model.n_layers=1", "train.max_steps=2", check=False)
    assert result.returncode == 2, result.stderr
    assert "checkpoint.memory_dir" in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------- end to end --
@pytest.mark.slow
def test_a_killed_worker_restarts_from_its_node_memory_copy(tmp_path):
    """Durable every 8 steps, memory every step: a worker killed at step 11 or later
    restarts from the memory copy (newer than durable step 8), bit-identical."""
    steps = ["train.max_steps=20", "checkpoint.interval_steps=8",
             "checkpoint.memory_interval_steps=1"]
    ref, ref_log = start_resume(ROOT, tmp_path / "reference", *steps)
    assert finish(ref, 600) == 0, ref_log.read_text()[-3000:]
    proc, log = start_resume(ROOT, tmp_path / "killed", *steps)
    logs = tmp_path / "killed" / "logs"
    wait_until(lambda: len(read_events(logs, "memory_save")) >= 11, proc, "11 memory copies",
               log_file=log)
    os.kill(worker(proc.pid, rank=1), signal.SIGKILL)
    assert finish(proc, 600) == 0, log.read_text()[-3000:]
    reference, got = losses(tmp_path / "reference" / "logs"), losses(logs)
    assert sorted(got) == list(range(1, 21))
    for step, values in got.items():
        assert values == reference[step], (step, values, reference[step])   # bit-identical
    starts = read_events(logs, "start")
    assert [s["restart"] for s in starts] == [0, 1]
    assert starts[1]["resumed_tier"] == "memory", starts[1]
    assert starts[1]["step"] >= 10 and starts[1]["step"] % 8, starts[1]   # not a durable step
    assert "memory copy of step" in starts[1]["resumed_from"]
    # Freed once the final state is durable.
    folder = memory.run_folder("/dev/shm", str(tmp_path / "killed" / "ckpt"))
    assert not folder.exists()
    saves = read_events(logs, "memory_save")
    assert all(e["error"] is None and e["bytes"] > 0 for e in saves), saves
