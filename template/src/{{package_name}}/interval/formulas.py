"""The checkpoint interval plan: the model, the one source of its formulas (a little over
400 lines: kept whole, so that every formula the checklist mirrors is in one file).

    M   mean time between interruptions of the job (s): one node's MTBI / nodes, below
    T   time of one optimizer step (s)          δ   time one save blocks training (s)
    R   restart time: rescheduled by the scheduler, until training runs again (s)
    L   commit latency, from save start until the checkpoint is committed (s), L >= δ
    target   accepted badput (fraction of machine time)
    R_in     in-place restart time: torchrun restarts the workers after a crash (s)
    c        crash share: the share of interruptions that are crashes, not preemptions

M is the job's: the answer (``mtbi_hours``) is one node's MTBI, and a job on n nodes is
interrupted whenever any of them is. With independent interruptions the job's MTBI is
the per-node MTBI / n (``Inputs.mtbi_seconds``), and every formula below uses that.

Expected badput when training runs τ seconds between saves:

    B(τ) = δ/(τ+δ) + (R + (τ+δ)/2 + L)/M

The first term is the share of time training is blocked by saves. The second is
what one interruption costs, spread over M: the restart, half an interval of
work on average, and the work done while the newest save was still committing
(an interruption then falls back to the save before it).

Crashes (a worker dies or hangs) are restarted in place by torchrun in R_in, without
giving up the machines; preemptions are rescheduled in R. With a share c of crashes the
restart term is ((1-c)R + c·R_in)/M, so in-place restarts save

    S = c(R - R_in)/M

of machine time; B above is the plan without them (every interruption rescheduled).
c is an assumption (plan.crash_share, default 0.5); R_in is measured (``recovered``
events of in-place restarts in metrics.jsonl). The interval does not depend on R.

The interval is Daly's higher-order estimate (Daly 2006, Future Generation
Computer Systems 22(3)); its first term, √(2δM), is Young's (1974).

The copy-time numbers (includes/plan.jinja in the template) repeat these
expressions in Jinja; the template's tests hold the two together. Text, Markdown
and plots of a plan are in interval.report and interval.plot; the command line is
interval.command (`python -m <package>.plan`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from dataclasses import dataclass

from ..runtime.metrics import METRICS_FILE, Event, metrics_file, read_events

# ------------------------------------------------------------------ inputs ----


class PlanInputError(ValueError):
    """An input is out of range; ``field`` names the :class:`Inputs` field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


CRASH_SHARE = 0.5  # assumed share of interruptions that are crashes (restarted in place)


