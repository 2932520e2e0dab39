# Two set-up commands for contributors; each installs what it needs into .venv.
#   make demo   render the template with defaults and run the interruption drill on CPU
#   make test   run the whole test suite (template tests + every generated project's tests)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO   ?= .scratch/demo

.PHONY: demo test lint venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

test: venv
	$(PY) -m pytest tests

lint: venv
	$(VENV)/bin/ruff check tests template --exclude '*.jinja'

# The demo trains 12 steps on 2 CPU ranks (checkpoints at 4, 8 and 12), then runs the
# same command with a larger step budget: it resumes from step 12 instead of step 0.
demo: venv
	rm -rf $(DEMO)
	$(VENV)/bin/copier copy --defaults --quiet . $(DEMO)
	cd $(DEMO) && PYTHONPATH=src $(abspath $(PY)) -m torch.distributed.run --standalone \
		--nproc-per-node 2 -m my_run.train train.max_steps=12 checkpoint.interval_steps=4 log.every_steps=4
	cd $(DEMO) && PYTHONPATH=src $(abspath $(PY)) -m torch.distributed.run --standalone \
		--nproc-per-node 2 -m my_run.train train.max_steps=20 checkpoint.interval_steps=4 log.every_steps=4

clean:
	rm -rf $(VENV) .scratch
