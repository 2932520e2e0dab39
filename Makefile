# Two set-up commands for contributors; each installs what it needs into .venv.
#   make demo   render the template with defaults and run the interruption drill on CPU
#   make test   run the whole test suite (template tests + every generated project's tests)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO   ?= .scratch/demo

.PHONY: demo test lint venv clean

venv: $(VENV)/.installed

# torch first and on its own: the pinned release is the CPU build this machine class
# serves from a local file. pip is left as the system ships it (a newer pip was seen to
# pick the multi-GB CUDA build of the same version instead).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -c "import torch; print('torch', torch.__version__)"
	touch $@

test: venv
	$(PY) -m pytest tests

lint: venv
	$(VENV)/bin/ruff check tests template --exclude '*.jinja'

# The demo renders the template with defaults and runs the interruption drill on CPU:
# an uninterrupted 2-rank run, the same run killed with SIGKILL after the checkpoint of
# step 12, a resume on 1 rank, and a step-by-step comparison; then prints the report.
demo: venv
	rm -rf $(DEMO)
	$(VENV)/bin/copier copy --defaults --quiet --vcs-ref HEAD . $(DEMO)   # the working tree, not the newest tag
	cd $(DEMO) && PYTHONPATH=src $(abspath $(PY)) -m my_run.drill --save-ranks 2 \
		--resume-ranks 1 --out drill; status=$$?; \
		[ -f drill/report.md ] && cat drill/report.md; exit $$status

clean:
	rm -rf $(VENV) .scratch
