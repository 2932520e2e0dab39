"""`copier update` brings template changes into a project and keeps the user's edits."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from copier import run_copy, run_update

from conftest import FULL, REPO, assert_merged, git, package_of, run_in

WORKING_TREE_IGNORED = shutil.ignore_patterns(
    ".git", ".venv", ".scratch", "__pycache__", ".pytest_cache", ".ruff_cache")


def snapshot_template(dst: Path) -> Path:
    """A git repository holding the template as it is in the working tree, tagged v1.0.0."""
    shutil.copytree(REPO, dst, ignore=WORKING_TREE_IGNORED)
    git(dst, "init", "-q")
    git(dst, "add", "-A")
    git(dst, "commit", "-qm", "v1")
    git(dst, "tag", "v1.0.0")
    return dst


def committed_then_working_template(dst: Path, base: str = "HEAD") -> Path:
    """The template as committed at ``base``, tagged v1.0.0, then the working tree, v2.0.0."""
    dst.mkdir()
    archive = subprocess.run(["git", "archive", "--format=tar", base], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
    git(dst, "init", "-q")
    git(dst, "add", "-A")
    git(dst, "commit", "-qm", "v1")
    git(dst, "tag", "v1.0.0")
    for path in dst.iterdir():  # v2 is exactly the working tree: removed files go too
        if path.is_dir() and path.name != ".git":
            shutil.rmtree(path)
        elif path.is_file():
            path.unlink()
    shutil.copytree(REPO, dst, ignore=WORKING_TREE_IGNORED, dirs_exist_ok=True)
    git(dst, "add", "-A")
    git(dst, "commit", "-q", "--allow-empty", "-m", "v2")
    git(dst, "tag", "v2.0.0")
    return dst


def generated_project(template: Path, project: Path, **data) -> Path:
    """The template's v1.0.0 rendered into ``project``, committed as a user's first commit."""
    run_copy(str(template), str(project), data=data, defaults=True, vcs_ref="v1.0.0",
             quiet=True, unsafe=False)
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "generated")
    return project


def questions_at(template: Path, ref: str) -> dict[str, dict]:
    """copier.yml's questions at ``ref`` (those stored in the answers file, not computed ones)."""
    text = subprocess.run(["git", "show", f"{ref}:copier.yml"], cwd=template, check=True,
                          capture_output=True, text=True).stdout
    return {name: spec for name, spec in yaml.safe_load(text).items()
            if not name.startswith("_") and isinstance(spec, dict)
            and spec.get("when") is not False}


# An answer other than the default for every question.
NON_DEFAULT_ANSWERS = {
    "project_name": "Spot Trainer",
    "package_name": "spot_lab",
    "description": "Pretraining on spot machines",
    "docs_language": "zh",
    "mtbi_hours": 3.5,
    "step_time_seconds": 0.75,
    "checkpoint_save_seconds": 22.0,
    "restart_seconds": 45.0,
    "badput_target_percent": 7.5,
    "checkpoint_dir": "s3://bucket/spot",
    "keep_last": 5,
    "async_mode": "thread",
    "grace_period_seconds": 90.0,
    "cloud": "gcp",
    "launchers": ["slurm", "kubernetes"],  # in the order of the choices, as copier stores them
    "nodes": 2,
    "gpus_per_node": 4,
    "cpus_per_node": 16,
    "image": "ghcr.io/lab/spot:v1",
    "checkpoint_size_gb": 40.0,
    "parallelism": "ddp",
    "memory_tier": True,
    "trackers": True,
    "straggler_detection": True,
    "multi_node_drill": False,   # with 2 nodes its default is true
}


