"""Training end to end under torchrun (CPU, gloo): save, commit, retain, resume."""

import json
from pathlib import Path

import pytest
import torch
from file_events import FileReads
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import overrides_for, read_metrics, run_module, torchrun

SMALL = ["model.d_model=32", "model.n_layers=1", "log.every_steps=4"]


overrides = overrides_for(*SMALL)


@pytest.mark.slow
def test_two_ranks_save_retain_and_resume(run_dirs, tmp_path):
    args = overrides(run_dirs, "checkpoint.interval_steps=4", "checkpoint.keep_last=2")
    ckpt = Path(run_dirs["ckpt"])
    with FileReads(ckpt) as reads:   # seen from outside: inotify
        torchrun(2, "train", "train.max_steps=12", *args)
    # No process of a save reads back what it wrote: the commit reads the writers' record.
    in_checkpoints = {Path(name).name for name in reads.files if name.startswith("step_")}
    assert in_checkpoints <= {".checksums.json", "commit.json"}, reads.files
    assert any(name.endswith(".checksums.json") for name in reads.files), reads.files
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000000008", "step_000000012"]
    for step_dir in ckpt.glob("step_*"):
        names = {p.name for p in step_dir.iterdir()}
        assert {".metadata", "commit.json", "__0_0.distcp", "__1_0.distcp"} <= names
    record = json.loads((ckpt / "step_000000012" / "commit.json").read_text())
    assert record["step"] == 12 and record["world_size"] == 2 and record["reason"] == "final"
    for key in ("global_batch_size", "micro_batch_size", "created_at", "blocking_s",
                "commit_latency_s", "torch_version", "config"):
        assert key in record
    assert record["config"]["checkpoint"]["interval_steps"] == 4

    # PyTorch's own converter reads the checkpoint: the format is plain DCP.
    dcp_to_torch_save(ckpt / "step_000000012", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert "embed.weight" in full["app"]["model"]
    assert full["progress"]["step"] == 12

    torchrun(2, "train", "train.max_steps=16", *args)
    events = read_metrics(Path(run_dirs["logs"]))
    starts = [e for e in events if e["event"] == "start"]
    assert [s["step"] for s in starts] == [0, 12]
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == list(range(1, 13)) + list(range(13, 17))
    saves = [(e["step"], e["reason"]) for e in events if e["event"] == "save"]
    assert saves == [(4, "interval"), (8, "interval"), (12, "final"), (16, "final")]
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000000012", "step_000000016"]


@pytest.mark.torch_api
@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_single_process_without_torchrun_in_each_mode(run_dirs, mode):
    args = overrides(run_dirs, "checkpoint.interval_steps=3", f"checkpoint.async_mode={mode}")
    proc = run_module("train", "train.max_steps=6", *args)
    assert "finished at step 6" in proc.stdout
    saves = [e for e in read_metrics(Path(run_dirs["logs"])) if e["event"] == "save"]
    assert [(e["step"], e["mode"]) for e in saves] == [(3, mode), (6, mode)]
    assert all(e["commit_latency_s"] >= e["blocking_s"] > 0 for e in saves)


def test_world_size_that_cannot_keep_the_global_batch_is_refused(run_dirs):
    proc = torchrun(2, "train", "train.global_batch_size=6", "train.micro_batch_size=2",
                    *overrides(run_dirs), check=False)
    assert proc.returncode != 0
    assert "train.global_batch_size=6 cannot be split over 2 ranks" in proc.stderr
    ckpt = Path(run_dirs["ckpt"])   # nothing but the .gitignore of a directory made here
    assert not ckpt.exists() or [p.name for p in ckpt.iterdir()] == [".gitignore"]
