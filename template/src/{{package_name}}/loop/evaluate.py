"""Evaluation on held-out data: every sample once, whatever the number of ranks.

Samples are dealt to the ranks in turn and summed in float64, so one all-reduce gives
sample-weighted means that agree on any number of ranks. A stop request ends an evaluation
at the next batch (one small all-reduce per batch); it is then not reported, and the
resumed run evaluates that step first. The rules and settings: docs/EXTENDING.md, "Evaluation".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import Config
from ..runtime.distributed import Runtime, any_rank
from .parallelize import to_device
from .task_contract import Task


class Evaluator:
    def __init__(self, cfg: Config, task: Task, runtime: Runtime) -> None:
        self.cfg, self.task, self.runtime = cfg, task, runtime
        self.dataset = task.build_eval_data(cfg) if task.build_eval_data is not None else None
        self.micro_batch_size = cfg.eval.micro_batch_size or cfg.train.micro_batch_size
        self.score = task.eval_metrics or task.loss_and_metrics

    @property
    def enabled(self) -> bool:
        return self.dataset is not None and len(self.dataset) > 0

    def missing(self) -> str | None:
        """Why an evaluation the config asks for will not run, and what to add (else None)."""
        asked = [key for key, on in (("eval.at_end=true", self.cfg.eval.at_end),
                                     (f"eval.every_steps={self.cfg.eval.every_steps}",
                                      self.cfg.eval.every_steps > 0)) if on]
        if not asked or self.enabled:
            return None
        off = ("eval.at_end=false" + (" and eval.every_steps=0"
                                      if self.cfg.eval.every_steps > 0 else ""))
        if self.task.build_eval_data is None:
            return (f"notice: the config asks for evaluation ({', '.join(asked)}) but task.py "
                    "defines no build_eval_data, so nothing is evaluated. To evaluate, add "
                    "to task.py:  def build_eval_data(cfg): return <held-out samples, a "
                    "Dataset like build_data's>  (docs/EXTENDING.md shows the default task's, "
                    "which holds out the last data.eval_fraction of the samples); to say "
                    f"no evaluation, set {off}")
        return (f"notice: the config asks for evaluation ({', '.join(asked)}) but "
                "build_eval_data returned no samples (is data.eval_fraction 0?), so nothing "
                f"is evaluated; to say no evaluation, set {off}")

    def due(self, step: int) -> bool:
        """Every ``eval.every_steps`` steps and, with ``eval.at_end``, after the last one."""
        every = self.cfg.eval.every_steps
        return self.enabled and ((every > 0 and step % every == 0)
                                 or (self.cfg.eval.at_end and step == self.cfg.train.max_steps))

    def samples(self) -> int:
        """How many samples an evaluation covers (over every rank)."""
        n = len(self.dataset)
        limit = self.cfg.eval.max_batches * self.micro_batch_size
        return min(n, limit) if limit > 0 else n

    def my_samples(self) -> range:
        """This rank's share: sample i goes to rank i mod world size."""
        return range(self.runtime.rank, self.samples(), self.runtime.world_size)

    def run(self, model: nn.Module, stop_requested: Callable[[], bool]
            ) -> dict[str, float] | None:
        """The means (``loss``, each metric), equal on every rank; None if a stop ended it."""
        mine = self.my_samples()
        # The most any rank holds (rank 0's share): every rank runs this many rounds.
        rounds = -(-len(range(0, self.samples(), self.runtime.world_size))
                   // self.micro_batch_size)
        sums: dict[str, torch.Tensor] = {}
        count = 0
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for r in range(rounds):
                    if any_rank(stop_requested())[0]:
                        return None
                    indices = mine[r * self.micro_batch_size:(r + 1) * self.micro_batch_size]
                    n = len(indices)
                    # A rank left without samples in the last round still runs the model
                    # (FSDP2 gathers the weights in every rank's forward), weighted 0.
                    samples = [self.dataset[i] for i in (indices if n else [0])]
                    batch = to_device(self.task.collate(samples), self.runtime.device)
                    loss, metrics = self.score(model, batch)
                    for name, value in {"loss": loss, **dict(metrics)}.items():
                        value = torch.as_tensor(value).detach().to(torch.float64).cpu() * n
                        sums[name] = sums.get(name, 0) + value
                    count += n
        finally:
            model.train(was_training)
            # FSDP2 keeps the root's weights gathered after a forward without backward: reshard.
            if callable(getattr(model, "reshard", None)):
                model.reshard()
        means = self._means(sums, count)
        if self.task.eval_summary is not None:
            means.update(self.task.eval_summary(dict(means)))
        return means

    def _means(self, sums: dict[str, torch.Tensor], count: int) -> dict[str, float]:
        names = sorted(set(sums) | {"loss"})
        if self.runtime.world_size > 1:   # every rank learns every name (some saw none)
            everyone: list = [None] * self.runtime.world_size
            dist.all_gather_object(everyone, names)
            names = sorted({name for ranks in everyone for name in ranks})
        totals = torch.tensor([float(sums.get(name, 0.0)) for name in names] + [float(count)],
                              dtype=torch.float64)
        if self.runtime.world_size > 1:
            dist.all_reduce(totals)
        total = float(totals[-1])
        return {name: float(totals[i]) / total for i, name in enumerate(names)}


def eval_fields(means: dict[str, Any]) -> dict[str, float]:
    """The ``eval`` event's fields: ``eval_loss`` and ``eval_<metric>``."""
    return {f"eval_{name}": value for name, value in means.items()}
