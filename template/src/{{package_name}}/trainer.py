"""The training loop: accumulate, step, save when due, stop when asked.

Data flows one way: the trainer owns the model, optimizer, data position and RNG,
hands them to the checkpoint manager as ``Stateful`` objects at save points, and reads
the preemption watch at step boundaries. Nothing below it calls back up.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful

from .checkpoint import CheckpointManager, Committed, SaveResult
from .checkpoint.state import ModelAndOptimizer, RankRNG, Scheduler
from .config import Config, Parallelism, to_plain_dict
from .data import GlobalBatchSampler, TokenDataset, load_tokens, plan_batches
from .distributed import Runtime, wrap_model
from .metrics import MetricsLog
from .model import build_model
from .preemption import PreemptionWatch

log = logging.getLogger(__name__)


@dataclass
class Progress(Stateful):
    """Where training stands, in world-size-independent terms."""

    step: int = 0
    samples_consumed: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_consumed": self.samples_consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.samples_consumed = int(state_dict["samples_consumed"])


@dataclass(frozen=True)
class Outcome:
    status: str                     # "finished" or "preempted"
    step: int
    last_save: SaveResult | None


def rank_seed(seed: int, step: int, rank: int) -> int:
    """A distinct, reproducible seed for each (run seed, step, rank)."""
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**63)


def lr_factor(step: int, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to ``min_ratio``; a function of the global step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, cfg: Config, runtime: Runtime, manager: CheckpointManager,
                 watch: PreemptionWatch, metrics: MetricsLog) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.manager = manager
        self.watch = watch
        self.metrics = metrics
        train = cfg.train
        # Refuse a world size that cannot keep the global batch before anything is built.
        self.batches = plan_batches(train.global_batch_size, train.micro_batch_size,
                                    runtime.world_size)
        torch.manual_seed(train.seed)  # identical initial weights on every rank
        self.model = wrap_model(build_model(cfg.model, train.seq_len), cfg.distributed, runtime)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.lr,
                                           weight_decay=train.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, train.warmup_steps, train.max_steps, train.min_lr_ratio))
        self.dataset = TokenDataset(load_tokens(cfg.data.corpus, cfg.data.corpus_chars),
                                    train.seq_len)
        self.sampler = GlobalBatchSampler(self.dataset.num_samples, train.global_batch_size,
                                          train.seed)
        self.progress = Progress()
        self.resumed_from: Committed | None = None
        torch.manual_seed(rank_seed(train.seed, 0, runtime.rank))

    # ------------------------------------------------------------ checkpoint --
    def state(self, *, with_rng: bool = True) -> dict[str, Stateful]:
        state: dict[str, Stateful] = {
            "app": ModelAndOptimizer(self.model, self.optimizer),
            "scheduler": Scheduler(self.scheduler),
            "progress": self.progress,
        }
        if with_rng:
            state["rng"] = RankRNG(self.runtime.rank, self.runtime.device)
        return state

    def resume(self) -> Committed | None:
        """Load the newest complete checkpoint, if there is one."""
        found = [self.manager.newest() if self.runtime.is_main else None]
        if self.runtime.world_size > 1:
            dist.broadcast_object_list(found, src=0)  # every rank loads the same one
        checkpoint = found[0]
        if checkpoint is None:
            return None
        same_world = checkpoint.world_size == self.runtime.world_size
        # RNG streams belong to ranks: they only carry over when the ranks do.
        self.manager.load(self.state(with_rng=same_world), checkpoint)
        if not same_world:
            torch.manual_seed(rank_seed(self.cfg.train.seed, self.progress.step,
                                        self.runtime.rank))
            self.metrics.say(
                f"notice: checkpoint saved on {checkpoint.world_size} ranks, resuming on "
                f"{self.runtime.world_size}: random streams reseeded from (seed, step, rank)")
        self.resumed_from = checkpoint
        return checkpoint

    def _commit_record(self) -> dict[str, Any]:
        return {
            "world_size": self.runtime.world_size,
            "global_batch_size": self.batches.global_batch_size,
            "micro_batch_size": self.batches.micro_batch_size,
            "grad_accum_steps": self.batches.grad_accum_steps,
            "samples_consumed": self.progress.samples_consumed,
            "config": to_plain_dict(self.cfg),
        }

    def _save(self, reason: str, *, blocking: bool = False) -> SaveResult | None:
        return self.manager.save(self.progress.step, self.state(), reason,
                                 self._commit_record(), blocking=blocking)

    # ------------------------------------------------------------------ step --
    def train_step(self) -> tuple[float, float]:
        """One optimizer step over the global batch; returns (mean loss, grad norm)."""
        self.model.train()
        micro_batches = self.sampler.rank_micro_batches(self.progress.samples_consumed,
                                                        self.runtime.rank, self.batches)
        accum = self.batches.grad_accum_steps
        total = torch.zeros((), device=self.runtime.device)
        for i, indices in enumerate(micro_batches):
            self._sync_gradients(last=i == accum - 1)
            inputs, targets = (t.to(self.runtime.device) for t in self.dataset.batch(indices))
            logits = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / accum
            loss.backward()
            total += loss.detach()
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        # The staged copy of an in-flight save must be complete before weights change.
        self.manager.wait_staged()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.runtime.world_size > 1:
            dist.all_reduce(total)
            total /= self.runtime.world_size
        self.progress.step += 1
        self.progress.samples_consumed += self.batches.global_batch_size
        return float(total), float(grad_norm)

    def _sync_gradients(self, *, last: bool) -> None:
        # Only the last micro-batch reduces gradients across ranks.
        if self.cfg.distributed.parallelism == Parallelism.fsdp:
            self.model.set_requires_gradient_sync(last)
        else:
            self.model.require_backward_grad_sync = last

    # ------------------------------------------------------------------ loop --
    def run(self) -> Outcome:
        cfg = self.cfg
        tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        interval = cfg.checkpoint.interval_steps
        while self.progress.step < cfg.train.max_steps:
            stop_at = self._agreed_stop_time()
            if stop_at is not None:
                return self._stop_for_preemption(stop_at)
            began = time.perf_counter()
            loss, grad_norm = self.train_step()
            step_time = time.perf_counter() - began
            step = self.progress.step
            self.metrics.event("step", step=step, loss=loss, grad_norm=grad_norm,
                               step_time_s=step_time, tokens_per_s=tokens_per_step / step_time,
                               lr=self.scheduler.get_last_lr()[0])
            self._report(self.manager.poll())
            if step == cfg.train.max_steps:
                self._report(self._save("final"))
            elif step % interval == 0:
                self._report(self._save("interval"))
            if step % cfg.log.every_steps == 0 or step == cfg.train.max_steps:
                self._progress_line(loss, tokens_per_step / step_time)
        self._report(self.manager.wait())
        return Outcome("finished", self.progress.step, self.manager.last_committed)

    def _agreed_stop_time(self) -> float | None:
        """Wall-clock time of the earliest stop request on any rank, or None."""
        request = self.watch.requested
        earliest = request.wall_time if request is not None else math.inf
        if self.runtime.world_size > 1:
            tensor = torch.tensor([earliest], dtype=torch.float64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
            earliest = float(tensor.item())
        return None if math.isinf(earliest) else earliest

    def _stop_for_preemption(self, requested_at: float) -> Outcome:
        """Drain the in-flight save, then commit a final one if the grace period allows."""
        grace = self.cfg.preemption.grace_period_s
        request = self.watch.requested
        source = request.source if request is not None else "peer rank"
        step = self.progress.step
        self.metrics.say(f"stop requested ({source}) at step {step}: finishing the save in "
                         f"flight, grace period {grace:g} s")
        self._report(self.manager.wait())
        last = self.manager.last_committed
        remaining = grace - (time.time() - requested_at)
        # The estimate for a blocking save: the slowest commit seen so far in this run.
        estimate = last.commit_latency_s if last is not None else 0.0
        wanted = (last is None or last.step != step) and remaining > estimate
        decision = torch.tensor([1 if (self.runtime.is_main and wanted) else 0])
        if self.runtime.world_size > 1:
            dist.all_reduce(decision, op=dist.ReduceOp.MAX)
        final = None
        if bool(decision.item()):
            final = self._save("preemption", blocking=True)
            self._report(final)
        elif self.runtime.is_main and (last is None or last.step != step):
            self.metrics.say(f"no final checkpoint: {remaining:.1f} s of grace left, a save "
                             f"takes about {estimate:.1f} s; the newest committed one stays")
        elapsed = time.time() - requested_at
        self.metrics.event("preemption", source=source, stop_step=step,
                           final_checkpoint_step=final.step if final else None,
                           signal_to_commit_s=elapsed if final else None,
                           grace_left_s=grace - elapsed, signals_received=self.watch.count)
        self.metrics.say(f"stopped at step {step}; {grace - elapsed:.1f} s of grace left")
        return Outcome("preempted", step, self.manager.last_committed)

    # ------------------------------------------------------------- reporting --
    def _report(self, result: SaveResult | None) -> None:
        if result is None:
            return
        self.metrics.event("save", step=result.step, reason=result.reason, mode=result.mode,
                           blocking_s=result.blocking_s, commit_latency_s=result.commit_latency_s,
                           path=result.path, removed=result.removed)
        self.metrics.say(f"checkpoint step {result.step} committed ({result.reason}, "
                         f"{result.mode}): blocking {result.blocking_s:.3f} s, committed "
                         f"{result.commit_latency_s:.2f} s after the save began")

    def _progress_line(self, loss: float, tokens_per_s: float) -> None:
        last = self.manager.last_committed
        saved = (f"last save step {last.step} (blocking {last.blocking_s:.3f} s, "
                 f"committed after {last.commit_latency_s:.2f} s)" if last else "no save yet")
        self.metrics.say(f"step {self.progress.step}/{self.cfg.train.max_steps} | "
                         f"loss {loss:.4f} | {tokens_per_s:,.0f} tok/s | {saved}")
