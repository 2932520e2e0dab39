"""Every question refuses its bad answers with a message naming it, leaving nothing behind."""

from __future__ import annotations

import ast
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from jinja2 import FileSystemLoader
from jinja2.sandbox import SandboxedEnvironment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO, render

QUESTIONS = yaml.safe_load((REPO / "copier.yml").read_text(encoding="utf-8"))

BAD = [
    ("project_name", "9lives"), ("project_name", "my/run"), ("project_name", ""),
    # Names that rendered a project pip could not install (`trainer-`) and Kubernetes
    # names it refuses; and one longer than a DNS-1123 label (63).
    ("project_name", "Trainer_"), ("project_name", "trainer-"), ("project_name", "run "),
    ("project_name", "r" * 64),
    ("package_name", "My-Pkg"), ("package_name", "1abc"), ("package_name", "class"),
    ("package_name", "torch"),
    # Standard-library modules the project itself imports: a package of that name would
    # shadow them (the old hand-kept list let these through).
    ("package_name", "subprocess"), ("package_name", "threading"), ("package_name", "enum"),
    ("package_name", "dataclasses"), ("package_name", "yaml"),
    ("description", "   "),
    ("mtbi_hours", 0), ("mtbi_hours", -3),
    ("step_time_seconds", 0), ("checkpoint_save_seconds", -1), ("restart_seconds", -0.5),
    ("badput_target_percent", 0), ("badput_target_percent", 100),
    ("badput_target_percent", 150),
    ("checkpoint_dir", ""), ("checkpoint_dir", " ckpt"), ("checkpoint_dir", "ftp://host/x"),
    ("keep_last", 0), ("grace_period_seconds", 0),
    # Not numbers, not finite, not whole: refused by the validator, naming the question
    # (copier's own float()/int() used to fail first, naming nothing; NaN passed `<= 0`).
    ("mtbi_hours", "abc"), ("mtbi_hours", math.nan), ("step_time_seconds", math.nan),
    ("checkpoint_save_seconds", math.inf), ("mtbi_hours", math.inf), ("keep_last", 2.5),
    ("restart_seconds", -math.inf), ("grace_period_seconds", True),
    ("badput_target_percent", "five"),
    ("gpus_per_node", -1), ("gpus_per_node", 1.5), ("gpus_per_node", 65),
    ("cpus_per_node", 0), ("cpus_per_node", 2.5),
    ("nodes", 0), ("nodes", -1), ("nodes", 1.5), ("nodes", "x"), ("nodes", 1025),
    ("image", "My Image"), ("image", "trainer-:latest"), ("checkpoint_size_gb", 0),
    ("async_mode", "fast"), ("cloud", "ibm"), ("parallelism", "tp"),
    ("launchers", ["pbs"]), ("docs_language", "fr"),
]
# Questions asked only with a launcher get one, so that they are asked at all.
WITH = {"gpus_per_node": {"launchers": ["slurm"]}, "cpus_per_node": {"launchers": ["slurm"]},
        "image": {"launchers": ["kubernetes"]},
        "checkpoint_size_gb": {"launchers": ["kubernetes"]}}
CHOICES = {"async_mode", "cloud", "parallelism", "launchers", "docs_language"}
# What each numeric question's message says it accepts.
RANGES = {
    "mtbi_hours": "a finite number > 0", "step_time_seconds": "a finite number > 0",
    "checkpoint_save_seconds": "a finite number > 0", "restart_seconds": "a finite number >= 0",
    "badput_target_percent": "a finite number between 0 and 100, exclusive",
    "keep_last": "a whole number >= 1", "grace_period_seconds": "a finite number > 0",
    "gpus_per_node": "a whole number between 0 and 64, inclusive",
    "cpus_per_node": "a whole number between 1 and 4096, inclusive",
    "nodes": "a whole number between 1 and 1024, inclusive",
    "checkpoint_size_gb": "a finite number > 0",
}


@pytest.mark.parametrize("question, value", BAD, ids=[f"{q}={v!r}" for q, v in BAD])
def test_bad_answer_is_refused_naming_the_question(tmp_path, question, value):
    dst = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        render(dst, **WITH.get(question, {}), **{question: value})
    message = str(info.value)
    if question in CHOICES:  # copier's own message: "Invalid choice for 'cloud': ..."
        assert f"'{question}'" in message
    else:
        assert f"question '{question}': {question}" in message, message
    if question in RANGES:
        assert RANGES[question] in message, message
    assert not dst.exists() or not any(dst.iterdir())


