"""One torch compatibility leg: a rendered project's torch-API tests on another torch release.

    python tests/torch_leg.py 2.11.0              # make test-torch TORCH=2.11.0
    python tests/torch_leg.py --install 2.9.0 2.11.0 2.15.0   # steps 1-2 only (CI, ahead)

``make test`` runs everything on the pinned release (2.13.0); a leg checks one other
release the generated project claims (its pyproject.toml lists them):

1. a venv of its own, ``.scratch/torch-<release>/venv``, with that torch from the package
   registry (a CUDA build, which runs on the CPU; this machine class caps torch in
   /etc/xdg/pip, which the leg's pip ignores: PIP_CONSTRAINT=/dev/null), reused when it
   already holds that release;
2. a default render, installed with ``pip install -e '.[test]'``: the venv's torch must be
   kept (pip installs no torch when one in the range is there);
3. the render's tests marked ``torch_api`` (every test that touches an API that differs
   between releases, and the multi-rank runs on the paths that differ), and the same in
   a render with the memory tier.

``--install`` does steps 1 and 2 ahead (CI, while make test runs) and marks the renders
with the template's fingerprint; a leg then renders again only when the template changed.
It installs a venv ahead only while the disk keeps room for the suite beside it (a leg's
venv is about 7.5 GB, and pip needs about 12 GB while installing it); a leg left out then
installs when it runs, and ``--drop`` removes a leg's venv after its tests (CI: room for
the next one). Prints each phase's time; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRATCH = REPO / ".scratch"
# Installed beside torch in each leg's venv, with the generated project's own dependencies
# and test extra (read from the template, test_requirements): xdist, to run the leg's
# tests on both cores (three workers: with two, the 2.11.0 leg used 1.61 cores on average
# while its tests waited on their processes, and took 297 s; with three, 1.71 and 275 s).
# The project's install then has nothing left to fetch.
LEG_EXTRAS = ["pytest-xdist>=3.5"]
# The renders of a leg: the default project, and one with the memory tier (its tests only).
RENDERS = {"default": {}, "memory": {"memory_tier": True, "project_name": "mem-run"}}
# Disk, in GiB: what installing one leg's venv takes at its peak (torch 2.9.0: 11.5 GiB,
# the downloaded wheels beside the installed venv, 7.4 GiB once done), and what an
# install ahead leaves free for make test running beside it.
INSTALL_PEAK_GB = 12.0
KEEP_FREE_GB = 3.0


def leg_dir(release: str) -> Path:
    return SCRATCH / f"torch-{release}"


def project_dir(release: str, name: str) -> Path:
    """Where the leg's render ``name`` (a key of RENDERS) lives."""
    return leg_dir(release) / name


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, check=False, **kwargs)


def free_gb() -> float:
    SCRATCH.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(SCRATCH).free / 2**30


def torch_of(python: Path) -> str | None:
    if not python.exists():
        return None
    proc = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def test_requirements() -> list[str]:
    """A default render's dependencies and test extra, but torch, from the template's
    pyproject.toml.jinja (the parts a default render leaves out dropped)."""
    text = (REPO / "template" / "pyproject.toml.jinja").read_text(encoding="utf-8")
    text = re.sub(r"{%\s*if .*?%}.*?{%\s*endif\s*%}", "", text, flags=re.DOTALL)
    wanted = []
    for name in ("dependencies", "test"):
        block = re.search(rf"^{name} = \[(.*?)\]\s*$", text,
                          re.MULTILINE | re.DOTALL).group(1)
        wanted += re.findall(r'"([^"]+)"', block)
    return [req for req in wanted if not re.match(r"torch\b", req)]


def venv_python(release: str) -> Path:
    return leg_dir(release) / "venv" / "bin" / "python"


def installed(release: str) -> bool:
    have = torch_of(venv_python(release))
    return have is not None and have.split("+")[0] == release