@dataclass(frozen=True)
class Inputs:
    mtbi_hours: float
    step_seconds: float
    blocking_seconds: float
    commit_latency_seconds: float
    restart_seconds: float
    badput_target_percent: float
    crash_share: float = CRASH_SHARE
    nodes: int = 1   # mtbi_hours is one node's; the job's MTBI is mtbi_hours / nodes

    @property
    def mtbi_seconds(self) -> float:
        """M: the job's MTBI in seconds, the per-node MTBI divided by the node count."""
        return self.mtbi_hours * 3600.0 / self.nodes

    @property
    def job_mtbi_hours(self) -> float:
        return self.mtbi_hours / self.nodes

    @property
    def target(self) -> float:
        return self.badput_target_percent / 100

    def check(self) -> None:
        """Raise PlanInputError for the first input that is out of range."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PlanInputError(field.name, f"must be a number (got {value!r})")
            if not math.isfinite(value):
                raise PlanInputError(field.name, f"must be a finite number (got {value})")
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise PlanInputError("nodes", f"must be a whole number >= 1 (got {self.nodes!r})")
        for name in ("mtbi_hours", "step_seconds"):
            if getattr(self, name) <= 0:
                raise PlanInputError(name, f"must be > 0 (got {getattr(self, name):g})")
        for name in ("blocking_seconds", "commit_latency_seconds", "restart_seconds"):
            if getattr(self, name) < 0:
                raise PlanInputError(name, f"must be >= 0 (got {getattr(self, name):g})")
        if self.commit_latency_seconds < self.blocking_seconds:
            raise PlanInputError(
                "commit_latency_seconds",
                f"must be >= the blocking time {self.blocking_seconds:g} s, since a save cannot "
                f"be committed before it stops blocking (got {self.commit_latency_seconds:g})",
            )
        if not 0 < self.badput_target_percent < 100:
            raise PlanInputError(
                "badput_target_percent",
                f"must be between 0 and 100, exclusive (got {self.badput_target_percent:g})",
            )
        if not 0 <= self.crash_share <= 1:
            raise PlanInputError("crash_share",
                                 f"must be between 0 and 1 (got {self.crash_share:g})")


# ---------------------------------------------------------------- formulas ----
# `x ** 0.5` rather than math.sqrt, and the operations in the order written:
# includes/plan.jinja computes the copy-time checklist with the same expressions
# in Jinja, and identical operations give identical floats.


def badput(tau: float, inputs: Inputs) -> float:
    """Expected badput (fraction) with tau seconds of training between saves."""
    d, latency = inputs.blocking_seconds, inputs.commit_latency_seconds
    return d / (tau + d) + (inputs.restart_seconds + (tau + d) / 2 + latency) / inputs.mtbi_seconds


def badput_components(tau: float, inputs: Inputs) -> dict[str, float]:
    """The terms of B(tau), as fractions; they add up to badput(tau, inputs)."""
    d, mtbi = inputs.blocking_seconds, inputs.mtbi_seconds
    return {
        "saving": d / (tau + d),
        "rework": (tau + d) / 2 / mtbi,
        "commit_latency": inputs.commit_latency_seconds / mtbi,
        "restart": inputs.restart_seconds / mtbi,
    }


def in_place_saving(inputs: Inputs, in_place_restart_seconds: float) -> float:
    """S = c(R - R_in)/M: the badput in-place restarts save (negative if R_in > R)."""
    return (inputs.crash_share * (inputs.restart_seconds - in_place_restart_seconds)
            / inputs.mtbi_seconds)


def young_interval(delta: float, mtbi: float) -> float:
    """Young's first-order optimum √(2δM), in seconds."""
    return (2 * delta * mtbi) ** 0.5


def daly_interval(delta: float, mtbi: float) -> float:
    """Daly's higher-order optimum for the time between saves, in seconds."""
    if delta < 2 * mtbi:
        x = delta / (2 * mtbi)
        return (2 * delta * mtbi) ** 0.5 * (1 + (1 / 3) * x**0.5 + (1 / 9) * x) - delta
    return mtbi


def shortest_interval_steps(inputs: Inputs) -> int:
    """At least one step, and never a new save before the previous one can have committed."""
    wait = max(inputs.commit_latency_seconds - inputs.blocking_seconds, 0)
    return max(1, math.ceil(wait / inputs.step_seconds))


def recommended_interval_steps(inputs: Inputs) -> int:
    """N = max(1, round(τ*/T), ⌈max(L - δ, 0)/T⌉)."""
    tau = daly_interval(inputs.blocking_seconds, inputs.mtbi_seconds)
    return max(round(tau / inputs.step_seconds), shortest_interval_steps(inputs))


def min_saving_and_rework(inputs: Inputs) -> float:
    """δ/x + x/(2M), with x = τ + δ, is smallest at x = √(2δM), where it is √(2δ/M)."""
    return (2 * inputs.blocking_seconds / inputs.mtbi_seconds) ** 0.5


def min_badput(inputs: Inputs) -> float:
    """A floor no interval can beat (restart and commit latency do not depend on τ)."""
    restart_and_commit = inputs.restart_seconds + inputs.commit_latency_seconds
    return min_saving_and_rework(inputs) + restart_and_commit / inputs.mtbi_seconds


def target_window_seconds(inputs: Inputs) -> tuple[float, float] | None:
    """The intervals tau (s) with B(tau) <= target, as (lowest, highest), or None.

    With x = tau + δ, B(tau) <= target is x² - 2bx + 2δM <= 0 where
    b = target·M - R - L, so x lies between the roots b ± √(b² - 2δM).
    """
    d, mtbi = inputs.blocking_seconds, inputs.mtbi_seconds
    b = inputs.target * mtbi - inputs.restart_seconds - inputs.commit_latency_seconds
    disc = b * b - 2 * d * mtbi
    if b <= 0 or disc < 0:
        return None
    return b - disc**0.5 - d, b + disc**0.5 - d


