"""`copier update` brings template changes into a project and keeps the user's edits."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml
from copier import run_copy, run_update

from conftest import REPO


def git(cwd: Path, *args: str) -> str:
    env_args = ["-c", "user.name=t", "-c", "user.email=t@example.invalid",
                "-c", "init.defaultBranch=main"]
    return subprocess.run(["git", *env_args, *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def snapshot_template(dst: Path) -> Path:
    """A git repository holding the template as it is in the working tree, tagged v1.0.0."""
    shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".scratch", "__pycache__", ".pytest_cache", ".ruff_cache"))
    git(dst, "init", "-q")
    git(dst, "add", "-A")
    git(dst, "commit", "-qm", "v1")
    git(dst, "tag", "v1.0.0")
    return dst


def test_update_merges_template_changes_and_keeps_user_edits(tmp_path):
    template = snapshot_template(tmp_path / "template")
    project = tmp_path / "project"
    run_copy(str(template), str(project), defaults=True, vcs_ref="v1.0.0", quiet=True,
             data={"keep_last": 5})
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "generated")

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
    assert answers["_commit"] == "v1.1.0" and answers["keep_last"] == 5
    assert "## Added in 1.1" in (project / "README.md").read_text()
    assert "max_steps: 9000" in config.read_text()
    for path in project.rglob("*"):
        if path.is_file() and ".git" not in path.parts:
            text = path.read_text(errors="replace")
            assert "<<<<<<<" not in text and ">>>>>>>" not in text, path
