# Set-up commands for contributors; each installs what it needs into .venv.
#   make demo        render the template with defaults and run the interruption drill on CPU
#                    (installs only what the drill needs)
#   make check       the inner loop: lint, then the fast tests (under 5 minutes on 2 cores)
#   make test        the whole test suite: template tests + every generated project's tests
#   make gpu-check   the GPU tier of a default render (exit 0 with the reason without CUDA)
#   make test-torch TORCH=2.11.0
#                    one torch compatibility leg: a default render's torch-API tests on
#                    that release, in a venv of its own (.scratch/torch-<release>)

# Python caches compiled modules (__pycache__) in every recipe. This machine class sets
# PYTHONDONTWRITEBYTECODE, so each process of a rendered project compiled the whole package
# from source again: about 1 s of CPU a process (3.6 s against 2.5 s to import the trainer
# and the launcher), in suites that start thousands of them. A user's machine caches.
unexport PYTHONDONTWRITEBYTECODE

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO   ?= .scratch/demo

.PHONY: demo check test test-torch print-torch-legs gpu-check gpu-prepare lint venv venv-demo clean

venv: $(VENV)/.installed
venv-demo: $(VENV)/.demo-installed

# torch first and on its own, with pip: the pinned release is the CPU build this machine
# class serves from a local file. pip is left as the system ships it (a newer pip was seen
# to pick the multi-GB CUDA build of the same version instead). The rest with uv, which
# keeps that torch (it satisfies the pin) and installs the dev extra in about 30 s where
# pip took about 3 minutes (a fresh machine, no cache). --compile-bytecode, as pip does:
# where PYTHONDONTWRITEBYTECODE is set (this machine class sets it), a package installed
# without its .pyc files is compiled again by every process that imports it.
UV := $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY)
$(VENV)/.demo-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0 uv
	$(UV) -e '.[demo]'
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.demo-installed
	$(UV) -e '.[dev]'
	$(PY) -c "import torch; print('torch', torch.__version__)"
	touch $@

# Two workers: each starts with one half of the full render's own suite (every optional
# part, tests/test_render.py), then takes the other tests; an idle worker takes over
# tests still queued for the busy one (worksteal). Three workers were tried: both cores
# were busy throughout, make test was no shorter, and a benchmark's timing failed.
test: venv
	$(PY) -m pytest -n 2 --dist worksteal tests

# The torch releases the generated project is tested on besides the pinned one: the
# floor, the GPU images' (with DCP's stager bug) and the newest. .ci/run runs each leg
# after make test; README.md and the generated pyproject.toml list the same releases.
TORCH_LEGS ?= 2.9.0 2.11.0 2.15.0
TORCH ?= 2.11.0
LEG_FLAGS ?=
test-torch: venv
	$(PY) tests/torch_leg.py $(LEG_FLAGS) $(TORCH)

print-torch-legs:
	@echo $(TORCH_LEGS)

# Lint, then every test not marked slow: the template's own checks and the quick part
# of a default render's own suite (test_render.py::test_default_project_fast_tier_passes).
check: venv lint
	$(PY) -m pytest -q -n 2 -m "not slow" tests

lint: venv
	$(VENV)/bin/ruff check tests template --exclude '*.jinja'

# The demo renders the template with defaults and runs the interruption drill on CPU:
# an uninterrupted 2-rank run, the same run killed with SIGKILL after the checkpoint of
# step 12, a resume on 1 rank, and a step-by-step comparison; then prints the report.
demo: venv-demo
	rm -rf $(DEMO)
	$(VENV)/bin/copier copy --defaults --quiet --vcs-ref HEAD . $(DEMO)   # the working tree, not the newest tag
	cd $(DEMO) && PYTHONPATH=src $(abspath $(PY)) -m my_run.drill --save-ranks 2 \
		--resume-ranks 1 --out drill; status=$$?; \
		[ -f drill/report.md ] && cat drill/report.md; exit $$status

# The GPU tier (docs/PERFORMANCE.md of a render lists its steps): a default render's tests
# marked gpu, on GPU_PYTHON, the interpreter whose torch has CUDA (on a GPU image usually
# python3: its torch, 2.9 or newer, is kept). On such a machine, which may have no network
# and no copier, make gpu-check needs only what make gpu-prepare made here: the render
# (.scratch/gpu) and the wheels of omegaconf and antlr4 (.scratch/wheels), carried along;
# everything else it uses (pytest, numpy, transformers for the export step) is the
# image's. By default GPU_PYTHON is the venv's, which skips every step without CUDA.
GPU_PROJECT ?= .scratch/gpu
GPU_WHEELS  ?= .scratch/wheels
GPU_PYTHON  ?= $(abspath $(PY))
gpu-check:
	@[ -d $(GPU_PROJECT)/src ] || $(MAKE) --no-print-directory gpu-prepare
	bash tests/gpu_check.sh $(GPU_PYTHON) $(GPU_PROJECT) $(GPU_WHEELS)

gpu-prepare: venv-demo
	rm -rf $(GPU_PROJECT) $(GPU_WHEELS)
	$(VENV)/bin/copier copy --defaults --quiet --vcs-ref HEAD . $(GPU_PROJECT)
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir $(GPU_WHEELS) \
		"omegaconf==$$($(PY) -c 'import omegaconf; print(omegaconf.__version__)')" \
		antlr4-python3-runtime==4.9.3

clean:
	rm -rf $(VENV) .scratch
