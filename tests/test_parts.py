"""Optional parts: rendered on request, refused with the answer to change, added by an update.

The memory tier, the experiment trackers, the cloud notice pollers, straggler detection
and the multi-node drill are rendered only when their copier answer says so (copier.yml,
"optional parts"). A default render leaves them out and stays lint-clean; a setting that
turns one on stops the command with exit 2 and the `copier update --data ...` that adds
it; and that update adds it cleanly to a project that has trained, which then resumes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from copier import run_update
from test_update import generated_project, snapshot_template

from conftest import assert_merged, git, package_of, render, run_in

# What each part adds to a render, below src/<package>/ and tests/.
PART_FILES = {
    "memory_tier": ["src/{p}/checkpoint/memory/tier.py", "src/{p}/checkpoint/memory/copies.py",
                    "src/{p}/checkpoint/memory/partners.py", "src/{p}/tools/drill_memory.py",
                    "tests/test_memory_tier.py"],
    "trackers": ["src/{p}/tracking/trackers.py", "tests/test_tracking.py"],
    "cloud": ["src/{p}/preemption/notices.py", "tests/test_cloud_notices.py"],
    "straggler_detection": ["src/{p}/recovery/stragglers.py", "tests/test_stragglers.py"],
    "multi_node_drill": ["src/{p}/tools/drill_nodes.py", "tests/test_node_loss.py"],
}


def source_lines(project: Path) -> tuple[int, int]:
    """(modules, lines) of the package's Python source."""
    files = list((project / "src").rglob("*.py"))
    return len(files), sum(len(f.read_text(encoding="utf-8").splitlines()) for f in files)


def test_the_default_render_leaves_every_optional_part_out(default_project, full_project):
    for answer, files in PART_FILES.items():
        for name in files:
            assert not (default_project / name.format(p="my_run")).exists(), (answer, name)
            assert (full_project / name.format(p="my_run")).is_file(), (answer, name)
    assert not (default_project / "src/my_run/checkpoint/memory").exists()
    assert not (default_project / "src/my_run/tracking").exists()
    pyproject = (default_project / "pyproject.toml").read_text()
    assert "wandb" not in pyproject and "wandb" in (full_project / "pyproject.toml").read_text()
    default, full = source_lines(default_project), source_lines(full_project)
    print(f"\nsource: default render {default[0]} modules, {default[1]} lines; "
          f"every part {full[0]} modules, {full[1]} lines")
    assert default[1] < full[1] - 1500


def test_each_optional_part_is_rendered_by_its_own_answer(tmp_path):
    project = render(tmp_path / "p", straggler_detection=True)
    assert (project / "src/my_run/recovery/stragglers.py").is_file()
    assert not (project / "src/my_run/checkpoint/memory").exists()
    config = yaml.safe_load((project / "configs/train.yaml").read_text())
    assert config["recovery"]["straggler_every_steps"] == 50   # on where it is rendered
    # More than one node: the multi-node drill by default; the memory tier brings the
    # drill's node helpers with its own drill.
    assert (render(tmp_path / "n", nodes=2) / "src/my_run/tools/drill_nodes.py").is_file()
    memory = render(tmp_path / "m", memory_tier=True)
    assert (memory / "src/my_run/tools/drill_nodes.py").is_file()
    assert not (memory / "tests/test_node_loss.py").exists()


# A setting that needs a part, and the copier answer the refusal must name.
REFUSED = [
    (["train", "checkpoint.memory_interval_steps=5"], "checkpoint.memory_interval_steps=5",
     "memory_tier=true"),
    (["resume", "--dry-run", "checkpoint.memory_interval_steps=5"],
     "checkpoint.memory_interval_steps=5", "memory_tier=true"),
    (["train", "log.trackers=[tensorboard]"], "log.trackers=['tensorboard']", "trackers=true"),
    (["train", "preemption.notice_source=gcp"], "preemption.notice_source=gcp", "cloud=gcp"),
    (["train", "recovery.straggler_every_steps=10"], "recovery.straggler_every_steps=10",
     "straggler_detection=true"),
    (["drill", "--tier", "memory", "--save-ranks", "2", "--resume-ranks", "2", "--out", "d"],
     "--tier memory", "memory_tier=true"),
    (["drill", "--save-ranks", "2", "--save-nodes", "2", "--resume-ranks", "1", "--out", "d"],
     "--save-nodes 2", "multi_node_drill=true"),
]


@pytest.mark.parametrize("command, setting, answer", REFUSED,
                         ids=[r[2].split("=")[0] + "-" + r[0][0] for r in REFUSED])
def test_a_setting_for_a_part_not_rendered_exits_2_naming_the_answer(default_project, tmp_path,
                                                                      command, setting, answer):
    name, *args = command
    dirs = ([] if name == "drill" else
            [f"checkpoint.dir={tmp_path / 'ck'}", f"log.dir={tmp_path / 'logs'}"])
    proc = run_in(default_project, "-m", f"my_run.{name}", *args, *dirs, timeout=300,
                  check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {setting} turns on "), line
    assert f"`copier update --data {answer}`" in line, line
    assert not (tmp_path / "ck").exists() and not (default_project / "d").exists()


@pytest.mark.slow
def test_an_update_adds_the_memory_tier_to_a_project_that_has_trained(tmp_path):
    """A default project trains and commits; `copier update --data memory_tier=true` adds
    the memory tier with nothing to merge by hand; the project's memory-tier tests pass
    and training resumes its checkpoint with memory copies on."""
    template = snapshot_template(tmp_path / "template")
    project = generated_project(template, tmp_path / "project")
    package = package_of(project)
    small = ["model.d_model=32", "model.n_layers=1", "checkpoint.interval_steps=2",
             "checkpoint.async_mode=sync"]
    proc = run_in(project, "-m", f"{package}.train", "train.max_steps=4", *small)
    assert "finished at step 4" in proc.stdout
    refused = run_in(project, "-m", f"{package}.train", "train.max_steps=6", *small,
                     "checkpoint.memory_interval_steps=1", check=False)
    assert refused.returncode == 2 and "copier update --data memory_tier=true" in refused.stderr
    assert git(project, "status", "--porcelain", "--untracked-files=all") == ""

    run_update(str(project), data={"memory_tier": True}, defaults=True, overwrite=True,
               quiet=True, unsafe=False)

    answers = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert answers["memory_tier"] is True
    changed = git(project, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert all(line[:2] in ("??", " M", "A ", "M ") for line in changed), changed
    added = {line[3:] for line in changed if line.startswith(("??", "A "))}
    assert f"src/{package}/checkpoint/memory/tier.py" in added and \
        "tests/test_memory_tier.py" in added, changed
    assert_merged(project)

    suite = run_in(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                   "tests/test_memory_tier.py", timeout=900, check=False)
    assert suite.returncode == 0, suite.stdout[-4000:]
    proc = run_in(project, "-m", f"{package}.train", "train.max_steps=6", *small,
                  "checkpoint.memory_interval_steps=1",
                  f"checkpoint.memory_dir={tmp_path / 'shm'}")
    resumed = re.search(r"resumed from (\S+): step (\d+),", proc.stdout)
    assert resumed and resumed.group(2) == "4", proc.stdout[-3000:]
    assert "finished at step 6" in proc.stdout
    events = (project / "logs/metrics.jsonl").read_text()
    assert '"event": "memory_save"' in events
