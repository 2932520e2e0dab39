"""What a `copier update` can leave behind, found by the fast suite.

- Merge conflicts: copier writes both sides of a conflict into the file between git's
  markers, exits 0 and lists nothing. The first test lists every marker line of the
  project's files (README.md, "Updating", says how to resolve them).
- Imports of harness modules that moved (the package's reorganisation into folders,
  CHANGELOG.md): a task importing an old one is told the new import, exit 2.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PACKAGE, PROJECT, project_module, suite_root

# What `git diff --check` counts as a conflict marker: seven <, =, > or | at the start of
# a line, then a space or the end of the line (the harness's config reader uses the same
# rule, in config/yaml_file.py; this file keeps its own so that it works whatever else
# the update broke).
MARKER = re.compile(rb"^([<=>|])\1{6}(?:[ \t\r]|$)", re.MULTILINE)
# Built, never spelled out, so that this file does not look like a conflict itself.
START, MIDDLE, END = "<" * 7, "=" * 7, ">" * 7
SKIPPED_DIRS = ("__pycache__", "node_modules")
LARGEST = 16 << 20          # bytes; larger files are data, never merged by an update


def project_files(root: Path) -> list[Path]:
    """The project's files as git sees them: tracked, and new ones not ignored. Outside a
    git checkout, every file except hidden folders, caches and run output (folders whose
    .gitignore ignores everything, as the harness writes into those it makes)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root, capture_output=True, check=True).stdout
        return sorted({root / os.fsdecode(name) for name in listed.split(b"\0") if name})
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout
        pass
    found = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS
                   and not d.endswith(".egg-info") and not _run_output(here / d)]
        found += [here / name for name in files]
    return sorted(found)


def _run_output(folder: Path) -> bool:
    try:
        lines = (folder / ".gitignore").read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return "*" in (line.strip() for line in lines)


def conflicts(root: Path) -> list[str]:
    """``path:line: marker`` for every conflict-marker line of a text file under ``root``,
    and ``path: ...`` for every .rej file (`copier update --conflict rej`)."""
    found = []
    for path in project_files(root):
        shown = path.relative_to(root).as_posix()
        if path.suffix == ".rej":
            found.append(f"{shown}: a rejected hunk of `copier update`: apply it by hand, "
                         "then delete the file")
            continue
        try:
            if path.stat().st_size > LARGEST:  # data, not a file an update merges
                continue
            data = path.read_bytes()
        except OSError:                       # deleted but still tracked, a dangling link
            continue
        if b"\0" in data[:8192]:              # binary
            continue
        for match in MARKER.finditer(data):
            line = data.count(b"\n", 0, match.start()) + 1
            end = data.find(b"\n", match.start())
            text = data[match.start():end if end >= 0 else len(data)].decode(errors="replace")
            found.append(f"{shown}:{line}: {text.rstrip()}")
    return found


def test_no_file_of_the_project_holds_merge_conflict_markers():
    """After `copier update`: every conflict it left, file and line (resolve them as
    README.md's "Updating" says, then run the fast tests again)."""
    found = conflicts(PROJECT)
    assert not found, ("merge conflicts left by `copier update` (keep one side of each "
                       f"{START} ... {END} block, delete the markers):\n  "
                       + "\n  ".join(found))


def test_the_conflict_finder_finds_each_marker_and_nothing_else(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/train.yaml").write_text(
        f"train:\n{START} before updating\n  lr: 1\n{MIDDLE}\n  lr: 2\n{END} after updating\n")
    (tmp_path / "notes.md").write_text(f"Title\n{MIDDLE}=\n{START}< eight\n== ====\n"
                                       f"  {END} indented\n")
    (tmp_path / "model.bin").write_bytes(b"\0\n" + START.encode() + b" \n")   # binary
    (tmp_path / "logs").mkdir()                  # run output: never looked at
    (tmp_path / "logs/.gitignore").write_text("*\n")
    (tmp_path / "logs/out.txt").write_text(f"{MIDDLE}\n")
    (tmp_path / "task.py.rej").write_text("@@ -1 +1 @@\n")
    assert conflicts(tmp_path) == [
        f"configs/train.yaml:2: {START} before updating", f"configs/train.yaml:4: {MIDDLE}",
        f"configs/train.yaml:6: {END} after updating",
        ("task.py.rej: a rejected hunk of `copier update`: apply it by hand, then delete "
         "the file")]


# ---------------------------------------------------- modules that moved --

