"""The user's room: replace task.py (and the task's config sections) and nothing else.

A regression task unlike the default one in every way the contract allows: a model with
no ``blocks`` (one FSDP unit), samples that are (features, target) tuples, a mean
squared error loss, one extra metric and its own optimizer without a scheduler. The
harness must train it on 2 ranks, survive a SIGKILL after a checkpoint, resume it on 1
rank through ``resume`` and match an uninterrupted run: the interruption drill does
exactly that, with its own tolerance.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import events, package_of, render, run_in

REGRESSION_TASK = '''\
"""A regression task: a plain MLP on noisy linear data, mean squared error, and MAE."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from .config import Config, task_section


@dataclass
class MLPConfig:
    width: int = 32
    depth: int = 2


@dataclass
class PointsConfig:
    samples: int = 512
    features: int = 8
    noise: float = 0.1


class Points(Dataset):
    def __init__(self, cfg: PointsConfig) -> None:
        gen = torch.Generator().manual_seed(7)
        self.x = torch.randn(cfg.samples, cfg.features, generator=gen)
        weights = torch.randn(cfg.features, 1, generator=gen)
        noise = cfg.noise * torch.randn(cfg.samples, generator=gen)
        self.y = (self.x @ weights).squeeze(1) + noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def build_model(cfg: Config) -> nn.Module:
    model = task_section(cfg.model, MLPConfig, "model")
    data = task_section(cfg.data, PointsConfig, "data")
    layers: list[nn.Module] = []
    width = data.features
    for _ in range(model.depth):
        layers += [nn.Linear(width, model.width), nn.Tanh()]
        width = model.width
    return nn.Sequential(*layers, nn.Linear(width, 1))


def build_data(cfg: Config) -> Points:
    return Points(task_section(cfg.data, PointsConfig, "data"))


def build_optimizer(model: nn.Module, cfg: Config):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None


def loss_and_metrics(model: nn.Module, batch):
    features, target = batch
    prediction = model(features).squeeze(-1)
    loss = torch.nn.functional.mse_loss(prediction, target)
    return loss, {"mae": (prediction - target).abs().mean()}
'''

TASK_SECTIONS = """\
model:
  width: 32
  depth: 2

data:
  samples: 512
  features: 8
  noise: 0.1

"""


def replace_task_sections(config: str) -> str:
    """configs/train.yaml with its model: and data: sections replaced, the rest as it was."""
    pattern = re.compile(r"^model:.*?(?=^distributed:)", re.DOTALL | re.MULTILINE)
    assert pattern.search(config), "configs/train.yaml has model: and data: before distributed:"
    return pattern.sub(TASK_SECTIONS, config, count=1)


@pytest.fixture(scope="module")
def regression_project(tmp_path_factory) -> Path:
    project = render(tmp_path_factory.mktemp("user-task") / "reg")
    package = package_of(project)
    (project / "src" / package / "task.py").write_text(REGRESSION_TASK)
    config = project / "configs/train.yaml"
    config.write_text(replace_task_sections(config.read_text()))
    return project


@pytest.mark.slow
def test_a_replaced_task_trains_survives_sigkill_and_resumes_on_another_world_size(
        regression_project):
    project = regression_project
    package = package_of(project)
    proc = run_in(project, "-m", f"{package}.drill", "--save-ranks", "2", "--resume-ranks", "1",
                  "--out", "drill", "log.every_steps=4", check=False)
    report = json.loads((project / "drill/report.json").read_text())
    assert proc.returncode == 0 and report["passed"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["save_world_size"] == 2 and report["resume_world_size"] == 1
    assert report["resumed_from_step"] == 12 and report["compared_steps"]

    # The extra metric is averaged over the global batch and logged at every step, before
    # and after the resume; it is on the progress line too.
    logs = project / "drill/interrupted/logs"
    steps = events(logs, "step")
    assert steps and all(isinstance(e["mae"], float) and e["mae"] > 0 for e in steps)
    starts = events(logs, "start")
    assert [s["world_size"] for s in starts] == [2, 1] and starts[1]["step"] == 12
    assert " | mae " in (project / "drill/interrupted/resume-output.log").read_text()
    # No learning-rate schedule: the task's own SGD keeps its learning rate.
    assert {e["lr"] for e in steps} == {0.05}


def test_a_replaced_task_is_checked_by_its_own_config_schema(regression_project, tmp_path):
    package = package_of(regression_project)
    proc = run_in(regression_project, "-m", f"{package}.train", "model.d_model=64",
                  f"log.dir={tmp_path}", f"checkpoint.dir={tmp_path / 'ck'}", check=False)
    assert proc.returncode == 2 and "model.d_model" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
