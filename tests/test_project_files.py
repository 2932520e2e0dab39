"""The files around the code: ignore files, the release notes, help texts and the plot."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
from copier import run_copy

from conftest import REPO, git, package_of, render, run_in

# ---------------------------------------------------------- ignore files ----

# In make test only: make check runs the generated suite's own check of this
# (test_output_dirs.py), and stays within its 5 minutes.
@pytest.mark.slow
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
    from test_update import snapshot_template

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


# ------------------------------------------------- paths named in the text ----

# A path in a doc or comment: folders and a file name with a source file's extension.
NAMED_PATH = re.compile(
    r"(?<![\w./:<>{}$-])((?:[\w<>-]+/)+[\w<>-]+\.(?:py|md|yaml|yml|sbatch|sh|toml))\b")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".toml", ".txt", ""}


def paths_named_but_missing(project: Path) -> list[str]:
    """Every source path that a file of ``project`` names and that does not exist.

    A path counts as the project's source when its first folder is one of the project's
    (src, tests, docs, configs, launch) or of its package (named from inside it, as the
    docs do: ``preemption/early.py``); run output (``logs/…``, ``DIR/…``) is not source.
    A path said (within a line of text around it) to be in the template repository, or
    to be rendered with a copier answer (an optional part), is left out.
    """
    package = package_of(project)
    source = project / "src" / package
    tops = {"src", "tests", "docs", "configs", "launch"} | {
        p.name for p in source.iterdir() if p.is_dir()}
    missing = []
    for path in sorted(project.rglob("*")):
        if (not path.is_file() or ".git" in path.parts or "__pycache__" in path.parts
                or path.suffix not in TEXT_SUFFIXES):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for found in NAMED_PATH.finditer(text):
            named = re.sub(r"<(?:pkg|package|package_name)>", package, found.group(1))
            if "<" in named or named.split("/", 1)[0] not in tops:
                continue
            line = text[text.rfind("\n", 0, found.start()) + 1:text.find("\n", found.end())]
            around = text[found.start() - 80:found.end() + 80]
            if "template repository" in around:
                continue
            if re.search(r"rendered with|copier answer", around):   # an optional part
                continue
            if not any((base / named).exists() for base in (project, source, path.parent)):
                missing.append(f"{path.relative_to(project)} names {named}: {line.strip()}")
    return missing


def test_every_source_path_a_doc_or_comment_names_exists(default_project, full_project,
                                                         tmp_path):
    every_launcher = render(tmp_path / "p", launchers=["slurm", "kubernetes", "skypilot"],
                            cloud="aws")
    for project in (default_project, full_project, every_launcher):
        assert paths_named_but_missing(project) == [], project.name


@pytest.mark.parametrize("which", ["default_project", "full_project"])
def test_extending_names_every_folder_and_command_of_the_package(which, request):
    """docs/EXTENDING.md's "Where the harness lives": a row for each folder of the package
    (the user's models/ and datasets/ are named above the table), each command listed."""
    project = request.getfixturevalue(which)
    package = package_of(project)
    source = project / "src" / package
    text = (project / "docs/EXTENDING.md").read_text(encoding="utf-8")
    section = text.split("## Where the harness lives", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)/` \|", section, re.MULTILINE))
    folders = {p.name for p in source.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - {"models", "datasets"} <= rows, folders - rows
    assert rows <= folders, rows - folders
    commands = {p.stem for p in source.glob("*.py")} - {"__init__", "task"}
    listed = set(re.findall(r"`(\w+)`", section.split("Each folder", 1)[0]))
    assert commands <= listed, commands - listed


# A module docstring says what the module holds and why, and points to docs/ for the rest.
MAX_MODULE_DOCSTRING_LINES = 15


@pytest.mark.parametrize("which", ["default_project", "full_project"])
def test_every_module_docstring_is_at_most_15_lines(which, request):
    """Counting the opening and closing quote lines; design prose belongs in docs/."""
    project = request.getfixturevalue(which)
    too_long = []
    for path in sorted((project / "src").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        first = tree.body[0] if tree.body else None
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            lines = first.end_lineno - first.lineno + 1
            if lines > MAX_MODULE_DOCSTRING_LINES:
                too_long.append(f"{path.relative_to(project)}: {lines} lines")
    assert too_long == [], (f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines "
                            f"(point to docs/ instead): {too_long}")


def test_architecture_names_every_module_of_a_full_render(full_project):
    source = full_project / "src" / package_of(full_project)
    text = (REPO / "docs/architecture.md").read_text(encoding="utf-8")
    unnamed = [str(p.relative_to(source)) for p in sorted(source.rglob("*.py"))
               if p.parent != source and p.name != "__init__.py"
               and not re.search(rf"\b{re.escape(p.name)}\b", text)]
    assert unnamed == [], "docs/architecture.md does not name these modules"



def test_no_module_writes_an_error_line_by_hand(full_project):
    """A command refuses by raising runtime/exit_codes.py's Refused; only exit_codes.py
    writes the `error: ` line."""
    source = full_project / "src" / package_of(full_project)
    by_hand = [f"{path.relative_to(source)}:{number}: {line.strip()}"
               for path in sorted(source.rglob("*.py"))
               if path.relative_to(source) != Path("runtime/exit_codes.py")
               for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
               if re.search(r"""["']error: """, line)]
    assert by_hand == [], "raise Refused(sentence[, status]) instead"

# checkpoint/'s wings, each importing only the ones after it (docs/architecture.md).
WING_ORDER = ("memory", "save", "load", "store")


def test_checkpoint_wings_import_only_downwards(full_project):
    """No module of a wing imports the checkpoint facade, the save decisions, or a wing
    before it: no circle and no arrow running back up in checkpoint/."""
    checkpoint = full_project / "src" / package_of(full_project) / "checkpoint"
    assert {p.name for p in checkpoint.iterdir() if p.is_dir() and p.name != "__pycache__"
            } == set(WING_ORDER)
    wrong = []
    for rank, wing in enumerate(WING_ORDER):
        allowed = set(WING_ORDER[rank:])
        for path in sorted((checkpoint / wing).glob("*.py")):
            for dots, module in re.findall(r"^\s*from (\.+)([\w.]*) import", path.read_text(),
                                           re.MULTILINE):
                if len(dots) == 1:
                    continue                      # inside its own wing
                if len(dots) == 2:                # checkpoint/<module or wing>
                    top = module.split(".")[0]
                    if top not in allowed:
                        wrong.append(f"{wing}/{path.name} imports ..{module}")
    assert wrong == []


def test_the_tested_torch_releases_are_one_list():
    """The releases CI tests (the Makefile's legs and the pinned one) are the ones the
    README and the generated pyproject.toml name, and the lowest is the project's floor."""
    legs = re.search(r"^TORCH_LEGS \?= (.+)$", (REPO / "Makefile").read_text(),
                     re.MULTILINE).group(1).split()
    pinned = re.search(r'"torch==([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    tested = sorted({*legs, pinned}, key=lambda v: tuple(map(int, v.split("."))))
    pyproject = (REPO / "template" / "pyproject.toml.jinja").read_text(encoding="utf-8")
    assert f"# Tested releases: {', '.join(tested)}." in pyproject
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    sentence = re.search(r"Tested releases: (.*?);", readme, re.DOTALL).group(1)
    assert re.findall(r"\b\d+\.\d+\.\d+\b", sentence) == tested
    compat = next((REPO / "template" / "src").glob("*/runtime/torch_compat.py")).read_text()
    floor = re.search(r"^MIN_TORCH = \((\d+), (\d+)\)", compat, re.MULTILINE).groups()
    assert tested[0].split(".")[:2] == list(floor)