def test_every_module_the_table_names_exists():
    """MOVED_MODULES's new places are modules of the package; its old ones are gone,
    except the commands' entries, config/ and the folders that took an old name."""
    table = project_module("loop.task_contract").MOVED_MODULES
    stayed = {"train", "resume", "plan", "bench", "drill", "export", "verify", "memcheck",
              "prepare_data", "config", "preemption", "launch", "checkpoint.memory"}
    for old, new in table.items():
        for module in new:
            assert is_module(module) or not_rendered(module), (old, module)
        assert is_module(old) == (old in stayed and not not_rendered(old)), old


def not_rendered(name: str) -> bool:
    """Whether ``<package>.<name>`` belongs to an optional part this project lacks."""
    parts = project_module("config.parts")
    return any(name == part.module or name.startswith(part.module + ".")
               for part in parts.PARTS if not parts.rendered(part))


def is_module(name: str) -> bool:
    """Whether ``<package>.<name>`` is a module or a package of the project."""
    base = PROJECT / "src" / PACKAGE / Path(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def probe(tmp_path: Path, source: str) -> ImportError:
    """The ImportError of a module of the package (as task.py is) holding ``source``."""
    path = tmp_path / "probe_task.py"
    path.write_text("import torch\n" + source + "\n", encoding="utf-8")
    project_module("config")                          # the package, importable
    spec = importlib.util.spec_from_file_location(f"{PACKAGE}.probe_task", path)
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(ImportError) as info:
        spec.loader.exec_module(module)
    return info.value


@pytest.mark.parametrize("source, moved, fix", [
    ("from .trainer import Trainer", "{P}.trainer, which moved to {P}.loop.trainer",
     "`from .loop.trainer import Trainer`"),
    ("from .plan_model import young_interval",
     "{P}.plan_model, which moved to {P}.interval.formulas",
     "`from .interval.formulas import young_interval`"),
    ("from . import plan_model", "{P}.plan_model, which moved to {P}.interval.formulas",
     "`from .interval import formulas as plan_model`"),
    ("from .distributed import (\n    wrap_model,\n    decide_on_rank0,\n)",
     "{P}.distributed, which moved to {P}.runtime.distributed and {P}.loop.parallelize",
     ("`from .runtime.distributed import decide_on_rank0` and "
      "`from .loop.parallelize import wrap_model`")),
    ("from .config import Config, lr_factor",
     "lr_factor from {P}.config, which moved to {P}.config.schedule",
     "`from .config.schedule import lr_factor`"),
    ("from .exits import error_line", "{P}.exits, which moved to {P}.runtime.exit_codes",
     "`from .runtime.exit_codes import error_line`"),
    ("import {P}.checkpoint.planner",
     "{P}.checkpoint.planner, which moved to {P}.checkpoint.save.dcp_planner", ""),
], ids=["module", "function", "from-package", "split", "config-name", "defined-there",
        "absolute"])
def test_an_import_of_a_moved_module_is_told_the_new_one(tmp_path, source, moved, fix):
    exc = probe(tmp_path, source.replace("{P}", PACKAGE))
    message = project_module("loop.task_contract").moved_import(exc)
    assert message is not None
    assert (f"probe_task.py line 2 imports "
            f"{moved.replace('{P}', PACKAGE)} in the reorganisation") in message, message
    assert message.endswith(f"change the import{' to ' + fix if fix else ''}")


@pytest.mark.parametrize("source", ["from .config import no_such_name",
                                    "import no_such_package_anywhere",
                                    "from .trainer_of_mine import Trainer"])
def test_other_import_errors_are_left_as_they_are(tmp_path, source):
    assert project_module("loop.task_contract").moved_import(probe(tmp_path, source)) is None


def test_a_task_importing_a_moved_module_stops_train_with_exit_2(tmp_path):
    """The real command on a task of the old layout: one line naming the file, the line
    and the new import; no traceback."""
    root = suite_root()
    task = root / "src" / PACKAGE / "task.py"
    lines = task.read_text(encoding="utf-8").splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("import torch"))
    lines.insert(at, "from .trainer import Trainer  # noqa: F401\n")
    task.write_text("".join(lines), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(root / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", f"{PACKAGE}.train",
                           f"checkpoint.dir={tmp_path / 'ckpt'}", f"log.dir={tmp_path / 'logs'}"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert (f"task.py line {at + 1} imports {PACKAGE}.trainer, which moved to "
            f"{PACKAGE}.loop.trainer") in proc.stderr
    assert "change the import to `from .loop.trainer import Trainer`" in proc.stderr