def test_update_merges_template_changes_and_keeps_user_edits(tmp_path):
    template = snapshot_template(tmp_path / "template")
    project = tmp_path / "project"
    generated_project(template, project, keep_last=5)
    # A short run first, with the default checkpoint and log directories inside the
    # project, as a user runs it: its output must not make the checkout dirty, or
    # `copier update` refuses ("Destination repository is dirty").
    proc = run_in(project, "-m", f"{package_of(project)}.train", "train.max_steps=2",
                  "checkpoint.interval_steps=1", "checkpoint.async_mode=sync",
                  "model.d_model=32")
    assert "finished at step 2" in proc.stdout
    assert (project / "checkpoints").is_dir() and (project / "logs").is_dir()
    assert git(project, "status", "--porcelain", "--untracked-files=all") == ""

    # The user tunes their run...
    config = project / "configs/train.yaml"
    config.write_text(config.read_text().replace("max_steps: 2000", "max_steps: 9000"))
    git(project, "commit", "-qam", "longer run")
    # ...while the template gains a new README section.
    readme = template / "template/README.md.jinja"
    readme.write_text(readme.read_text() + "\n## Added in 1.1\n\nA new section.\n")
    git(template, "commit", "-qam", "v1.1")
    git(template, "tag", "v1.1.0")

    run_update(str(project), defaults=True, overwrite=True, quiet=True, unsafe=False)

    answers = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert answers["_commit"] == "v1.1.0" and int(answers["keep_last"]) == 5
    assert "## Added in 1.1" in (project / "README.md").read_text()
    assert "max_steps: 9000" in config.read_text()
    assert_merged(project)


@pytest.mark.slow
def test_update_on_a_clone_without_tags_takes_the_newest_commit_or_the_one_named(tmp_path):
    """The README's `copier update --defaults` on a template clone with no release tag
    takes its newest commit; `--vcs-ref <commit>` (a release's commit, as CHANGELOG.md
    names it) takes that commit and not a newer one."""
    template = snapshot_template(tmp_path / "template")
    git(template, "tag", "-d", "v1.0.0")
    readme = template / "template/README.md.jinja"
    commits = [git(template, "rev-parse", "--short", "HEAD").strip()]
    for version in ("1.1", "1.2"):
        readme.write_text(readme.read_text() + f"\n## Added in {version}\n")
        git(template, "commit", "-qam", version)
        commits.append(git(template, "rev-parse", "--short", "HEAD").strip())
    assert git(template, "tag") == ""
    project = tmp_path / "project"
    run_copy(str(template), str(project), defaults=True, vcs_ref=commits[0], quiet=True,
             unsafe=False)
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "generated")
    answers = project / ".copier-answers.yml"
    assert yaml.safe_load(answers.read_text())["_commit"] == commits[0]

    run_update(str(project), defaults=True, overwrite=True, quiet=True, unsafe=False,
               vcs_ref=commits[1])
    assert yaml.safe_load(answers.read_text())["_commit"] == commits[1]
    text = (project / "README.md").read_text()
    assert "## Added in 1.1" in text and "## Added in 1.2" not in text
    git(project, "commit", "-qam", "update to 1.1")

    run_update(str(project), defaults=True, overwrite=True, quiet=True, unsafe=False)
    assert yaml.safe_load(answers.read_text())["_commit"] == commits[2]
    assert "## Added in 1.2" in (project / "README.md").read_text()


def test_update_from_the_committed_template_keeps_every_answer(tmp_path):
    """Renaming or dropping a question would lose the user's answer on `copier update`."""
    template = committed_then_working_template(tmp_path / "template")
    assert set(NON_DEFAULT_ANSWERS) == set(questions_at(template, "v2.0.0")), \
        "NON_DEFAULT_ANSWERS must answer every question of copier.yml"
    # The committed copier.yml may lack questions the working tree adds: those are not
    # recorded at v1.0.0, so only the committed ones can be carried over.
    questions = questions_at(template, "v1.0.0")
    given = {name: value for name, value in NON_DEFAULT_ANSWERS.items() if name in questions}
    for name, value in given.items():
        assert value != questions[name].get("default"), name

    project = tmp_path / "project"
    generated_project(template, project, **given)

    run_update(str(project), defaults=True, overwrite=True, quiet=True, unsafe=False)

    answers = yaml.safe_load((project / ".copier-answers.yml").read_text(encoding="utf-8"))
    assert answers["_commit"] == "v2.0.0"
    for name, value in given.items():
        # Numeric questions are text since v0.1.0 (copier.yml): 3.5 is recorded as '3.5'.
        recorded = answers.get(name)
        if isinstance(value, (int, float)) and isinstance(recorded, str):
            recorded = type(value)(recorded)
        assert recorded == value, (name, answers.get(name))
    # The answers reached the files too, under the config's current key names.
    config = yaml.safe_load((project / "configs/train.yaml").read_text(encoding="utf-8"))
    assert config["plan"]["mtbi_hours"] == 3.5 and config["plan"]["step_time_s"] == 0.75
    assert config["checkpoint"]["keep_last"] == 5
    assert (project / "src/spot_lab").is_dir()
    assert_merged(project)