def max_interval_steps_for_target(inputs: Inputs) -> int | None:
    """The largest allowed N with B(N·T) <= target, or None if there is none."""
    window = target_window_seconds(inputs)
    if window is None:
        return None
    step, target, shortest = inputs.step_seconds, inputs.target, shortest_interval_steps(inputs)
    n = max(math.floor(window[1] / step), shortest - 1)
    # The root is exact up to rounding, so the answer is n, n + 1 or n - 1:
    # check the neighbours with B itself rather than trusting the floor.
    while badput((n + 1) * step, inputs) <= target:
        n += 1
    for candidate in (n, n - 1):
        if candidate >= shortest and badput(candidate * step, inputs) <= target:
            return candidate
    return None


def simple_bound_steps(inputs: Inputs) -> int | None:
    """The source article's bound N <= 2(target·M - δ)/T, floored; None if below one step."""
    target, mtbi, step = inputs.target, inputs.mtbi_seconds, inputs.step_seconds
    bound = 2 * (target * mtbi - inputs.blocking_seconds) / step
    return math.floor(bound) if bound >= 1 else None


# -------------------------------------------------------------------- plan ----


@dataclass(frozen=True)
class Plan:
    """The checkpoint interval plan for one set of inputs."""

    inputs: Inputs
    young_interval_seconds: float
    daly_interval_seconds: float
    shortest_interval_steps: int
    interval_steps: int
    expected_badput: float
    components: dict[str, float]
    min_badput: float
    target_window_seconds: tuple[float, float] | None
    max_interval_steps: int | None
    simple_bound_steps: int | None
    half_interval_steps: int
    badput_at_half_interval: float
    double_interval_steps: int
    badput_at_double_interval: float
    in_place_restart_seconds: float | None = None   # R_in, when measured or given
    in_place_saving: float | None = None            # S at the recommended interval

    @property
    def expected_badput_with_in_place(self) -> float | None:
        """B - S: the plan's badput when crashes are restarted in place."""
        if self.in_place_saving is None:
            return None
        return self.expected_badput - self.in_place_saving

    @property
    def interval_seconds(self) -> float:
        return self.interval_steps * self.inputs.step_seconds

    @property
    def target_reachable(self) -> bool:
        return self.max_interval_steps is not None


