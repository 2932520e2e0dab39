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
from torch.distributed.checkpoint.api import CheckpointException
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
        self._saving_synchronously = False
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
        # RNG streams belong to ranks on one kind of device: they only carry over when
        # the ranks and the device kind do (a CPU save holds no CUDA generator state).
        saved_device = checkpoint.record.get("device_type", "cpu")
        same_streams = (checkpoint.world_size == self.runtime.world_size
                        and saved_device == self.runtime.device.type)
        self.manager.load(self.state(with_rng=same_streams), checkpoint)
        if not same_streams:
            torch.manual_seed(rank_seed(self.cfg.train.seed, self.progress.step,
                                        self.runtime.rank))
            self.metrics.say(
                f"notice: checkpoint saved on {checkpoint.world_size} {saved_device} rank(s), "
                f"resuming on {self.runtime.world_size} {self.runtime.device.type} rank(s): "
                "random streams reseeded from (seed, step, rank)")
        self.resumed_from = checkpoint
        return checkpoint

    def _commit_record(self) -> dict[str, Any]:
        return {
            "world_size": self.runtime.world_size,
            "device_type": self.runtime.device.type,
            "global_batch_size": self.batches.global_batch_size,
            "micro_batch_size": self.batches.micro_batch_size,
            "grad_accum_steps": self.batches.grad_accum_steps,
            "samples_consumed": self.progress.samples_consumed,
            "config": to_plain_dict(self.cfg),
        }

    def save(self, reason: str, *, blocking: bool = False,
             started: float | None = None) -> SaveResult | None:
        """Hand the current state to the checkpoint manager (see CheckpointManager.save)."""
        return self.manager.save(self.progress.step, self.state(), reason,
                                 self._commit_record(), blocking=blocking, started=started)

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
        # A request that came during start-up (building, resuming) stops before step one.
        stop_at, _ = self._vote()
        while stop_at is None and self.progress.step < cfg.train.max_steps:
            began = time.perf_counter()
            loss, grad_norm = self.train_step()
            step_time = time.perf_counter() - began
            step = self.progress.step
            self.metrics.event("step", step=step, loss=loss, grad_norm=grad_norm,
                               step_time_s=step_time, tokens_per_s=tokens_per_step / step_time,
                               lr=self.scheduler.get_last_lr()[0])
            self._report(self.manager.poll())
            due = step == cfg.train.max_steps or step % interval == 0
            save_began = time.perf_counter()
            if due:
                self._finish_previous_save()
            # The step boundary: all ranks vote before a save starts, so that no save
            # begins after a stop request (its checkpoint process may be dead already).
            stop_at, saves_failed = self._vote()
            if stop_at is not None:
                break
            if due:
                reason = "final" if step == cfg.train.max_steps else "interval"
                if saves_failed and not self._saving_synchronously:
                    # e.g. DCP's checkpoint process died: it is never restarted, so keep
                    # checkpoints coming the slow, dependable way.
                    self._saving_synchronously = True
                    self.metrics.say("a background save failed: saving synchronously from now on")
                    self.metrics.event("save_mode_changed", step=step, mode="sync",
                                       reason="a background save failed")
                self._report(self.save(reason, started=save_began,
                                        blocking=self._saving_synchronously))
            if step % cfg.log.every_steps == 0 or step == cfg.train.max_steps:
                self._progress_line(loss, tokens_per_step / step_time)
        if stop_at is not None:
            return self._stop_for_preemption(stop_at)
        self._report(self.manager.wait())
        return Outcome("finished", self.progress.step, self.manager.last_committed)

    def _finish_previous_save(self) -> None:
        """Finish the save still in flight before the next one is due (one at a time).

        Done before the vote, so that a request arriving while waiting stops at this
        step; a request seen here ends the wait, and the stop drains the save within
        the grace period instead.
        """
        while self.manager.in_flight and self.watch.requested is None:
            try:
                self._report(self.manager.wait(timeout=0.1))
            except TimeoutError:
                continue

    def _vote(self) -> tuple[float | None, bool]:
        """One small all-reduce at a step boundary, so that every rank decides alike.

        Returns the wall-clock time of the earliest stop request on any rank (or None)
        and whether a save has failed on any rank.
        """
        request = self.watch.requested
        earliest = request.wall_time if request is not None else math.inf
        failed = 1.0 if self.manager.failed_saves else 0.0
        if self.runtime.world_size > 1:
            tensor = torch.tensor([earliest, -failed], dtype=torch.float64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)  # MIN of -failed is -(any failed)
            earliest, failed = float(tensor[0]), -float(tensor[1])
        return (None if math.isinf(earliest) else earliest), failed > 0

    def _agreed_source(self) -> tuple[str, int, str, list[int]]:
        """Source, rank and detail of the earliest request, and every rank's step.

        A collective, run once when stopping: rank 0 logs what reached another rank
        first, and the steps show that all ranks stopped at the same one.
        """
        request = self.watch.requested
        mine = ((request.wall_time, request.source, request.detail) if request is not None
                else (math.inf, "", "")) + (self.progress.step,)
        every: list = [mine]
        if self.runtime.world_size > 1:
            every = [None] * self.runtime.world_size
            dist.all_gather_object(every, mine)
        rank = min(range(len(every)), key=lambda r: every[r][0])
        return every[rank][1], rank, every[rank][2], [entry[3] for entry in every]

    def _newest_committed_step(self) -> int | None:
        """The step a restart would resume from (rank 0 knows), or None."""
        if self.manager.last_committed is not None:
            return self.manager.last_committed.step
        return self.resumed_from.step if self.resumed_from is not None else None

    def _save_estimate_s(self) -> float:
        """How long a final (blocking) save may take: the newest measured write time.

        This run's last commit, else the one resumed from (its commit.json), else 0
        (unknown: try anyway; a save cut off by the hard kill never counts).
        """
        if self.manager.last_committed is not None:
            return self.manager.last_committed.write_s
        if self.resumed_from is not None:
            record = self.resumed_from.record
            return float(record.get("write_s", record.get("commit_latency_s", 0.0)))
        return 0.0

    def _final_save_skip_reason(self, step: int, deadline: float, estimate: float,
                                drain_timed_out: bool) -> str | None:
        """Why no final checkpoint should be written at ``step`` (rank 0), or None."""
        newest = self._newest_committed_step()
        if newest == step:
            return f"checkpoint at step {step} already committed"
        if newest is None and step == 0:
            return "no step trained yet"
        if drain_timed_out:
            return "finishing the save in flight used up the grace period"
        remaining = deadline - time.time()
        if remaining < estimate:
            return (f"{remaining:.2f} s of grace left, a save takes about {estimate:.2f} s "
                    f"(measured)")
        return None

    def _stop_for_preemption(self, requested_at: float) -> Outcome:
        """Drain the in-flight save, then commit a final one at this step if the grace allows.

        Time runs from the earliest request on any rank; the deadline is that plus
        ``preemption.grace_period_s``. The drain gives up at the deadline; a final save
        that the measured save time says cannot fit is not started, and the newest
        committed checkpoint stays the one to resume from. Either way nothing torn can
        count: only a commit makes a checkpoint.
        """
        grace = self.cfg.preemption.grace_period_s
        deadline = requested_at + grace
        source, source_rank, detail, rank_steps = self._agreed_source()
        step = self.progress.step
        in_flight_step = self.manager.in_flight_step
        what = source + (f" on rank {source_rank}" if self.runtime.world_size > 1 else "")
        what += f": {detail}" if detail else ""
        draining = (f", finishing the save of step {in_flight_step} in flight"
                    if in_flight_step is not None else "")
        self.metrics.say(f"stop requested ({what}) at step {step}{draining}; "
                         f"grace period {grace:g} s")

        # 1. Drain: the save in flight commits, or fails (a signal sent to the process group
        #    also kills DCP's checkpoint process), or is given up at the deadline.
        drained, drain_timed_out, committed_at = None, False, None
        try:
            drained = self.manager.wait(timeout=deadline - time.time())
        except TimeoutError:
            self.manager.abandon()  # logs it; the unfinished directory never counts
            drain_timed_out = True
        if drained is not None:
            committed_at = time.time()
            self._report(drained)

        # 2. Final save at this step, decided by rank 0 (it alone knows what committed) so
        #    that every rank joins the same collective save or none does. A drain that ran
        #    out of time on any rank counts: rank 0 must not plan on time that rank lacks.
        if self.runtime.world_size > 1:
            flag = torch.tensor([1 if drain_timed_out else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            drain_timed_out = bool(flag.item())
        estimate = self._save_estimate_s()
        skip = self._final_save_skip_reason(step, deadline, estimate, drain_timed_out)
        decision = torch.tensor([1 if skip is None else 0])
        if self.runtime.world_size > 1:
            dist.broadcast(decision, src=0)
        final = None
        if bool(decision.item()):
            try:
                final = self.save("preemption", blocking=True)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - still exit as preempted
                log.error("final checkpoint at step %d failed: %s", step, exc)
                skip = f"final save failed: {exc}"
            if final is not None:
                committed_at = time.time()
                self._report(final)

        finished = time.time()
        to_commit = committed_at - requested_at if committed_at is not None else None
        grace_left = deadline - finished
        resume_step = self._newest_committed_step()
        self.metrics.event(
            "preemption", source=source, source_rank=source_rank, detail=detail,
            stop_step=step, rank_stop_steps=rank_steps, in_flight_step=in_flight_step,
            drained_step=drained.step if drained is not None else None,
            final_checkpoint_step=final.step if final is not None else None,
            final_save_skipped_reason=skip if final is None else None,
            save_estimate_s=estimate, signal_to_commit_s=to_commit,
            grace_period_s=grace, grace_left_s=grace_left, resume_step=resume_step,
            signals_received=self.watch.count)
        if final is not None:
            outcome = f"checkpoint step {step} committed {to_commit:.2f} s after the request"
        else:
            outcome = (f"no final checkpoint ({skip}); a restart resumes from "
                       f"{'step ' + str(resume_step) if resume_step is not None else 'scratch'}")
        left = (f"{grace_left:.1f} s of grace left" if grace_left >= 0
                else f"{-grace_left:.2f} s past the grace period")
        self.metrics.say(f"stopped at step {step}: {outcome}; {left}")
        if self.runtime.is_main and to_commit is not None and to_commit > grace:
            log.warning("the last commit came %.1f s after the request, past the %g s grace "
                        "period: where the platform kills on time it would have been lost",
                        to_commit, grace)
        return Outcome("preempted", step, self.manager.last_committed)

    # ------------------------------------------------------------- reporting --
    def _report(self, result: SaveResult | None) -> None:
        if result is None:
            return
        self.metrics.event("save", step=result.step, reason=result.reason, mode=result.mode,
                           blocking_s=result.blocking_s, commit_latency_s=result.commit_latency_s,
                           write_s=result.write_s, path=result.path, removed=result.removed)
        self.metrics.say(f"checkpoint step {result.step} committed ({result.reason}, "
                         f"{result.mode}): blocking {result.blocking_s:.3f} s, committed "
                         f"{result.commit_latency_s:.2f} s after the save began")

    def _progress_line(self, loss: float, tokens_per_s: float) -> None:
        last = self.manager.last_committed
        saved = (f"last save step {last.step} (blocking {last.blocking_s:.3f} s, "
                 f"committed after {last.commit_latency_s:.2f} s)" if last else "no save yet")
        self.metrics.say(f"step {self.progress.step}/{self.cfg.train.max_steps} | "
                         f"loss {loss:.4f} | {tokens_per_s:,.0f} tok/s | {saved}")
