"""The files around the code: ignore files, the release notes, help texts and the plot."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from copier import run_copy

from conftest import REPO, package_of, render, run_in


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid",
                           "-c", "init.defaultBranch=main", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


# ---------------------------------------------------------- ignore files ----

def test_training_leaves_the_git_checkout_clean(tmp_path):
    """After a run, `git status` is clean (so `copier update` is not refused) and nothing
    training wrote is committed by `git add -A`."""
    project = render(tmp_path / "p", checkpoint_dir="runs/ckpt")
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "generated")
    package = package_of(project)
    proc = run_in(project, "-m", f"{package}.train", "train.max_steps=2",
                  "checkpoint.interval_steps=1", "checkpoint.async_mode=sync", "model.d_model=32")
    assert "finished at step 2" in proc.stdout
    run_in(project, "-m", f"{package}.train", "train.max_steps=2", "checkpoint.dir=checkpoints",
           "checkpoint.async_mode=sync", "model.d_model=32")
    (project / "slurm-12.out").write_text("a Slurm job's output\n")
    assert (project / "runs/ckpt/step_000000002/commit.json").is_file()
    assert (project / "logs/metrics.jsonl").is_file() and (project / "checkpoints").is_dir()
    assert git(project, "status", "--porcelain", "--untracked-files=all") == ""


def test_docker_build_context_leaves_out_training_output(default_project):
    patterns = [line for line in (default_project / ".dockerignore").read_text().splitlines()
                if line and not line.startswith("#")]
    for name in (".git", "checkpoints", "logs", ".venv", "**/__pycache__"):
        assert name in patterns, name
    # What the Dockerfile copies stays in.
    for name in ("src", "configs", "pyproject.toml", "README.md"):
        assert name not in patterns
    copied = re.findall(r"^COPY (.+?) \S+$", (default_project / "Dockerfile").read_text(),
                        re.MULTILINE)
    assert copied == ["pyproject.toml README.md", "src", "configs"]


# ------------------------------------------------------- release notes ----

def test_the_readmes_commands_need_no_release_tag_and_its_tags_are_released():
    """Every command works on a clone without tags (copier then takes HEAD): none pins a
    release by name; a tag the README names (the release instructions) is in the
    CHANGELOG."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    commands = "\n".join(re.findall(r"```bash\n(.*?)```", readme, re.DOTALL))
    assert "copier copy" in commands
    assert not re.search(r"--vcs-ref v\d|--branch v\d", commands), commands
    assert "<tag>" not in readme
    tags = set(re.findall(r"\b(v\d+\.\d+\.\d+)\b", readme))
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    released = set(re.findall(r"^## (v\d+\.\d+\.\d+)\b", changelog, re.MULTILINE))
    assert tags <= released, tags - released


def test_each_release_names_the_commit_it_was_cut_at():
    """A CHANGELOG heading `## vX.Y.Z — commit <sha>` per release, the commit in this
    repository (where the clone has the history) and its CHANGELOG's newest release that
    one, so `--vcs-ref <sha>` copies what the entry describes."""
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (v\d+\.\d+\.\d+)\b(.*)$", changelog, re.MULTILINE)
    assert headings, "no release in CHANGELOG.md"
    for version, rest in headings:
        named = re.match(r" — commit ([0-9a-f]{7,40})\b", rest)
        assert named, f"## {version}{rest}: name the commit it was cut at"
        sha = named.group(1)
        found = subprocess.run(["git", "show", f"{sha}:CHANGELOG.md"], cwd=REPO,
                               capture_output=True, text=True, check=False)
        if found.returncode != 0:
            shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"],
                                     cwd=REPO, capture_output=True, text=True,
                                     check=False).stdout
            assert shallow.strip() == "true", f"{version}: no commit {sha} in this repository"
            continue
        newest = re.search(r"^## (\S+)", found.stdout, re.MULTILINE)
        assert newest and newest.group(1) == version, \
            f"{version}: at {sha} the CHANGELOG's newest entry is {newest and newest.group(1)}"


def test_copier_copies_a_template_clone_that_has_no_tag(tmp_path):
    """The README's `copier copy <template> my-run`, on a clone with no release tag yet."""
    from test_update import git, snapshot_template

    template = snapshot_template(tmp_path / "template")
    git(template, "tag", "-d", "v1.0.0")
    assert git(template, "tag") == ""
    run_copy(str(template), str(tmp_path / "my-run"), defaults=True, quiet=True)
    answers = (tmp_path / "my-run" / ".copier-answers.yml").read_text(encoding="utf-8")
    assert "_commit:" in answers and (tmp_path / "my-run" / "configs/train.yaml").is_file()


# --------------------------------------------------------- help and plots ----

def test_bench_help_says_to_run_it_under_torchrun(default_project):
    proc = run_in(default_project, "-m", f"{package_of(default_project)}.bench", "--help",
                  timeout=120)
    assert "torchrun --nproc-per-node" in proc.stdout


PLOT_PROBE = """
import runpy, sys
import matplotlib
matplotlib.use("Agg")
from matplotlib.figure import Figure
figures = []
save = Figure.savefig
def keep(self, *args, **kwargs):
    figures.append(self)
    return save(self, *args, **kwargs)
Figure.savefig = keep
sys.argv = ["plan", "--plot", sys.argv[1]]
try:
    runpy.run_module("{package}.plan", run_name="__main__")
except SystemExit as exc:
    assert not exc.code, exc.code
(fig,) = figures
renderer = fig.canvas.get_renderer()
(ax,) = fig.axes
legend = ax.get_legend()
print("title:", ax.get_title())
print("overlap:", legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)))
"""


def test_badput_plot_legend_is_off_the_curve_and_title_gives_t_and_target(default_project,
                                                                         tmp_path):
    package = package_of(default_project)
    out = tmp_path / "badput.png"
    proc = run_in(default_project, "-c", PLOT_PROBE.replace("{package}", package), str(out),
                  timeout=120)
    assert out.stat().st_size > 0
    assert "overlap: False" in proc.stdout  # the legend sits beside the axes, not on them
    title = next(line for line in proc.stdout.splitlines() if line.startswith("title:"))
    assert "T = 2 s" in title and "target 5 %" in title, title


def test_plot_hints_name_the_projects_plot_extra(default_project):
    package = package_of(default_project)
    blocked = ("import sys, runpy; sys.modules['matplotlib'] = None; "
               f"sys.argv = ['plan', '--plot', 'x.png']; runpy.run_module('{package}.plan', "
               "run_name='__main__')")
    proc = run_in(default_project, "-c", blocked, check=False, timeout=120)
    assert proc.returncode == 1
    assert "pip install -e '.[plot]'" in proc.stderr, proc.stderr
    pyproject = (default_project / "pyproject.toml").read_text()
    assert re.search(r'^plot = \["matplotlib', pyproject, re.MULTILINE)
    for path in default_project.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".md", ".toml", ".yaml"):
            assert "pip install matplotlib" not in path.read_text(encoding="utf-8"), path
