"""Run output never shows in git: a directory the harness makes for it ignores itself.

A checkpoint.dir or log.dir anywhere in a checkout (not only the pre-ignored checkpoints/
and logs/) must leave ``git status`` clean, or ``copier update`` refuses to run.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from conftest import overrides_for, project_module, run_module, torchrun

output_dirs = project_module("runtime.output_dirs")
overrides = overrides_for("model.d_model=32", "model.n_layers=1", "log.every_steps=1")


def ignore_file(directory: Path) -> Path:
    return directory / output_dirs.IGNORE_FILE


# ------------------------------------------------------------- the helper --
def test_a_directory_made_for_run_output_ignores_itself(tmp_path):
    made = output_dirs.make_output_dir(tmp_path / "runs" / "a" / "ck")
    assert made == tmp_path / "runs" / "a" / "ck" and made.is_dir()
    lines = ignore_file(made).read_text().splitlines()
    assert lines[-1] == "*" and all(line.startswith("#") for line in lines[:-1])
    # Only the directory itself: the parents made on the way are not run output.
    assert not ignore_file(tmp_path / "runs").exists()
    assert not ignore_file(tmp_path / "runs" / "a").exists()


def test_an_existing_directory_is_left_alone(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    assert output_dirs.make_output_dir(mine) == mine
    assert list(mine.iterdir()) == []          # no .gitignore: it is the user's
    (mine / ".gitignore").write_text("*.pt\n")
    assert output_dirs.make_output_dir(mine) == mine
    assert (mine / ".gitignore").read_text() == "*.pt\n"


def test_a_users_gitignore_is_never_replaced(tmp_path):
    (tmp_path / ".gitignore").write_text("keep me\n")
    assert not output_dirs.ignore_in_git(tmp_path)
    assert (tmp_path / ".gitignore").read_text() == "keep me\n"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert output_dirs.ignore_in_git(fresh) and not output_dirs.ignore_in_git(fresh)


def test_a_file_in_the_way_is_an_error(tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(FileExistsError):
        output_dirs.make_output_dir(tmp_path / "taken")


def test_many_processes_making_it_at_once_write_one_gitignore(tmp_path):
    target = tmp_path / "logs"
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def make():
        barrier.wait()
        try:
            output_dirs.make_output_dir(target)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and [p.name for p in target.iterdir()] == [".gitignore"]


def test_local_checkpoint_roots_ignore_themselves_object_stores_do_not(tmp_path, ckpt):
    pytest.importorskip("fsspec")
    layout, storage_mod = ckpt
    local = storage_mod.LocalStorage(tmp_path / "new" / "ckpt")
    local.makedirs("step_000000001.tmp")
    assert ignore_file(tmp_path / "new" / "ckpt").exists()
    assert not ignore_file(tmp_path / "new" / "ckpt" / "step_000000001.tmp").exists()
    # The checkpoint listing and the start's clean-up pass it by.
    assert layout.clean_leftovers(local) == ["step_000000001.tmp"]
    assert local.list_names() == [".gitignore"] and layout.list_committed(local) == []
    existing = tmp_path / "existing"
    existing.mkdir()
    storage_mod.LocalStorage(existing).probe()
    assert list(existing.iterdir()) == []
    store = storage_mod.FsspecStorage("memory://ckpt-output-dirs/run")
    try:
        store.makedirs("step_000000001")
        store.probe()
        assert ".gitignore" not in store.list_names()
    finally:
        store.fs.rm("ckpt-output-dirs", recursive=True)


def test_the_drill_out_dir_ignores_itself_and_keeps_that_across_runs(tmp_path):
    drill = project_module("tools.drill")
    out = tmp_path / "runs" / "drill"
    drill.prepare_out(out)
    assert ignore_file(out).exists()
    (out / "report.json").write_text("{}")
    drill.prepare_out(out)                   # a re-run clears the drill's own outputs only
    assert sorted(p.name for p in out.iterdir()) == [".drill", ".gitignore"]
    killed = output_dirs.make_output_dir(tmp_path / "killed")   # made, killed before its marker
    drill.prepare_out(killed)                # still the drill's: the .gitignore is no user file
    assert (killed / ".drill").exists()


# ----------------------------------------------------------- a real run --
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_training_inside_a_checkout_leaves_git_status_clean(tmp_path):
    """Two ranks train with checkpoint.dir and log.dir at new nested paths in a git
    checkout; then a resume retires old checkpoints (keep_last) and verify reads them,
    with the .gitignore among them: git sees nothing of either run."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README.md").write_text("a project\n")
    subprocess.run(["git", "-C", str(repo), "add", "README.md"], check=True)
    dirs = {"ckpt": str(repo / "runs" / "a" / "ck"), "logs": str(repo / "runs" / "b" / "logs")}

    def git_status() -> str:
        return subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                               "--untracked-files=all"], capture_output=True, text=True,
                              check=True).stdout

    assert git_status() == "A  README.md\n"
    torchrun(2, "train", *overrides(dirs, "train.max_steps=2"))
    assert git_status() == "A  README.md\n"
    assert ignore_file(Path(dirs["ckpt"])).exists() and ignore_file(Path(dirs["logs"])).exists()

    run_module("train", *overrides(dirs, "train.max_steps=4", "checkpoint.interval_steps=1",
                                   "checkpoint.keep_last=1", "checkpoint.async_mode=sync"))
    ckpt = Path(dirs["ckpt"])
    names = sorted(p.name for p in ckpt.iterdir())
    assert ".gitignore" in names and [n for n in names if n.startswith("step_")] == [
        "step_000000004"]                    # keep_last=1 retired the others beside it
    verify = run_module("verify", f"checkpoint.dir={ckpt}")
    assert "1 ok" in verify.stdout, verify.stdout
    assert git_status() == "A  README.md\n"
