"""train.compile: a run saved compiled resumes uncompiled and the reverse.

Compiling replaces each shard unit's forward in place, so checkpoints carry the same keys
either way (no ``_orig_mod.``). On the CPU, torch's inductor builds with the machine's
C++ compiler; the first step pays the compilation.
"""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint import FileSystemReader

from conftest import read_events, run_module

RUN = ["train.max_steps=4", "checkpoint.interval_steps=2", "eval.at_end=false",
       "log.every_steps=1"]


def losses(log_dir) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(log_dir, "step")}


def keys(ckpt, step: int) -> set[str]:
    return set(FileSystemReader(str(ckpt / f"step_{step:09d}")).read_metadata()
               .state_dict_metadata)


def built(cache) -> list:
    """What inductor generated into its cache directory (nothing without compilation)."""
    return [path for path in cache.rglob("*") if path.is_file()] if cache.exists() else []


@pytest.mark.slow
def test_compiled_and_eager_runs_resume_each_other(tmp_path, monkeypatch):
    runs = {}
    for name, first, then in (("compiled_first", "true", "false"),
                              ("eager_first", "false", "true")):
        ckpt, logs = tmp_path / name / "ckpt", tmp_path / name / "logs"
        where = [f"checkpoint.dir={ckpt}", f"log.dir={logs}"]
        for steps, compiled in ((4, first), (6, then)):
            # The compiled parts share an inductor cache and must have built code there;
            # the eager parts' cache stays empty.
            cache = tmp_path / ("inductor" if compiled == "true" else "no_inductor")
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
            done = run_module("train", *RUN, f"train.max_steps={steps}",
                              f"train.compile={compiled}", *where, timeout=600)
            assert bool(built(cache)) == (compiled == "true"), (name, steps)
        assert "resumed from" in done.stdout
        runs[name] = (ckpt, losses(logs))

    (compiled_ckpt, compiled_first), (eager_ckpt, eager_first) = (
        runs["compiled_first"], runs["eager_first"])
    saved = keys(compiled_ckpt, 4)
    assert saved == keys(eager_ckpt, 4)
    assert not [key for key in saved if "_orig_mod" in key]
    assert sorted(compiled_first) == sorted(eager_first) == list(range(1, 7))
    for step in range(1, 7):   # compiled steps 1-4 then eager 5-6, against the reverse
        assert compiled_first[step] == pytest.approx(eager_first[step], rel=1e-5), step


@pytest.mark.torch_api
@pytest.mark.slow
def test_a_compiled_run_saves_the_keys_an_eager_run_saves(tmp_path, monkeypatch):
    """One compiled start and one eager start, two steps each: the same checkpoint keys,
    none of them ``_orig_mod.``; inductor built code for the compiled one. The short form
    of the test above, which the torch compatibility legs run."""
    saved = {}
    for compiled in ("true", "false"):
        cache = tmp_path / f"inductor-{compiled}"
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        ckpt = tmp_path / compiled / "ckpt"
        run_module("train", *RUN, "train.max_steps=2", f"train.compile={compiled}",
                   f"checkpoint.dir={ckpt}", f"log.dir={tmp_path / compiled / 'logs'}",
                   timeout=600)
        assert bool(built(cache)) == (compiled == "true")
        saved[compiled] = keys(ckpt, 2)
    assert saved["true"] == saved["false"]
    assert not [key for key in saved["true"] if "_orig_mod" in key]
