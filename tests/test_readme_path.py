"""The generated README's path, walked as a new user would walk it.

Render, install, train with the command the README shows, get interrupted the way Slurm
does it (SIGUSR1 to the command), run the same command again to resume and finish, then
`copier update` the project that has trained. Every command shown is safe: the commands
the README and the after-copy message show to train never start torchrun bare.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from copier import run_copy, run_update
from test_update import snapshot_template

from conftest import REPO, assert_merged, events, git, package_of

SHORT = ["model.d_model=32", "model.n_layers=1", "train.max_steps=400",
         "checkpoint.interval_steps=10", "log.every_steps=10"]


def train_commands(readme: str) -> list[str]:
    """The command lines of the README's "Train" section."""
    section = readme.split("## Train", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


@pytest.mark.slow
def test_the_readme_path_ends_saved_and_resumable(tmp_path):
    template = snapshot_template(tmp_path / "template")  # a committed copy: updatable
    run_copy(str(template), str(tmp_path / "my-run"), defaults=True, quiet=True,
             vcs_ref="v1.0.0")
    project = tmp_path / "my-run"
    package = package_of(project)
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "generated")

    # Install the project (a real build of its pyproject.toml) into a folder of its own;
    # its dependencies are this environment's.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), "."], cwd=project, check=True,
                   capture_output=True)
    python = sys.executable

    readme = (project / "README.md").read_text()
    commands = train_commands(readme)
    assert not [c for c in commands if c.startswith("torchrun")], commands
    first = next(c for c in commands if f"{package}.resume --nproc-per-node 2" in c
                 and "--dry-run" not in c)
    argv = [python if word == "python" else word for word in shlex.split(first)] + SHORT
    # The installed package, not the source tree.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(site))

    # Interrupted as Slurm does it: USR1 to the command, ahead of the time limit.
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 300
    while not events(project / "logs", "save") and time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=180) == 75, (tmp_path / "first.log").read_text()[-3000:]
    stop = events(project / "logs", "preemption")[-1]
    assert stop["final_checkpoint_step"] == stop["stop_step"]

    # The same command again resumes there and finishes.
    again = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, check=False,
                           timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from" in again.stdout and "finished at step 400" in again.stdout
    assert events(project / "logs", "start")[-1]["step"] == stop["stop_step"]

    # A project that has trained is still clean for git, so copier update goes through.
    assert git(project, "status", "--porcelain") == ""
    readme_in_template = template / "template/README.md.jinja"
    readme_in_template.write_text(readme_in_template.read_text() + "\nUpdated.\n")
    git(template, "commit", "-qam", "v1.0.1")
    git(template, "tag", "v1.0.1")
    run_update(str(project), defaults=True, overwrite=True, quiet=True, unsafe=False)
    assert "Updated." in (project / "README.md").read_text()
    assert_merged(project)


def test_the_after_copy_message_shows_a_safe_command():
    message = (REPO / "copier.yml").read_text().split("_message_after_copy:", 1)[1]
    assert "torchrun" not in message
    assert re.search(r"python -m \{\{ package_name \}\}\.resume --nproc-per-node", message)