# In make test only (make check's 5 minutes): it trains a project, then updates it.
@pytest.mark.slow
def test_update_keeps_the_users_task_while_the_harness_changes(tmp_path):
    """The user edits their task, its config and a model module; the next template version
    changes the trainer, the checkpoint manager and the default task. The update merges
    with no conflict, the user's task is untouched, and the project still trains."""
    template = snapshot_template(tmp_path / "template")
    project = tmp_path / "project"
    generated_project(template, project)
    package = package_of(project)
    src = project / "src" / package

    task = src / "task.py"
    users_task = task.read_text().replace(
        "    return loss, {}",
        "    accuracy = (logits.argmax(-1) == targets).float().mean()\n"
        "    return loss, {\"accuracy\": accuracy}")
    assert users_task != task.read_text()
    task.write_text(users_task)
    tiny = src / "models/tiny.py"
    tiny.write_text(tiny.read_text().replace("nn.GELU()", "nn.SiLU()"))
    config = project / "configs/train.yaml"
    config.write_text(config.read_text().replace("  d_model: 64", "  d_model: 48")
                      .replace("  n_heads: 4", "  n_heads: 6"))
    git(project, "commit", "-qam", "my task")

    harness = template / "template/src/{{package_name}}"
    for name, line in (("loop/trainer.py", "# Harness change in 1.1: the loop.\n"),
                       ("checkpoint/save/pipeline.py", "# Harness change in 1.1: the manager.\n"),
                       ("task.py", "# The default task changed in 1.1.\n")):
        path = harness / name
        path.write_text(path.read_text() + "\n" + line)
    git(template, "commit", "-qam", "v1.1")
    git(template, "tag", "v1.1.0")

    run_update(str(project), defaults=True, overwrite=True, quiet=True, unsafe=False)

    assert "Harness change in 1.1: the loop." in (src / "loop/trainer.py").read_text()
    assert "Harness change in 1.1: the manager." in (src / "checkpoint/save/pipeline.py").read_text()
    assert task.read_text() == users_task          # the user's file, never overwritten
    assert "nn.SiLU()" in tiny.read_text() and "d_model: 48" in config.read_text()
    assert_merged(project)

    proc = run_in(project, "-m", f"{package}.train", "train.max_steps=2", "log.every_steps=1",
                  "checkpoint.async_mode=sync", f"checkpoint.dir={tmp_path / 'ck'}",
                  f"log.dir={tmp_path / 'logs'}")
    assert "finished at step 2" in proc.stdout and "| accuracy " in proc.stdout


def files_the_user_owns(project: Path) -> dict[str, str]:
    """The rows "you" and "both" of docs/EXTENDING.md's "Who owns what": path -> owner."""
    text = (project / "docs/EXTENDING.md").read_text(encoding="utf-8")
    section = text.split("## Who owns what", 1)[1].split("\n## ", 1)[0]
    owned = {}
    for owner, files in re.findall(r"^\| (you|both) \| (.*?) \|", section, re.MULTILINE):
        for name in re.findall(r"`([^`]+)`", files):
            if (project / name).is_file():
                owned[name] = owner
    return owned