def make_plan(inputs: Inputs, in_place_restart_seconds: float | None = None) -> Plan:
    """Check the inputs (PlanInputError if out of range) and compute the plan.

    With ``in_place_restart_seconds`` (R_in) the plan also says what in-place restarts
    save at the inputs' MTBI and crash share.
    """
    inputs.check()
    if in_place_restart_seconds is not None and not (
            math.isfinite(in_place_restart_seconds) and in_place_restart_seconds >= 0):
        raise PlanInputError("in_place_restart_seconds",
                             f"must be a finite number >= 0 (got {in_place_restart_seconds})")
    step = inputs.step_seconds
    n = recommended_interval_steps(inputs)
    # "Twice as often" never goes below the shortest allowed interval.
    half = max(n // 2, shortest_interval_steps(inputs))
    return Plan(
        inputs=inputs,
        young_interval_seconds=young_interval(inputs.blocking_seconds, inputs.mtbi_seconds),
        daly_interval_seconds=daly_interval(inputs.blocking_seconds, inputs.mtbi_seconds),
        shortest_interval_steps=shortest_interval_steps(inputs),
        interval_steps=n,
        expected_badput=badput(n * step, inputs),
        components=badput_components(n * step, inputs),
        min_badput=min_badput(inputs),
        target_window_seconds=target_window_seconds(inputs),
        max_interval_steps=max_interval_steps_for_target(inputs),
        simple_bound_steps=simple_bound_steps(inputs),
        half_interval_steps=half,
        badput_at_half_interval=badput(half * step, inputs),
        double_interval_steps=2 * n,
        badput_at_double_interval=badput(2 * n * step, inputs),
        in_place_restart_seconds=in_place_restart_seconds,
        in_place_saving=(None if in_place_restart_seconds is None
                         else in_place_saving(inputs, in_place_restart_seconds)),
    )


# ---------------------------------------------------------- measured inputs ----


class MetricsError(ValueError):
    """metrics.jsonl is missing or holds too little to plan from."""


@dataclass(frozen=True)
class Measured:
    """T, δ and L as training measured them (field names as in :class:`Inputs`)."""

    path: str
    step_seconds: float
    step_count: int
    blocking_seconds: float
    commit_latency_seconds: float
    save_count: int
    save_reason: str  # "interval", or "all" when there were no interval saves
    warmup_excluded: int
    warmup_only: bool  # every save left was a warm-up, so they were kept
    latency_raised: bool  # the median latency came out below the median blocking time
    skipped_lines: int
    # R_in: median seconds from a failure to the first step after torchrun restarted the
    # workers in place (``recovered`` events), None when none happened.
    in_place_restart_seconds: float | None = None
    in_place_restart_count: int = 0


def read_metrics(path: str | os.PathLike) -> Measured:
    """Medians of step time, save blocking time and commit latency from metrics.jsonl.

    The first save after each start is a warm-up (a process save starts its
    writer process then) and is left out while other saves remain. In-place restarts
    (``recovered`` events) give R_in, when there were any.
    """
    path = metrics_file(path)
    if not path.is_file():
        raise MetricsError(f"{path}: no such file (training writes it to <log.dir>/{METRICS_FILE})")
    step_times: list[float] = []
    saves: list[tuple[str, float, float, bool]] = []  # reason, blocking, latency, warm-up
    first_save_of_run = True
    in_place: list[float] = []
    events, skipped = read_events(path, Event.start, Event.step, Event.save, Event.recovered)
    for record in events:
        kind = record["event"]
        if kind == Event.recovered:
            if record.get("in_place") is True and _is_number(record.get(
                    "failure_to_first_step_s")):
                in_place.append(float(record["failure_to_first_step_s"]))
        elif kind == Event.start:
            first_save_of_run = True
        elif kind == Event.step and _is_number(record.get("step_time_s")):
            step_times.append(float(record["step_time_s"]))
        elif kind == Event.save:
            blocking, latency = record.get("blocking_s"), record.get("commit_latency_s")
            if not (_is_number(blocking) and _is_number(latency)):
                skipped += 1
                continue
            # Time the loop waited for the previous save before this one could start is
            # time on the training path too.
            waited = record.get("waited_s", 0.0)
            blocking = float(blocking) + (float(waited) if _is_number(waited) else 0.0)
            saves.append((str(record.get("reason")), blocking, float(latency),
                          first_save_of_run))
            first_save_of_run = False
    if not step_times:
        raise MetricsError(f"{path}: no step events with step_time_s; "
                           "run some training steps first")
    if not saves:
        raise MetricsError(f"{path}: no save events; run training past checkpoint.interval_steps "
                           "(or with a smaller interval) so that it saves at least once")
    pool = [s for s in saves if s[0] == "interval"]
    reason = "interval" if pool else "all"
    pool = pool or saves
    kept = [s for s in pool if not s[3]] or pool
    blocking = statistics.median(s[1] for s in kept)
    latency = statistics.median(s[2] for s in kept)
    return Measured(
        path=str(path),
        step_seconds=statistics.median(step_times),
        step_count=len(step_times),
        blocking_seconds=blocking,
        # Each save's latency includes its blocking time; clock noise aside,
        # the medians keep that order. Keep the model's L >= δ either way.
        commit_latency_seconds=max(latency, blocking),
        save_count=len(kept),
        save_reason=reason,
        warmup_excluded=len(pool) - len(kept),
        warmup_only=all(s[3] for s in kept),
        latency_raised=latency < blocking,
        skipped_lines=skipped,
        in_place_restart_seconds=statistics.median(in_place) if in_place else None,
        in_place_restart_count=len(in_place),
    )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
