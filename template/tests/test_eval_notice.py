"""Evaluation that the config asks for but the task cannot give is said once, with the
lines to add, instead of silently not running (tasks written before evaluation existed
define no build_eval_data)."""

import types

from conftest import project_module

config = project_module("config")
task_contract = project_module("loop.task_contract")
Evaluator = project_module("loop.evaluate").Evaluator
suite_task = project_module("task")     # the suite's own task (conftest.py)


def task_without_eval_data():
    """A task module with the required functions only (as the oldest task files)."""
    module = types.ModuleType("old_task")
    for name in task_contract.REQUIRED:
        setattr(module, name, getattr(suite_task, name))
    return task_contract.load_task(module)


def test_a_task_without_eval_data_is_told_what_to_add():
    cfg = config.load_config(None, [])
    assert cfg.eval.at_end
    notice = Evaluator(cfg, task_without_eval_data(), runtime=None).missing()
    assert notice is not None and "defines no build_eval_data" in notice
    assert "def build_eval_data(cfg)" in notice and "eval.at_end=false" in notice


def test_no_notice_when_evaluation_is_off_or_runs():
    off = config.load_config(None, ["eval.at_end=false"])
    assert Evaluator(off, task_without_eval_data(), runtime=None).missing() is None
    every = config.load_config(None, ["eval.at_end=false", "eval.every_steps=5"])
    assert "eval.every_steps=5" in Evaluator(every, task_without_eval_data(),
                                             runtime=None).missing()
    cfg = config.load_config(None, [])
    assert Evaluator(cfg, task_contract.load_task(suite_task), runtime=None).missing() is None


def test_an_empty_eval_set_is_said_too():
    cfg = config.load_config(None, [])
    module = types.ModuleType("empty_eval_task")
    for name in task_contract.REQUIRED:
        setattr(module, name, getattr(suite_task, name))
    module.build_eval_data = lambda cfg: []
    notice = Evaluator(cfg, task_contract.load_task(module), runtime=None).missing()
    assert notice is not None and "returned no samples" in notice