def test_every_file_the_user_owns_keeps_its_edits_through_an_update(tmp_path):
    """Each file EXTENDING.md calls the user's ("you") or shared ("both") is edited, and so
    are files the user added; the next template version changes the same files; after the
    update every edit is there, the template's change arrived in each shared file and
    nowhere in a file of the user's."""
    template = snapshot_template(tmp_path / "template")
    project = generated_project(template, tmp_path / "project")
    package = package_of(project)
    owned = files_the_user_owns(project)
    assert {f"src/{package}/task.py": "you", "configs/train.yaml": "both",
            "pyproject.toml": "both"}.items() <= owned.items(), owned
    added = {f"src/{package}/my_layers.py": "def my_layer():\n    return 1\n",
             "configs/mine.yaml": "model:\n  d_model: 48\n"}
    for name, text in added.items():
        (project / name).write_text(text)
    config = project / "configs/train.yaml"
    config.write_text(config.read_text().replace("  d_model: 64", "  d_model: 48")
                      .replace("  corpus_chars: 200000", "  corpus_chars: 50000"))
    for name in owned:
        path = project / name
        path.write_text(path.read_text() + f"\n# the user's edit of {name}\n")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "my edits")

    # The template changes every one of them (at the top: the user edited the bottom).
    renamed = {f"src/{package}/task.py": "src/{{package_name}}/task.py",
               "configs/train.yaml": "configs/train.yaml.jinja",
               "pyproject.toml": "pyproject.toml.jinja"}
    for name in owned:
        path = template / "template" / renamed.get(name, name)
        first, rest = path.read_text().split("\n", 1)
        path.write_text(f"{first}\n# the template's change of {name}\n{rest}")
    git(template, "commit", "-qam", "v1.1")
    git(template, "tag", "v1.1.0")

    run_update(str(project), defaults=True, overwrite=True, quiet=True, unsafe=False)

    for name, owner in owned.items():
        text = (project / name).read_text()
        assert f"# the user's edit of {name}" in text, f"{name}: the user's edit is gone"
        arrived = f"# the template's change of {name}" in text
        assert arrived == (owner == "both"), f"{name} ({owner}): template's change {arrived}"
        assert "<<<<<<<" not in text and ">>>>>>>" not in text, name
    for name, text in added.items():
        assert (project / name).read_text() == text, name
    assert "  d_model: 48" in config.read_text() and "  corpus_chars: 50000" in config.read_text()


# The last commit before the package was reorganised into folders (CHANGELOG, v0.2.0):
# projects rendered from it must update to today's layout. It is also the commit the
# oldest supported release, v0.1.0, was cut at (CHANGELOG.md names each release's commit).
BEFORE_FOLDERS = "6d2ca9d"
V0_1_0 = BEFORE_FOLDERS


# In make test only (make check's 5 minutes): it trains a project, then updates it.
@pytest.mark.slow
def test_update_across_the_reorganisation_keeps_the_task_and_the_loader_setting(tmp_path):
    """A project rendered before the modules moved into folders, with the user's own
    task.py (the old ``build_model(cfg)`` signature), ``data.num_workers`` set in its
    config and a patched harness module, updates with no conflict and then trains.

    What becomes of the patch is what the CHANGELOG says: copier deletes the old module,
    the edit included, and the new module does not have it; the project's git history
    keeps it, to carry across by hand.
    """
    template = committed_then_working_template(tmp_path / "template", base=BEFORE_FOLDERS)
    project = tmp_path / "project"
    generated_project(template, project)
    package = package_of(project)
    src = project / "src" / package
    task = src / "task.py"
    assert "def build_model(cfg: Config) -> nn.Module:" in task.read_text()  # the old signature
    users_task = task.read_text().replace(
        "    return loss, {}",
        "    accuracy = (logits.argmax(-1) == targets).float().mean()\n"
        "    return loss, {\"accuracy\": accuracy}")
    task.write_text(users_task)
    config = project / "configs/train.yaml"
    assert "  num_workers: 0\n" in config.read_text()
    config.write_text(config.read_text().replace("  num_workers: 0\n", "  num_workers: 1\n"))
    trainer = src / "trainer.py"
    trainer.write_text(trainer.read_text() + "\n# my local patch\n")
    git(project, "commit", "-qam", "my task, my loader, my patch")

    run_update(str(project), defaults=True, overwrite=True, quiet=True, unsafe=False)

    assert task.read_text() == users_task          # the user's file, never overwritten
    assert not trainer.exists()                    # moved: the old path is gone...
    assert "# my local patch" not in (src / "loop/trainer.py").read_text()  # ...and the edit
    assert "# my local patch" in git(project, "show", f"HEAD:src/{package}/trainer.py")
    assert_merged(project)
    settings = yaml.safe_load(config.read_text())
    assert settings["data"].get("num_workers", settings.get("loader", {}).get("num_workers")) == 1

    proc = run_in(project, "-m", f"{package}.train", "train.max_steps=2", "log.every_steps=1",
                  "checkpoint.async_mode=sync", f"checkpoint.dir={tmp_path / 'ck'}",
                  f"log.dir={tmp_path / 'logs'}", "model.d_model=32")
    assert "finished at step 2" in proc.stdout and "| accuracy " in proc.stdout
    if "num_workers" in settings["data"]:          # the old key still works, with a notice
        assert "notice: data.num_workers is now loader.num_workers" in proc.stderr