def install(release: str) -> Path:
    """The leg's venv with ``torch==release`` (kept when it already has it)."""
    python = venv_python(release)
    venv = python.parents[1]
    if installed(release):
        print(f"torch {release} already in {venv}", flush=True)
        return python
    shutil.rmtree(venv, ignore_errors=True)
    if (free := free_gb()) < INSTALL_PEAK_GB:
        print(f"warning: {free:.1f} GiB free; installing torch {release} takes about "
              f"{INSTALL_PEAK_GB} GiB at its peak", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    if run([sys.executable, "-m", "venv", str(venv)]).returncode != 0:
        sys.exit(f"could not create {venv}")
    # The registry's build of that release, past this machine class's cap on torch.
    env = dict(os.environ, PIP_CONSTRAINT="/dev/null")
    proc = run([str(python), "-m", "pip", "install", "--quiet", "--no-cache-dir",
                f"torch=={release}", *test_requirements(), *LEG_EXTRAS], env=env)
    if proc.returncode != 0 or torch_of(python) is None:
        sys.exit(f"could not install torch {release} into {venv} "
                 f"({free_gb():.1f} GiB free after the attempt)")
    return python


def fingerprint() -> str:
    """What a render is made of: every file of the template and copier.yml, hashed."""
    digest = hashlib.sha256()
    files = [REPO / "copier.yml", *sorted((REPO / "template").rglob("*"))]
    for path in files:
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def render(name: str, release: str) -> Path:
    from copier import run_copy

    dst = project_dir(release, name)
    shutil.rmtree(dst, ignore_errors=True)
    run_copy(str(REPO), str(dst), data=RENDERS[name], defaults=True, quiet=True,
             unsafe=False, vcs_ref="HEAD")
    return dst


def install_project(python: Path, project: Path) -> None:
    """``pip install -e '.[test]'``; the venv's torch must stay what it was."""
    before = torch_of(python)
    proc = run([str(python), "-m", "pip", "install", "-e", f"{project}[test]"],
               capture_output=True, text=True, env=dict(os.environ, PIP_CONSTRAINT="/dev/null"))
    if proc.returncode != 0:
        sys.exit(f"pip install -e '.[test]' failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    installed = next((line for line in proc.stdout.splitlines()
                      if line.startswith("Successfully installed")), "")
    after = torch_of(python)
    print(f"torch before {before}, after {after}; {installed[:300]}", flush=True)
    if after != before or any(word.startswith("torch-") for word in installed.split()):
        sys.exit(f"pip install -e '.[test]' replaced the venv's torch {before} with {after}")


def pytest(python: Path, project: Path, *args: str) -> int:
    env = dict(os.environ, PYTHONPATH=str(project / "src"), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    return run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "torch_api",
                "--durations=15", *args], cwd=project, env=env).returncode


def prepare(release: str) -> Path:
    """Steps 1 and 2: the venv, both renders, the default one installed. Kept when the
    template is the one they were rendered from."""
    python = install(release)
    marker, made_from = leg_dir(release) / "prepared", fingerprint()
    if marker.is_file() and marker.read_text() == made_from:
        print(f"renders of this template already in {leg_dir(release)}", flush=True)
        return python
    marker.unlink(missing_ok=True)
    default = render("default", release)
    render("memory", release)
    install_project(python, default)
    marker.write_text(made_from)
    return python


def prepare_ahead(releases: list[str]) -> None:
    """prepare() each release in turn while the disk has room for it and the suite."""
    for release in releases:
        needs = 0.0 if installed(release) else INSTALL_PEAK_GB + KEEP_FREE_GB
        if (free := free_gb()) < needs:
            print(f"not installing torch {' '.join(releases[releases.index(release):])} "
                  f"ahead: {free:.1f} GiB free, and an install ahead needs {needs:.1f}; "
                  "each installs when its leg runs", flush=True)
            return
        prepare(release)


def leg(release: str, drop: bool = False) -> int:
    began = time.monotonic()
    python = prepare(release)
    ready = time.monotonic()
    failed = pytest(python, project_dir(release, "default"), "-n", "3", "tests")
    failed |= pytest(python, project_dir(release, "memory"), "tests/test_memory_tier.py")
    done = time.monotonic()
    if drop:
        shutil.rmtree(python.parents[1], ignore_errors=True)
    print(f"torch {release} leg: {'FAILED' if failed else 'passed'}; venv, renders and "
          f"install {ready - began:.0f} s, tests {done - ready:.0f} s"
          f"{'; venv removed' if drop else ''}", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true",
                        help="only create the venvs of these releases and their renders, "
                             "while the disk has room for them")
    parser.add_argument("--drop", action="store_true",
                        help="remove each leg's venv after its tests")
    parser.add_argument("releases", nargs="+", metavar="RELEASE")
    args = parser.parse_args(argv)
    if args.install:
        prepare_ahead(args.releases)
        return 0
    return max(leg(release, args.drop) for release in args.releases)


if __name__ == "__main__":
    sys.exit(main())
