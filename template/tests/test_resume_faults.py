"""Resuming from what is there: a checkpoint that fails to load, or belongs to another model.

No crash loop: a checkpoint that cannot be loaded is skipped for the one before it (unless
checkpoint.strict_resume), and a checkpoint of another model is refused at start with
what differs, exit status 2, no traceback.
"""

from pathlib import Path

import pytest

from conftest import overrides_for, read_events, run_module

SMALL = ["model.d_model=32", "model.n_layers=1", "log.every_steps=2",
         "checkpoint.async_mode=sync", "checkpoint.interval_steps=2"]
overrides = overrides_for(*SMALL)


def run(dirs, *extra, check=True):
    return run_module("train", *overrides(dirs, *extra), check=check)


def garble_metadata(step_dir: Path) -> None:
    """Same-size garbage: the size check passes, the unpickler does not."""
    metadata = step_dir / ".metadata"
    metadata.write_bytes(b"\x00garbage" * (metadata.stat().st_size // 8)
                         + b"\x00" * (metadata.stat().st_size % 8))


@pytest.mark.torch_api
def test_a_checkpoint_that_fails_to_load_falls_back_to_the_previous_one(run_dirs):
    run(run_dirs, "train.max_steps=4")
    garble_metadata(Path(run_dirs["ckpt"]) / "step_000000004")
    # checkpoint.verify=none: the checksums would have caught it; this is the load's own net.
    proc = run(run_dirs, "train.max_steps=6", "checkpoint.verify=none")
    assert "cannot load checkpoint" in proc.stdout and "step_000000004" in proc.stdout
    assert "trying the one before it" in proc.stdout
    starts = read_events(Path(run_dirs["logs"]), "start")
    assert starts[-1]["step"] == 2 and "finished at step 6" in proc.stdout


@pytest.mark.torch_api
def test_strict_resume_refuses_instead_of_falling_back(run_dirs):
    run(run_dirs, "train.max_steps=4")
    garble_metadata(Path(run_dirs["ckpt"]) / "step_000000004")
    proc = run(run_dirs, "train.max_steps=6", "checkpoint.verify=none",
               "checkpoint.strict_resume=true", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "checkpoint.strict_resume is on" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.torch_api
def test_a_checkpoint_of_another_model_is_refused_with_the_differences(run_dirs):
    run(run_dirs, "train.max_steps=2")
    proc = run(run_dirs, "train.max_steps=4", "model.d_model=48", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "was saved from another model" in proc.stderr
    assert "other shape: blocks.0.mlp.0.bias [128] saved, [192] now" in proc.stderr
    assert "model.d_model: 32 saved, 48 now" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(read_events(Path(run_dirs["logs"]), "step")) == 2   # nothing trained on it


def test_resume_dry_run_shows_a_checkpoint_of_another_model(run_dirs):
    run(run_dirs, "train.max_steps=2")
    proc = run_module("resume", "--dry-run", *SMALL, "model.d_model=48",
                      f"checkpoint.dir={run_dirs['ckpt']}", f"log.dir={run_dirs['logs']}",
                      check=False)
    assert proc.returncode == 2 and "was saved from another model" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow   # kept out of the quick tier for its time; `make test` runs it
def test_a_changed_max_steps_on_resume_is_announced_with_both_learning_rates(run_dirs):
    run(run_dirs, "train.max_steps=30", "checkpoint.interval_steps=30", "train.warmup_steps=2")
    proc = run(run_dirs, "train.max_steps=40", "checkpoint.interval_steps=30",
               "train.warmup_steps=2")
    assert "train.max_steps is 40, the checkpoint's run had 30" in proc.stdout
    assert "at step 31 the learning rate is" in proc.stdout
