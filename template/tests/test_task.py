"""Your task (src/<package>/task.py), checked through its contract (docs/EXTENDING.md).

Every other test runs the suite's own task (conftest.py). These are the only ones that
call yours, and only as the harness does: through ``loop.task_contract.load_task``, with
the project's configs/train.yaml. The model is built on the meta device (no memory for
the weights, no time to initialise them) and the loss computed there: shapes and types,
not numbers. An optional function your task does not define is skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch
from torch import nn

from conftest import PACKAGE, PROJECT, project_module

# Every test here touches an API that differs between torch releases (make test-torch).
pytestmark = pytest.mark.torch_api

META = torch.device("meta")
EXTENDING = "docs/EXTENDING.md"


def _load_users_task():
    """The project's task.py as a module of the package (its relative imports resolve
    in the package, as when the harness imports it), through the contract's load_task."""
    project_module("config")                     # the package, imported first
    name = f"{PACKAGE}._users_task"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, PROJECT / "src" / PACKAGE / "task.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return project_module("loop.task_contract").load_task(sys.modules[name])


@pytest.fixture(scope="module")
def task():
    return _load_users_task()


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    """The project's configuration, with throwaway run directories (a task may look at
    checkpoint.dir, as the oldest default task does for its first start)."""
    runs = tmp_path_factory.mktemp("your-task")
    return project_module("config").load_config(
        PROJECT / "configs" / "train.yaml",
        [f"checkpoint.dir={runs / 'ckpt'}", f"log.dir={runs / 'logs'}"])


@pytest.fixture(scope="module")
def model(task, cfg):
    """build_model(cfg, ctx) on the meta device, as a resume calls it (no pretrained
    weights: ``first_start`` is False)."""
    ctx = project_module("config").TaskContext(first_start=False)
    with META:
        built = task.build_model(cfg, ctx)
    assert isinstance(built, nn.Module), f"build_model returned {type(built).__name__}"
    assert any(True for _ in built.parameters()), "build_model's module has no parameters"
    return built


@pytest.fixture(scope="module")
def batch(task, cfg):
    """Two samples of build_data, collated by the task's collate (or the default), on meta."""
    data = task.build_data(cfg)
    assert len(data) > 0, "build_data returned no samples"
    samples = [data[0], data[len(data) - 1]]   # map-style: len(ds) and ds[i]
    return project_module("loop.parallelize").to_device(task.collate(samples), META)


def check_loss_and_metrics(result, where: str) -> dict:
    loss, metrics = result
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0, \
        f"{where} must return a scalar tensor as the loss (got {loss!r:.80})"
    assert isinstance(metrics, dict), f"{where}'s metrics must be a dict"
    reserved = set(project_module("loop.trainer").STEP_FIELDS) & set(metrics)
    assert not reserved, f"{where}: metric names taken by the harness: {sorted(reserved)}"
    for name, value in metrics.items():
        assert isinstance(name, str), f"{where}: metric name {name!r} is not a string"
        assert isinstance(value, (int, float)) or (
            isinstance(value, torch.Tensor) and value.dim() == 0), \
            f"{where}: metric {name} must be a float or a 0-d tensor"
    return metrics


def test_your_task_defines_what_the_harness_calls(task):
    for name in ("build_model", "build_data", "loss_and_metrics", "collate",
                 "build_optimizer", "shard_units"):
        assert callable(getattr(task, name)), name


def test_your_model_trains_one_micro_batch_on_the_meta_device(task, model, batch):
    model.train()
    check_loss_and_metrics(task.loss_and_metrics(model, batch), "loss_and_metrics")


def test_your_shard_units_are_submodules_of_your_model(task, model):
    units = task.shard_units(model)
    inside = {id(module) for module in model.modules()}
    assert isinstance(units, list), "shard_units must return a list"
    assert all(id(unit) in inside and unit is not model for unit in units), \
        "shard_units must return submodules of the model, not the model itself"


def test_your_optimizer_takes_your_models_parameters(task, model, cfg):
    optimizer, scheduler = task.build_optimizer(model, cfg)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert scheduler is None or hasattr(scheduler, "step")
    given = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert given and given <= {id(p) for p in model.parameters()}


def test_your_eval_data_is_a_map_style_dataset(task, cfg):
    if task.build_eval_data is None:
        pytest.skip(f"your task defines no build_eval_data: nothing is evaluated ({EXTENDING})")
    data = task.build_eval_data(cfg)
    if len(data) == 0:
        pytest.skip("build_eval_data returned no samples with this configuration")
    task.collate([data[0], data[len(data) - 1]])


def test_your_eval_metrics_evaluate_a_micro_batch(task, model, batch):
    if task.eval_metrics is None:
        pytest.skip("your task defines no eval_metrics: loss_and_metrics evaluates")
    model.eval()
    try:
        with torch.no_grad():
            check_loss_and_metrics(task.eval_metrics(model, batch), "eval_metrics")
    finally:
        model.train()


def test_your_eval_summary_derives_figures_from_the_means(task, model, batch):
    if task.eval_summary is None:
        pytest.skip("your task defines no eval_summary: the means are reported as they are")
    model.train()
    metrics = check_loss_and_metrics(task.loss_and_metrics(model, batch), "loss_and_metrics")
    means = dict.fromkeys(metrics, 1.0)
    means["loss"] = 1.0
    figures = task.eval_summary(means)
    assert isinstance(figures, dict), "eval_summary must return a dict"
    assert all(isinstance(name, str) and math.isfinite(float(value))
               for name, value in figures.items())