def has_commit(ref: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{ref}^{{commit}}"], cwd=REPO,
                          capture_output=True, check=False).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not has_commit(V0_1_0), reason=f"a shallow clone: no commit {V0_1_0}")
def test_a_v0_1_0_project_updates_passes_its_own_suite_and_resumes_its_checkpoint(tmp_path):
    """A project copied from v0.1.0 as a user does it on a clone without tags (--vcs-ref
    at the release's commit), trained a few steps into its default checkpoint folder and
    committed, updates to this working tree with its task.py untouched (the old
    ``build_model(cfg)``, no evaluation), taking every optional part the update offers
    (conftest.FULL); then the updated project's fast suite passes (a skip only with its
    reason) and its training resumes the old checkpoint.

    This is where make test runs the fast tier of a render with every part (its slow tier
    runs in test_render.py's two halves; the default render's fast tier runs in make
    check)."""
    project = tmp_path / "project"
    run_copy(str(REPO), str(project), defaults=True, vcs_ref=V0_1_0, quiet=True, unsafe=False)
    package = package_of(project)
    task = project / "src" / package / "task.py"
    old_task = task.read_text()
    assert "def build_model(cfg: Config) -> nn.Module:" in old_task  # v0.1.0's task
    assert "build_eval_data" not in old_task
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "generated from v0.1.0")
    small = ["model.d_model=32", "model.n_layers=1", "checkpoint.interval_steps=2",
             "checkpoint.async_mode=sync"]
    proc = run_in(project, "-m", f"{package}.train", "train.max_steps=4", *small)
    assert "finished at step 4" in proc.stdout
    assert (project / "checkpoints/step_000000004").is_dir()
    assert git(project, "status", "--porcelain", "--untracked-files=all") == ""

    # --vcs-ref HEAD: the working tree (copier includes its uncommitted changes).
    run_update(str(project), data=FULL, defaults=True, overwrite=True, quiet=True,
               unsafe=False, vcs_ref="HEAD")
    answers = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert answers["_commit"] != V0_1_0
    assert all(answers[key] == value for key, value in FULL.items()), answers
    assert task.read_text() == old_task            # the user's file, never overwritten
    assert (project / f"src/{package}/loop/trainer.py").is_file()   # today's layout
    assert_merged(project)
    git(project, "add", "-A")
    git(project, "commit", "-qm", "copier update")

    began = time.monotonic()
    suite = run_in(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                   "-rs", "tests", timeout=1800, check=False)
    print(f"the updated project's fast suite: {time.monotonic() - began:.0f} s")
    summary = suite.stdout.strip().splitlines()[-1]
    assert suite.returncode == 0 and " passed" in summary, suite.stdout[-6000:]
    assert "failed" not in summary and "error" not in summary, summary
    # The old task is checked through its contract: its missing evaluation is a skip
    # with the reason, not a failure.
    assert "your task defines no build_eval_data" in suite.stdout

    proc = run_in(project, "-m", f"{package}.train", "train.max_steps=6", *small)
    resumed = re.search(r"resumed from (\S+): step (\d+),", proc.stdout)
    assert resumed, proc.stdout[-3000:]
    assert Path(resumed.group(1)).name == "step_000000004" and resumed.group(2) == "4"
    assert "finished at step 6" in proc.stdout
    assert (project / "checkpoints/step_000000006").is_dir()
    assert git(project, "status", "--porcelain", "--untracked-files=all") == ""