GOOD = [("restart_seconds", 0), ("badput_target_percent", 99.9), ("keep_last", 1),
        ("checkpoint_dir", "gs://bucket/path"), ("package_name", "_private"),
        ("project_name", "A--b  c_9"), ("project_name", "x"), ("project_name", "r" * 63),
        ("mtbi_hours", 8), ("gpus_per_node", 1), ("gpus_per_node", 0),
        ("cpus_per_node", 1), ("image", "ghcr.io/me/my-run:v1.2"),
        ("image", "localhost:5000/team/run@sha256:" + "a" * 64)]


@pytest.mark.parametrize("question, value", GOOD, ids=[f"{q}={v!r}" for q, v in GOOD])
def test_edge_answers_are_accepted(tmp_path, question, value):
    render(tmp_path / "out", **WITH.get(question, {}), **{question: value})
    assert (tmp_path / "out" / "configs" / "train.yaml").is_file()
    pyproject = tomllib.loads((tmp_path / "out" / "pyproject.toml").read_text())
    Requirement(pyproject["project"]["name"])  # an installable distribution name


@pytest.mark.parametrize("value, shown", [("abc", "(got 'abc')"), (".nan", "(got '.nan')"),
                                          ("1e999", "which is not finite"),
                                          ("inf", "(got 'inf')")])
