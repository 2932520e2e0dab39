"""The memory tier (checkpoint/memory/: tier.py, copies.py, partners.py): copies in shared
memory, partners on other nodes, and a restart from the nearest complete copy.

The node-loss and whole-job cases run in ``drill --tier memory`` (at the end of this file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import PACKAGE, ROOT, project_module, run_module

memory = project_module("checkpoint.memory.copies")
partners = project_module("checkpoint.memory.partners")
integrity = project_module("checkpoint.store.integrity")


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


def write_copy(folder: Path, state: dict, step: int, rank: int = 0,
               slot: int = 0) -> memory.Copy:
    tree, tensors = memory.flatten(state)
    slot = memory.slots_of(folder, rank)[slot]
    table = slot.stage(tensors)
    copy = slot.commit(rank=rank, step=step, table=table, skeleton=memory.encode(tree),
                       extra={"world_size": 1, "device_type": "cpu", "training": {} })
    slot.close()
    return copy


# ------------------------------------------------------------ fast checks --
def test_a_copy_comes_back_bit_for_bit_into_the_live_state(tmp_path):
    saved = state_of(0)
    copy = write_copy(tmp_path, saved, step=7)
    live = state_of(1)   # other values, the same shapes
    fitted = memory.fit(live, memory.Opened(copy))
    memory.apply(live, fitted)
    assert torch.equal(live["app"].values["weight"], saved["app"].values["weight"])
    assert torch.equal(live["app"].values["bias"], saved["app"].values["bias"])
    optim = live["app"].loaded["optim"]
    assert optim["betas"] == (0.9, 0.95) and optim["lr"] == 1e-3
    assert torch.equal(optim["step"], torch.tensor(3.0))
    assert live["progress"].loaded == {"step": 7, "samples_consumed": 112}
    assert torch.equal(live["rng"].loaded["rank0"]["cpu"], saved["rng"].values["rank0"]["cpu"])


def test_the_skeleton_keeps_its_types_and_refuses_what_json_cannot_hold():
    tree = {"app": {"betas": (0.9, 0.95), "by_index": {0: "a", 1: [1, 2.5, None, True]},
                    "w": {memory.MARK: 3}, "inf": float("inf")},
            }
    assert memory.decode(memory.encode(tree)) == tree
    assert type(memory.decode(memory.encode(tree))["app"]["betas"]) is tuple
    with pytest.raises(memory.MemoryCopyError, match=r"app.when is a datetime"):
        import datetime
        when = {"when": datetime.datetime.now()}
        memory.encode({"app": when})


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
        memory.Opened(copy)
    memory.Opened(copy, "none").close()   # checkpoint.verify: none: the record and the sizes
    (copy.path / memory.RECORD).unlink()   # cut off before its commit record
    assert memory.inventory(tmp_path, 1) == {}


def test_a_slot_holds_no_copy_from_the_moment_it_is_written_again(tmp_path):
    copy = write_copy(tmp_path, state_of(0), step=7)
    slot = memory.Slot(copy.path)
    assert slot.complete() is not None
    slot.buffer(copy.record["sizes"]["data"])   # a new copy starts: the old one is gone
    assert slot.complete() is None and memory.inventory(tmp_path, 1) == {}
    slot.close()


def test_a_copy_of_another_shape_is_refused_before_anything_is_written(tmp_path):
    copy = write_copy(tmp_path, state_of(0), step=7)
    live = state_of(1)
    live["app"].values["weight"] = torch.zeros(300, 41)
    before = live["app"].values["bias"].clone()
    with pytest.raises(memory.MemoryCopyError, match=r"app.weight is \(300, 40\)"):
        memory.fit(live, memory.Opened(copy))
    assert torch.equal(live["app"].values["bias"], before)


def test_a_start_checks_its_newest_copy_ahead_of_the_load(tmp_path):
    tier = project_module("checkpoint.memory.tier")
    write_copy(tmp_path, state_of(0), step=5)
    newest = write_copy(tmp_path, state_of(1), step=7, slot=1)
    check = tier._Check(tmp_path, 0, 1, "all")
    check.run()
    assert check.copy.step == 7 and check.error is None and check.opened.tree
    check.opened.close()
    with open(newest.path / memory.DATA, "r+b") as data:
        data.write(b"\xff" * 8)
    check = tier._Check(tmp_path, 0, 1, "all")
    check.run()
    assert isinstance(check.error, integrity.ChecksumMismatch), check.error


def test_a_restore_opens_its_copy_with_the_check_it_is_told(tmp_path, monkeypatch):
    tier_module = project_module("checkpoint.memory.tier")
    cfg = project_module("config").load_config(str(ROOT / "configs" / "train.yaml"),
                                               ["checkpoint.verify=all"])
    runtime = project_module("runtime.distributed").Runtime(0, 1, 0, torch.device("cpu"),
                                                            "gloo")
    tier = tier_module.MemoryTier(cfg, runtime, project_module("runtime.metrics").MetricsLog(None),
                                  tmp_path, partners.Partners.of(["a"]), None)
    older = write_copy(tmp_path, state_of(0), step=5)
    newest = write_copy(tmp_path, state_of(1), step=7, slot=1)
    checks = []

    class Recorded(memory.Opened):
        def __init__(self, copy, check="all"):
            checks.append((copy.step, check))
            super().__init__(copy, check)

    monkeypatch.setattr(tier_module, "Opened", Recorded)
    tier._opened(older, "all").close()     # no check at the start
    tier.start_check()                       # the start checks the newest copy...
    tier._opened(older, "all").close()     # ...but the restore takes an older one
    tier._opened(newest, "none").close()   # a copy checked as it arrived
    assert checks == [(5, "all"), (7, "all"), (5, "all"), (7, "none")]
    tier.start_check()
    opened = tier._opened(newest, "all")          # the start's check is the restore's:
    assert checks[4:] == [(7, "all")] and opened.copy.step == 7   # not opened again
    opened.close()


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


def test_the_memory_drill_refuses_what_it_cannot_run(tmp_path):
    result = run_module("drill", "--tier", "memory", "--save-ranks", "2", "--resume-ranks", "1",
                        "--out", str(tmp_path / "d"), check=False)
    assert result.returncode == 2 and "--resume-ranks N" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    result = run_module("drill", "--tier", "memory", "--save-ranks", "2", "--resume-ranks", "2",
                        "--out", str(tmp_path / "d"), "checkpoint.memory_interval_steps=7",
                        check=False)
    assert result.returncode == 2 and "memory_interval_steps=7" in result.stderr, result.stderr


# ----------------------------------------------------------- end to end --
@pytest.mark.slow
def test_the_memory_drill_restarts_each_loss_from_its_tier(tmp_path):
    """A worker killed: its node's copies; a node lost (its memory folder deleted): the
    partner's copies on the other node; the job lost: durable storage. Each restart is
    bit-identical to the uninterrupted run from its step on (the drill compares)."""
    out = tmp_path / "drill"
    result = run_module("drill", "--tier", "memory", "--save-ranks", "2", "--resume-ranks",
                        "2", "--out", str(out), "recovery.rendezvous_timeout_s=15",
                        timeout=900, check=False)
    report = json.loads((out / "report.json").read_text())
    assert result.returncode == 0 and report["passed"], (report, result.stdout[-3000:])
    worker, node, job = (report["scenarios"][n] for n in ("worker", "node", "job"))
    every, durable = report["memory_interval_steps"], report["durable_interval_steps"]
    assert worker["resumed_tier"] == "memory" and "from this node" in worker["resumed_from"]
    assert node["resumed_tier"] == "memory" and "from partner nodes" in node["resumed_from"]
    assert node["survivor_exit"] == 74
    for loss in (worker, node):
        assert loss["resumed_from_step"] > durable and loss["steps_lost"] <= every, loss
        assert loss["max_abs_loss_diff"] == 0 and loss["max_abs_grad_norm_diff"] == 0
    assert job["resumed_tier"] == "durable" and job["resumed_from_step"] == durable
    assert report["freed_at_end"]
    assert not list(Path("/dev/shm").glob(f"{PACKAGE}-drill-*")), "the drill's copies stay"
