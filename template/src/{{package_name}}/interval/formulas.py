"""The checkpoint interval plan's model, the one source of its formulas: badput B(τ), Young's and
Daly's intervals, the target window and bounds, the :class:`Plan`, and the two tiers (the memory
tier against durable saves alone). docs/CHECKLIST.md states the model and its symbols; the
template's includes/plan.jinja repeats these expressions for the copy-time checklist (the
template's tests hold the two together). Inputs: interval.inputs; text and JSON:
interval.report; the command: tools/plan.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# CRASH_SHARE, NODE_LOSS_SHARE, Measured, MetricsError, read_metrics: still importable here.
from ..config.plan_defaults import CRASH_SHARE, NODE_LOSS_SHARE, SHARE_SLACK  # noqa: F401
from .inputs import Inputs, Measured, MetricsError, PlanInputError, read_metrics  # noqa: F401


# `x ** 0.5` rather than math.sqrt, and the operations in the order written: includes/plan.jinja
# repeats these expressions in Jinja, and identical operations give identical floats.
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
    return (min_saving_and_rework(inputs)
            + (inputs.restart_seconds + inputs.commit_latency_seconds) / inputs.mtbi_seconds)


def target_window_seconds(inputs: Inputs) -> tuple[float, float] | None:
    """The intervals tau (s) with B(tau) <= target, as (lowest, highest), or None: with
    x = tau + δ and b = target·M - R - L, x lies between the roots b ± √(b² - 2δM)."""
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
    # The root is exact up to rounding: check n ± 1 with B itself rather than trust the floor.
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


@dataclass(frozen=True)
class Plan:
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
        saving = self.in_place_saving
        return None if saving is None else self.expected_badput - saving

    @property
    def interval_seconds(self) -> float:
        return self.interval_steps * self.inputs.step_seconds

    @property
    def target_reachable(self) -> bool:
        return self.max_interval_steps is not None


def make_plan(inputs: Inputs, in_place_restart_seconds: float | None = None) -> Plan:
    """Check the inputs (PlanInputError if out of range) and compute the plan; with R_in
    (``in_place_restart_seconds``) also what in-place restarts save."""
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
        interval_steps=n, expected_badput=badput(n * step, inputs),
        components=badput_components(n * step, inputs), min_badput=min_badput(inputs),
        target_window_seconds=target_window_seconds(inputs),
        max_interval_steps=max_interval_steps_for_target(inputs),
        simple_bound_steps=simple_bound_steps(inputs),
        half_interval_steps=half, badput_at_half_interval=badput(half * step, inputs),
        double_interval_steps=2 * n, badput_at_double_interval=badput(2 * n * step, inputs),
        in_place_restart_seconds=in_place_restart_seconds,
        in_place_saving=(None if in_place_restart_seconds is None
                         else in_place_saving(inputs, in_place_restart_seconds)),
    )


# The two tiers: the same rule as above, includes/plan.jinja repeats these expressions.
def memory_share(inputs: Inputs) -> float:
    """a: the share of interruptions the memory tier covers, c + ν (c on one node)."""
    c = inputs.crash_share
    return c + inputs.node_loss_share if inputs.nodes >= 2 else c


def job_loss_share(inputs: Inputs) -> float:
    """1 - c - ν: the interruptions only durable storage survives."""
    return max(0.0, 1 - inputs.crash_share - inputs.node_loss_share)


def durable_share(inputs: Inputs) -> float:
    """1 - a: the interruptions that fall back to the durable save with the memory tier on."""
    return job_loss_share(inputs) if inputs.nodes >= 2 else max(0.0, 1 - inputs.crash_share)


def two_tier_badput(tau_d: float, tau_m: float | None, inputs: Inputs,
                    in_place_restart_seconds: float | None = None) -> float:
    """B2(τ_d, τ_m); with tau_m None (the memory tier off) B1(τ_d). R_in: a crash's restart
    time; None: R (every interruption rescheduled, as B assumes)."""
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
    return (None if share <= 0
            else daly_interval(inputs.memory_blocking, inputs.mtbi_seconds / share))


def durable_interval_seconds_with_memory(inputs: Inputs) -> float | None:
    """τ_d* = Daly(δ, M/(1-a)), re-optimised for the job losses; None without any."""
    share = durable_share(inputs)
    return (None if share < SHARE_SLACK
            else daly_interval(inputs.blocking_seconds, inputs.mtbi_seconds / share))


def shortest_memory_interval_steps(inputs: Inputs) -> int:
    """At least one step, and no memory save before the previous one reached the partner."""
    wait = max(inputs.memory_commit_latency - inputs.memory_blocking, 0)
    return max(1, math.ceil(wait / inputs.step_seconds))


def break_even_memory_blocking(inputs: Inputs) -> float | None:
    """δ(1-√(1-a))²/a: below this δ_m the memory tier pays, to first order; None if a = 0."""
    a, b = memory_share(inputs), durable_share(inputs)
    return None if a <= 0 else inputs.blocking_seconds * (1 - b**0.5) ** 2 / a


# (own, partner's) shards each rank keeps in memory with the tier on: two slots each, kept once
# written, so steady state = peak (SLOTS, checkpoint/memory/copies.py, rendered with memory_tier).
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
        raise PlanInputError("memory_interval_steps", "must be a whole number >= 0, 0 = off "
                             f"(got {memory_interval_steps!r})")
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
    durable_conf = n if durable_interval_steps is None else durable_interval_steps
    configured = (two_tier_badput(durable_conf * step, memory_interval_steps * step, i, r_in)
                  if memory_interval_steps > 0 else None)
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