def test_what_the_user_sees_for_a_number_that_is_not_one(tmp_path, value, shown):
    """The copier command line, as a user runs it: the last line names the question."""
    copier = Path(sys.executable).with_name("copier")
    proc = subprocess.run([str(copier), "copy", "--defaults", "--vcs-ref", "HEAD", "--data",
                           f"mtbi_hours={value}", str(REPO), str(tmp_path / "out")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: Validation error for question 'mtbi_hours': "
                           "mtbi_hours must be a finite number > 0"), last
    assert shown in last, last
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_numeric_answers_reach_the_config_as_numbers(tmp_path):
    """The questions are text (so that copier's own conversion cannot fail first); the
    files get numbers, whichever way a number was written."""
    project = render(tmp_path / "p", mtbi_hours="1.0e+1", keep_last=" 4 ",
                     step_time_seconds=3, launchers=["kubernetes"])
    config = yaml.safe_load((project / "configs/train.yaml").read_text())
    assert config["plan"]["mtbi_hours"] == 10.0 and config["checkpoint"]["keep_last"] == 4
    assert config["plan"]["step_time_s"] == 3.0 and config["preemption"]["grace_period_s"] == 30.0
    answers = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert float(answers["mtbi_hours"]) == 10.0 and int(answers["gpus_per_node"]) == 8


def test_node_count_leaves_room_for_the_pod_index():
    """A Kubernetes Job's pods are <job>-<index>, a DNS label of at most 63 characters:
    a 61-character name leaves room for indexes 0-9 (10 nodes), not for index 10."""
    template = copier_env().from_string(QUESTIONS["nodes"]["validator"])

    def check(nodes, name, launchers=("kubernetes",)):
        return template.render(nodes=nodes, project_name=name, launchers=list(launchers)).strip()

    assert check("10", "r" * 61) == ""
    message = check("11", "r" * 61)
    assert message.startswith("nodes: the Kubernetes Job") and "at most 60 characters" in message
    assert check("2", "r" * 62).endswith("at most 61 characters")
    assert check("2", "r" * 63).endswith("at most 61 characters")
    assert check("1", "r" * 63) == ""                             # one node: a plain Job
    assert check("2", "r" * 63, launchers=("slurm",)) == ""       # no Kubernetes Job
    assert "between 1 and 1024" in check("0", "x")


def test_mtbi_is_per_node():
    assert "ONE node" in QUESTIONS["mtbi_hours"]["help"]
    assert "mtbi_hours / nodes" in QUESTIONS["nodes"]["help"]


def test_docs_language_help_says_what_is_translated():
    help_text = QUESTIONS["docs_language"]["help"]
    assert "only that file is translated" in help_text and "CHECKLIST.md" in help_text
    assert "README" in help_text


# ------------------------------------------------ validators without copier ----
# copier's Jinja environment, as tests/test_checklist.py builds it: the validators can
# be evaluated for thousands of answers in a second.

def copier_env() -> SandboxedEnvironment:
    return SandboxedEnvironment(loader=FileSystemLoader(str(REPO)),
                                extensions=["jinja2_ansible_filters.AnsibleCoreFiltersExtension"])


def validator(question: str):
    template = copier_env().from_string(QUESTIONS[question]["validator"])
    return lambda value: template.render({question: value}).strip()


def slug_of(project_name: str) -> str:
    """copier.yml's computed project_slug, evaluated the way copier does."""
    return copier_env().from_string(QUESTIONS["project_slug"]["default"]).render(
        project_name=project_name)


PEP508_NAME = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
IMAGE_NAME = re.compile(r"^[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*$")  # one path component


def test_every_accepted_project_name_is_valid_everywhere_it_lands():
    """Random names: each one the validator accepts is a PEP 508 distribution name, a
    DNS-1123 label (Kubernetes), an image name, and gives an importable package name."""
    check = validator("project_name")
    package_default = copier_env().from_string(QUESTIONS["package_name"]["default"])
    rng = random.Random(13)
    alphabet = "aZq9 _-.é/"
    accepted = refused = 0
    for _ in range(3000):
        name = "".join(rng.choice(alphabet) for _ in range(rng.choice([1, 2, 3, 8, 40, 64, 70])))
        message = check(name)
        if message:
            refused += 1
            assert message.startswith("project_name must"), message
            continue
        accepted += 1
        slug = slug_of(name)
        assert PEP508_NAME.match(slug) and Requirement(slug).name == slug, name
        assert DNS1123_LABEL.match(slug) and len(slug) <= 63, name
        assert IMAGE_NAME.match(slug), name
        package = package_default.render(project_name=name)
        assert package.isidentifier() and package.isascii(), name
    assert accepted > 100 and refused > 100


def test_project_name_message_names_the_rule():
    check = validator("project_name")
    assert "end with a letter or digit" in check("Trainer_")
    assert "distribution name" in check("Trainer_")
    assert "63 characters" in check("r" * 64)


# ----------------------------------------- names a package must not shadow ----

def reserved_names() -> tuple[set[str], set[str]]:
    names = copier_env().get_template("includes/names.jinja").make_module({})
    return set(names.stdlib_modules), set(names.project_modules)


def test_reserved_stdlib_names_hold_this_pythons():
    stdlib, _ = reserved_names()
    missing = set(sys.stdlib_module_names) - stdlib
    assert not missing, f"add to includes/names.jinja (stdlib_modules): {sorted(missing)}"


def test_every_standard_library_module_is_refused():
    check = validator("package_name")
    for name in sorted(sys.stdlib_module_names):
        candidate = name.lower()
        if not re.match(r"^[a-z_][a-z0-9_]*$", candidate):
            continue
        assert "would shadow" in check(candidate) or "keyword" in check(candidate), name


def imported_top_level_modules(root: Path) -> set[str]:
    names = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_every_module_the_generated_project_imports_or_installs_is_refused(default_project):
    """Derived from the generated code and its pyproject.toml, not from a list."""
    imports = imported_top_level_modules(default_project / "src")
    imports |= imported_top_level_modules(default_project / "tests")
    pyproject = tomllib.loads((default_project / "pyproject.toml").read_text())
    requirements = list(pyproject["project"]["dependencies"])
    for extra in pyproject["project"].get("optional-dependencies", {}).values():
        requirements += extra
    module_of = {"pyyaml": "yaml"}
    for requirement in requirements:
        name = canonicalize_name(Requirement(requirement).name)
        imports.add(module_of.get(name, name.replace("-", "_")))
    imports.discard("__future__")  # not a valid package name anyway
    # The generated tests' own modules (one test importing another's helpers) are local.
    imports -= {path.stem for path in (default_project / "tests").glob("*.py")} - {"conftest"}
    package = next(p.name for p in (default_project / "src").iterdir() if p.is_dir())
    imports.discard(package)
    stdlib, project = reserved_names()
    unlisted = sorted(name for name in imports if name not in stdlib | project)
    assert not unlisted, f"add to includes/names.jinja (project_modules): {unlisted}"
    check = validator("package_name")
    for name in sorted(imports):
        assert "would shadow" in check(name.lower()), name
