"""The checkpoint interval plan: the model, the one source of its formulas (about 700
lines: kept whole, so that every formula the checklist mirrors, the memory tier's too, is
in one file).

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

Two tiers: memory and durable. With ``checkpoint.memory_interval_steps`` > 0 each rank also
copies its state into its node's host memory (``checkpoint.memory_dir``, /dev/shm: it
survives a worker restart) and sends a copy to a partner rank on another node, every τ_m;
durable saves still come every τ_d (the τ above, ``checkpoint.interval_steps``·T).

    τ_m  training time between memory saves (memory_interval_steps·T; 0 steps = off)
    δ_m  time one memory save blocks training (s). Default δ: a memory save and the
         blocking part of a durable save are both one copy of the state into host memory
    L_m  memory commit latency (s): δ_m plus the time to send the copy to the partner,
         taken as 0 until given (``Inputs.memory_send_seconds``), so L_m = δ_m
    ν    node-loss share (plan.node_loss_share, default 0.2, an assumption), c + ν <= 1

Interruptions then come in three kinds, by what survives them:

    crash      c          the node's memory: restart in place (R_in), back to the newest
                          memory copy: half a memory interval lost on average
    node loss  ν          the partner's copy on another node: rescheduled (R), back to the
                          newest memory copy. On one node there is no partner: a node loss
                          falls back to the durable save, as a job loss does
    job loss   1 - c - ν  durable storage only (preempted without a save, every machine
                          gone): rescheduled (R), back to the durable save

    B2(τ_d, τ_m) = δ/(τ_d+δ) + δ_m/(τ_m+δ_m)
                 + [c(R_in + (τ_m+δ_m)/2 + L_m) + ν(R + (τ_m+δ_m)/2 + L_m)
                    + (1-c-ν)(R + (τ_d+δ)/2 + L)]/M

(on one node ν's term is ν(R + (τ_d+δ)/2 + L)). Without the memory tier every kind falls
back to the durable save:

    B1(τ_d) = δ/(τ_d+δ) + [c·R_in + (1-c)R + (τ_d+δ)/2 + L]/M  =  B(τ_d) - S

What is compared: B1 and B2 with the same restart times, R_in for crashes when it is
measured or given and otherwise R_in = R (every interruption rescheduled, as B assumes);
the restart terms then cancel in B1 - B2, which is the memory tier's gain in stalls,
rework and commit latency. B2 charges every save its own stall, also where a durable save
falls on a memory save's step (conservative: they could share one copy).

The recommendation. B2 splits into a durable part δ/(τ_d+δ) + λ_d(τ_d+δ)/2 and a memory
part δ_m/(τ_m+δ_m) + λ_m(τ_m+δ_m)/2, where λ_m = a/M is the rate of the interruptions the
memory tier covers (a = c + ν; a = c on one node) and λ_d = (1-a)/M that of those only
durable storage covers (job losses, and node losses on one node). Each part is B's
shape, so each has Daly's optimum: τ_m* = Daly(δ_m, M/a), τ_d* = Daly(δ, M/(1-a)), in
steps N_m = max(round(τ_m*/T), ⌈(L_m-δ_m)/T⌉, 1) and N_d as N. The memory tier is
recommended (checkpoint.memory_interval_steps = N_m, interval_steps = N_d) only when
B2(N_d·T, N_m·T) < B1(N·T); otherwise the recommendation is 0, off. To first order the
optimum costs √(2δ_m·a/M) + √(2δ(1-a)/M) against √(2δ/M) without the tier: with δ_m = δ
it never pays on stalls and rework (√a + √(1-a) >= 1), only through a durable commit
latency L well above L_m; it pays once δ_m < δ(1-√(1-a))²/a (first order, the break-even
below). With a = 0 there is no memory optimum; with 1 - a = 0 (no job losses) the durable
part costs nothing for rare saves and N_d stays N.

Memory each rank holds with the tier on: two slots of its own shard and two of its
partner's (the newest complete copy and the one before it, or the next being written:
checkpoint/memory/copies.py, rendered with memory_tier), 2 + 2 shards once two copies were made (on one node 2: no
partner). ``memory_shards_per_rank`` says so; the copies are freed when the job ends.

The copy-time numbers (includes/plan.jinja in the template) repeat these
expressions in Jinja; the template's tests hold the two together. Text, Markdown
and plots of a plan are in interval.report and interval.plot; the command line is
tools/plan.py (`python -m <package>.plan`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from dataclasses import dataclass

from ..config.plan_defaults import CRASH_SHARE, NODE_LOSS_SHARE, SHARE_SLACK
from ..runtime.metrics import METRICS_FILE, Event, metrics_file, read_events

# ------------------------------------------------------------------ inputs ----


class PlanInputError(ValueError):
    """An input is out of range; ``field`` names the :class:`Inputs` field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message




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
    node_loss_share: float = NODE_LOSS_SHARE   # ν: node losses, the partner's copy survives
    memory_blocking_seconds: float | None = None  # δ_m; None: δ (one copy into host memory)
    memory_send_seconds: float = 0.0  # sending the memory copy to the partner: L_m = δ_m + this

    @property
    def memory_blocking(self) -> float:
        """δ_m: the memory save's stall, the durable save's blocking time δ unless given."""
        if self.memory_blocking_seconds is None:
            return self.blocking_seconds
        return self.memory_blocking_seconds

    @property
    def memory_commit_latency(self) -> float:
        """L_m = δ_m + the time to send the copy to the partner."""
        return self.memory_blocking + self.memory_send_seconds

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
            if value is None and field.name == "memory_blocking_seconds":
                continue
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
        if not 0 <= self.node_loss_share <= 1:
            raise PlanInputError("node_loss_share",
                                 f"must be between 0 and 1 (got {self.node_loss_share:g})")
        if self.crash_share + self.node_loss_share > 1 + SHARE_SLACK:
            raise PlanInputError(
                "node_loss_share",
                f"must be at most 1 - crash share = {1 - self.crash_share:g}: crashes, node "
                f"losses and job losses share the interruptions (got {self.node_loss_share:g})")
        for name in ("memory_blocking_seconds", "memory_send_seconds"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise PlanInputError(name, f"must be >= 0 (got {value:g})")


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


# --------------------------------------------------------------- two tiers ----
# The same rule as above: includes/plan.jinja repeats these expressions, in this order.


def memory_share(inputs: Inputs) -> float:
    """a: the share of interruptions the memory tier covers, c + ν (c on one node)."""
    if inputs.nodes >= 2:
        return inputs.crash_share + inputs.node_loss_share
    return inputs.crash_share


def job_loss_share(inputs: Inputs) -> float:
    """1 - c - ν: the interruptions only durable storage survives."""
    return max(0.0, 1 - inputs.crash_share - inputs.node_loss_share)


def durable_share(inputs: Inputs) -> float:
    """1 - a: the interruptions that fall back to the durable save with the memory tier on."""
    if inputs.nodes >= 2:
        return job_loss_share(inputs)
    return max(0.0, 1 - inputs.crash_share)


def two_tier_badput(tau_d: float, tau_m: float | None, inputs: Inputs,
                    in_place_restart_seconds: float | None = None) -> float:
    """B2(τ_d, τ_m); with tau_m None (the memory tier off) B1(τ_d).

    R_in is the crash's restart time; None: R, every interruption rescheduled, as B assumes.
    """
    d, latency, mtbi = inputs.blocking_seconds, inputs.commit_latency_seconds, inputs.mtbi_seconds
    dm, lm = inputs.memory_blocking, inputs.memory_commit_latency
    c, nu, r = inputs.crash_share, inputs.node_loss_share, inputs.restart_seconds
    r_in = r if in_place_restart_seconds is None else in_place_restart_seconds
    durable = (tau_d + d) / 2 + latency
    if tau_m is None:
        memory, stall = durable, 0.0
    else:
        memory, stall = (tau_m + dm) / 2 + lm, dm / (tau_m + dm)
    node = memory if inputs.nodes >= 2 else durable
    job = job_loss_share(inputs)
    return d / (tau_d + d) + stall + (c * (r_in + memory) + nu * (r + node)
                                      + job * (r + durable)) / mtbi


def memory_interval_seconds(inputs: Inputs) -> float | None:
    """τ_m* = Daly(δ_m, M/a); None when the memory tier covers no interruption (a = 0)."""
    share = memory_share(inputs)
    if share <= 0:
        return None
    return daly_interval(inputs.memory_blocking, inputs.mtbi_seconds / share)


def durable_interval_seconds_with_memory(inputs: Inputs) -> float | None:
    """τ_d* = Daly(δ, M/(1-a)), re-optimised for the job losses; None without any."""
    share = durable_share(inputs)
    if share < SHARE_SLACK:
        return None
    return daly_interval(inputs.blocking_seconds, inputs.mtbi_seconds / share)


def shortest_memory_interval_steps(inputs: Inputs) -> int:
    """At least one step, and no memory save before the previous one reached the partner."""
    wait = max(inputs.memory_commit_latency - inputs.memory_blocking, 0)
    return max(1, math.ceil(wait / inputs.step_seconds))


def break_even_memory_blocking(inputs: Inputs) -> float | None:
    """δ(1-√(1-a))²/a: below this δ_m the memory tier pays, to first order; None if a = 0."""
    a, b = memory_share(inputs), durable_share(inputs)
    if a <= 0:
        return None
    return inputs.blocking_seconds * (1 - b**0.5) ** 2 / a


# Shards of its own size each rank keeps in memory with the memory tier on, (own,
# partner's): two slots each, both kept once written, so the steady state is the peak
# (SLOTS in checkpoint/memory/copies.py, rendered with memory_tier).
MEMORY_SHARDS = (2, 2)


def memory_shards_per_rank(nodes: int) -> dict[str, int]:
    """The copies one rank holds, as multiples of its shard: own + partner's (none on one
    node). The ``_peak`` figures equal them: no slot is added while a copy is written."""
    own, partner = MEMORY_SHARDS[0], MEMORY_SHARDS[1] if nodes >= 2 else 0
    return {"own": own, "partner": partner, "own_peak": own, "partner_peak": partner}


@dataclass(frozen=True)
class FailureKind:
    """What one kind of interruption keeps and costs, without and with the memory tier."""

    kind: str              # crash | node_loss | job_loss
    share: float
    keeps: str             # node_memory | partner_copy | durable: what it resumes from
    restart_seconds: float
    lost_seconds_without: float   # average work lost without the memory tier (at N)
    lost_seconds_with: float      # with it (at N_d and N_m)
    badput_without: float         # share·(restart + lost)/M, a fraction
    badput_with: float


@dataclass(frozen=True)
class TwoTierPlan:
    """The memory tier against durable saves alone, for one plan's inputs."""

    plan: Plan
    in_place_restart_seconds: float     # R_in used: measured or given, else R
    memory_share: float                 # a
    durable_share: float                # 1 - a
    badput_without: float               # B1(N·T)
    memory_interval_seconds: float | None          # τ_m*
    durable_interval_seconds: float | None         # τ_d*, with the memory tier
    optimal_memory_interval_steps: int | None      # N_m (None: the tier covers nothing)
    optimal_durable_interval_steps: int            # N_d
    badput_with: float | None           # B2(N_d·T, N_m·T)
    break_even_memory_blocking_seconds: float | None
    failure_kinds: tuple[FailureKind, ...]
    memory_shards: dict[str, int]
    configured_memory_interval_steps: int = 0      # checkpoint.memory_interval_steps
    configured_durable_interval_steps: int | None = None
    configured_badput: float | None = None         # B2 at the configured intervals (K > 0)

    @property
    def pays(self) -> bool:
        return self.badput_with is not None and self.badput_with < self.badput_without

    @property
    def recommended_memory_interval_steps(self) -> int:
        """N_m when the memory tier lowers badput, else 0 (off)."""
        return self.optimal_memory_interval_steps if self.pays else 0

    @property
    def recommended_durable_interval_steps(self) -> int:
        return self.optimal_durable_interval_steps if self.pays else self.plan.interval_steps


def make_two_tier(plan: Plan, memory_interval_steps: int = 0,
                  durable_interval_steps: int | None = None) -> TwoTierPlan:
    """The two-tier figures for a plan; at the configured intervals too when
    memory_interval_steps > 0 (durable_interval_steps: the configured one, default N)."""
    i = plan.inputs
    if isinstance(memory_interval_steps, bool) or not isinstance(memory_interval_steps, int) \
            or memory_interval_steps < 0:
        raise PlanInputError("memory_interval_steps",
                             f"must be a whole number >= 0, 0 = off (got {memory_interval_steps!r})")
    step, r = i.step_seconds, i.restart_seconds
    r_in = r if plan.in_place_restart_seconds is None else plan.in_place_restart_seconds
    n = plan.interval_steps
    tau_m, tau_d = memory_interval_seconds(i), durable_interval_seconds_with_memory(i)
    n_m = None if tau_m is None else max(round(tau_m / step), shortest_memory_interval_steps(i))
    n_d = n if tau_d is None else max(round(tau_d / step), shortest_interval_steps(i))
    with_memory = None if n_m is None else two_tier_badput(n_d * step, n_m * step, i, r_in)

    def lost(tau, d, latency):
        return (tau + d) / 2 + latency

    durable_without = lost(n * step, i.blocking_seconds, i.commit_latency_seconds)
    durable_with = lost(n_d * step, i.blocking_seconds, i.commit_latency_seconds)
    memory_with = durable_with if n_m is None else lost(n_m * step, i.memory_blocking,
                                                        i.memory_commit_latency)
    node_keeps = "partner_copy" if i.nodes >= 2 else "durable"
    kinds = []
    for kind, share, keeps, restart in (
            ("crash", i.crash_share, "node_memory", r_in),
            ("node_loss", i.node_loss_share, node_keeps, r),
            ("job_loss", job_loss_share(i), "durable", r)):
        with_ = durable_with if keeps == "durable" else memory_with
        kinds.append(FailureKind(kind, share, keeps, restart, durable_without, with_,
                                 share * (restart + durable_without) / i.mtbi_seconds,
                                 share * (restart + with_) / i.mtbi_seconds))
    configured = None
    durable_conf = n if durable_interval_steps is None else durable_interval_steps
    if memory_interval_steps > 0:
        configured = two_tier_badput(durable_conf * step, memory_interval_steps * step, i, r_in)
    return TwoTierPlan(
        plan=plan, in_place_restart_seconds=r_in, memory_share=memory_share(i),
        durable_share=durable_share(i),
        badput_without=two_tier_badput(n * step, None, i, r_in),
        memory_interval_seconds=tau_m, durable_interval_seconds=tau_d,
        optimal_memory_interval_steps=n_m, optimal_durable_interval_steps=n_d,
        badput_with=with_memory,
        break_even_memory_blocking_seconds=break_even_memory_blocking(i),
        failure_kinds=tuple(kinds), memory_shards=memory_shards_per_rank(i.nodes),
        configured_memory_interval_steps=memory_interval_steps,
        configured_durable_interval_steps=durable_conf if memory_interval_steps > 0 else None,
        configured_badput=configured,
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
    # δ_m and the time to commit and send a memory copy (``memory_save`` events, the
    # first of each start left out as a warm-up), None when the memory tier was off.
    memory_blocking_seconds: float | None = None
    memory_send_seconds: float | None = None
    memory_save_count: int = 0


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
    memory: list[tuple[float, float]] = []   # stall, commit + send
    first_memory_of_run = True
    events, skipped = read_events(path, Event.start, Event.step, Event.save, Event.recovered,
                                  Event.memory_save)
    for record in events:
        kind = record["event"]
        if kind == Event.memory_save:
            if not first_memory_of_run and record.get("error") is None and all(
                    _is_number(record.get(k)) for k in ("stall_s", "commit_s", "replicate_s")):
                memory.append((float(record["stall_s"]),
                               float(record["commit_s"]) + float(record["replicate_s"])))
            first_memory_of_run = False
        elif kind == Event.recovered:
            if record.get("in_place") is True and _is_number(record.get(
                    "failure_to_first_step_s")):
                in_place.append(float(record["failure_to_first_step_s"]))
        elif kind == Event.start:
            first_save_of_run = first_memory_of_run = True
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
        memory_blocking_seconds=statistics.median(m[0] for m in memory) if memory else None,
        memory_send_seconds=statistics.median(m[1] for m in memory) if memory else None,
        memory_save_count=len(memory),
    )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
