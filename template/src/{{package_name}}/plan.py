"""How often to save a checkpoint, and what interruptions cost.

The model (the only copy of these formulas in the project; the checklist written
at copy time mirrors them and the template's tests hold the two together):

    M   mean time between interruptions (s)     T   time of one optimizer step (s)
    δ   time one save blocks training (s)       R   restart time (s)
    L   commit latency, from save start until the checkpoint is committed (s), L >= δ
    target   accepted badput (fraction of machine time)

Expected badput when training runs τ seconds between saves:

    B(τ) = δ/(τ+δ) + (R + (τ+δ)/2 + L)/M

The first term is the share of time training is blocked by saves. The second is
what one interruption costs, spread over M: the restart, half an interval of
work on average, and the work done while the newest save was still committing
(an interruption then falls back to the save before it).

The interval is Daly's higher-order estimate (Daly 2006, Future Generation
Computer Systems 22(3)); its first term, √(2δM), is Young's (1974).

    python -m <package>.plan --help
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .config import DEFAULT_CONFIG, ConfigError

END_MARKER = "<!-- measured:end -->"
# The begin marker carries the checklist's language so that --write can refresh
# the section in the language the rest of the file is written in.
BEGIN_MARKER_RE = re.compile(r"<!-- measured:begin(?: lang=(?P<lang>[a-z]+))? -->")
PLOT_SUFFIXES = (".png", ".svg")


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

    @property
    def mtbi_seconds(self) -> float:
        return self.mtbi_hours * 3600.0

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


# ---------------------------------------------------------------- formulas ----
# `x ** 0.5` rather than math.sqrt, and the operations in the order written:
# copier.yml computes the copy-time checklist with the same expressions in
# Jinja, and identical operations give identical floats.


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

    @property
    def interval_seconds(self) -> float:
        return self.interval_steps * self.inputs.step_seconds

    @property
    def target_reachable(self) -> bool:
        return self.max_interval_steps is not None

    def to_json(self) -> dict:
        i = self.inputs
        window = self.target_window_seconds
        return {
            "interval_steps": self.interval_steps,
            "interval_seconds": self.interval_seconds,
            "young_daly_interval_seconds": self.daly_interval_seconds,
            "young_interval_seconds": self.young_interval_seconds,
            "shortest_interval_steps": self.shortest_interval_steps,
            "expected_badput_percent": 100 * self.expected_badput,
            "badput_components_percent": {k: 100 * v for k, v in self.components.items()},
            "min_badput_percent": 100 * self.min_badput,
            "min_saving_and_rework_percent": 100 * min_saving_and_rework(i),
            "target_reachable": self.target_reachable,
            "max_interval_steps_for_target": self.max_interval_steps,
            "max_interval_seconds_for_target": (
                None if self.max_interval_steps is None
                else self.max_interval_steps * i.step_seconds
            ),
            "target_window_seconds": None if window is None else list(window),
            "unreachable_reason": explain_unreachable(self),
            "simple_bound_max_interval_steps": self.simple_bound_steps,
            "half_interval_steps": self.half_interval_steps,
            "badput_percent_at_half_interval": 100 * self.badput_at_half_interval,
            "double_interval_steps": self.double_interval_steps,
            "badput_percent_at_double_interval": 100 * self.badput_at_double_interval,
            "inputs": {
                "mtbi_hours": i.mtbi_hours,
                "mtbi_seconds": i.mtbi_seconds,
                "step_seconds": i.step_seconds,
                "blocking_seconds": i.blocking_seconds,
                "commit_latency_seconds": i.commit_latency_seconds,
                "restart_seconds": i.restart_seconds,
                "badput_target_percent": i.badput_target_percent,
            },
        }


def make_plan(inputs: Inputs) -> Plan:
    """Check the inputs (PlanInputError if out of range) and compute the plan."""
    inputs.check()
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
    )


def explain_unreachable(plan: Plan, lang: str = "en") -> str | None:
    """Why no interval meets the target and what would help; None when one does."""
    if plan.target_reachable:
        return None
    i, c = plan.inputs, plan.components
    text = TEXT[lang]
    window = plan.target_window_seconds
    if window is None:
        return text["unreachable_floor"].format(
            min=100 * plan.min_badput,
            restart=100 * c["restart"],
            commit=100 * c["commit_latency"],
            floor=100 * min_saving_and_rework(i),
        )
    shortest = plan.shortest_interval_steps
    if window[1] < shortest * i.step_seconds:
        return text["unreachable_short"].format(
            hi=window[1], steps=shortest, seconds=shortest * i.step_seconds
        )
    return text["unreachable_grain"].format(lo=window[0], hi=window[1], step=i.step_seconds)


# Why the source article's simplified bound underestimates the cost of saving often.
SIMPLE_BOUND_NOTE = ("it charges one save per interruption instead of one per interval, so it "
                     "never counts what saving often costs and only caps the interval from above")


def format_plan(plan: Plan) -> str:
    """The plan as a few lines for people."""
    i, c = plan.inputs, plan.components
    lines = [
        "Checkpoint plan",
        (
            f"  inputs: M = {i.mtbi_hours:g} h ({i.mtbi_seconds:g} s), T = {i.step_seconds:g} s, "
            f"δ = {i.blocking_seconds:g} s, L = {i.commit_latency_seconds:g} s, "
            f"R = {i.restart_seconds:g} s, target = {i.badput_target_percent:g} %"
        ),
        (
            f"  recommended interval: {plan.interval_steps} steps = {plan.interval_seconds:.1f} s "
            f"({plan.interval_seconds / 60:.1f} min); "
            f"Daly τ* = {plan.daly_interval_seconds:.1f} s, "
            f"Young √(2δM) = {plan.young_interval_seconds:.1f} s"
        ),
        f"  expected badput: {100 * plan.expected_badput:.2f} %",
        f"    saving (blocked)    δ/(τ+δ)    {100 * c['saving']:6.2f} %",
        f"    rework              (τ+δ)/2M   {100 * c['rework']:6.2f} %",
        f"    commit latency      L/M        {100 * c['commit_latency']:6.2f} %",
        f"    restart             R/M        {100 * c['restart']:6.2f} %",
        f"  no interval does better than {100 * plan.min_badput:.2f} %",
    ]
    if plan.max_interval_steps is not None:
        n = plan.max_interval_steps
        lines.append(
            f"  largest interval that meets the {i.badput_target_percent:g} % target: "
            f"{n} steps = {n * i.step_seconds:.1f} s"
        )
    else:
        lines.append(f"  the {i.badput_target_percent:g} % target cannot be met. "
                     + explain_unreachable(plan))
    bound = plan.simple_bound_steps
    lines.append(
        "  simplified bound N <= 2(target·M - δ)/T: "
        + (f"{bound} steps" if bound is not None else "no interval (below one step)")
        + f"; {SIMPLE_BOUND_NOTE}"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------- metrics ----


class MetricsError(ValueError):
    """metrics.jsonl is missing or holds too little to plan from."""


@dataclass(frozen=True)
class Measured:
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


def read_metrics(path: str | os.PathLike) -> Measured:
    """Medians of step time, save blocking time and commit latency from metrics.jsonl.

    The first save after each start is a warm-up (a process save starts its
    writer process then) and is left out while other saves remain.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise MetricsError(f"{path}: no such file (training writes it to <log.dir>/metrics.jsonl)")
    step_times: list[float] = []
    saves: list[tuple[str, float, float, bool]] = []  # reason, blocking, latency, warm-up
    skipped = 0
    first_save_of_run = True
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                kind = record.get("event")
            except (json.JSONDecodeError, AttributeError):
                skipped += 1  # e.g. a line cut short when the job was killed
                continue
            if kind == "start":
                first_save_of_run = True
            elif kind == "step" and _is_number(record.get("step_time_s")):
                step_times.append(float(record["step_time_s"]))
            elif kind == "save":
                blocking, latency = record.get("blocking_s"), record.get("commit_latency_s")
                if not (_is_number(blocking) and _is_number(latency)):
                    skipped += 1
                    continue
                saves.append((str(record.get("reason")), float(blocking), float(latency),
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
    )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plan_from_metrics(
    path: str | os.PathLike, *, mtbi_hours: float, restart_seconds: float,
    badput_target_percent: float,
) -> tuple[Plan, Measured]:
    """The plan with T, δ and L as training measured them."""
    measured = read_metrics(path)
    inputs = Inputs(
        mtbi_hours=mtbi_hours,
        step_seconds=measured.step_seconds,
        blocking_seconds=measured.blocking_seconds,
        commit_latency_seconds=measured.commit_latency_seconds,
        restart_seconds=restart_seconds,
        badput_target_percent=badput_target_percent,
    )
    return make_plan(inputs), measured


# ---------------------------------------------------- measured section ----

TEXT = {
    "en": {
        "title": "Measured in `{path}`",
        "header": "| Quantity | Symbol | Planned | Measured (median) | Samples |",
        "step": "Step time",
        "blocking": "Blocking time of one save",
        "latency": "Commit latency",
        "steps": "{n} steps",
        "saves": "{n} saves",
        "unknown": "–",
        "reason_all": "There were no interval saves, so all saves were used.",
        "warmup": "Left out: {n} warm-up save(s), the first after each start "
                  "(a background save starts its writer then).",
        "warmup_only": "Every save recorded was a warm-up save (the first after a start); they are "
                       "slower than usual, so these numbers overstate the save time.",
        "raised": "The median commit latency came out below the median blocking time; "
                  "L is taken equal to δ.",
        "skipped": "Skipped {n} unreadable line(s).",
        "with": "With the measured numbers "
                "(M = {mtbi:g} h, R = {restart:g} s, target = {target:g} %):",
        "recommended": "- Recommended interval: **{n} steps** = {s:.1f} s ({m:.1f} min); expected "
                       "badput **{b:.2f} %** (saving {sv:.2f} %, rework {rw:.2f} %, commit "
                       "latency {cl:.2f} %, restart {rs:.2f} %).",
        "max": "- Largest interval that meets the target: {n} steps = {s:.1f} s.",
        "max_none": "- The target cannot be met. {reason}",
        "bound": "- Simplified bound 2(target·M − δ)/T: {bound}.",
        "bound_none": "no interval (below one step)",
        "bound_steps": "{n} steps",
        "configured": "- Interval now in `configs/train.yaml`: {n} steps, expected badput "
                      "{b:.2f} % at the measured numbers.",
        "change": " To use the recommendation: `checkpoint.interval_steps: {n}`.",
        "same": " That is the recommendation.",
        "unreachable_floor": "No interval gets expected badput below {min:.2f} %: restart alone "
                             "costs R/M = {restart:.2f} %, commit latency L/M = {commit:.2f} %, "
                             "and saving plus rework together at least √(2δ/M) = {floor:.2f} %. To "
                             "meet it, accept at least {min:.2f} %, restart faster, make saves "
                             "block less and commit sooner (async saves, faster storage), or run "
                             "where interruptions are rarer.",
        "unreachable_short": "Only intervals up to {hi:.1f} s meet it, and the shortest allowed "
                             "interval is {steps} step(s) = {seconds:.1f} s (a new save never "
                             "starts before the previous one can have committed). Commit sooner "
                             "or accept a higher target.",
        "unreachable_grain": "Only intervals between {lo:.1f} s and {hi:.1f} s meet it, and no "
                             "whole number of {step:g} s steps falls in between. Accept a "
                             "slightly higher target.",
    },
    "zh": {
        "title": "实测数据，来自 `{path}`",
        "header": "| 量 | 符号 | 计划值 | 实测中位数 | 样本数 |",
        "step": "单步耗时",
        "blocking": "单次保存阻塞训练的时间",
        "latency": "提交延迟",
        "steps": "{n} 步",
        "saves": "{n} 次保存",
        "unknown": "–",
        "reason_all": "日志里没有按间隔触发的保存，因此用了全部保存记录。",
        "warmup": "已剔除 {n} 次预热保存：每次启动后的第一次保存要先拉起后台写盘进程，比平常慢。",
        "warmup_only": "记录到的保存全是启动后的第一次（预热）保存，耗时偏高，"
                       "据此算出的保存时间会偏大。",
        "raised": "提交延迟的中位数小于阻塞时间的中位数，按 L = δ 处理。",
        "skipped": "跳过了 {n} 行无法解析的记录。",
        "with": "按实测数据重新计算"
                "（M = {mtbi:g} 小时，R = {restart:g} 秒，目标 = {target:g} %）：",
        "recommended": "- 建议间隔：**{n} 步** = {s:.1f} 秒（{m:.1f} 分钟）；预期 badput "
                       "**{b:.2f} %**（保存阻塞 {sv:.2f} %，回退重算 {rw:.2f} %，提交延迟 "
                       "{cl:.2f} %，重启 {rs:.2f} %）。",
        "max": "- 满足目标的最大间隔：{n} 步 = {s:.1f} 秒。",
        "max_none": "- 目标无法达到。{reason}",
        "bound": "- 简化上界 2(target·M − δ)/T：{bound}。",
        "bound_none": "没有可用间隔（不足一步）",
        "bound_steps": "{n} 步",
        "configured": "- `configs/train.yaml` 当前间隔：{n} 步，按实测数据预期 badput {b:.2f} %。",
        "change": "如要采用建议值：`checkpoint.interval_steps: {n}`。",
        "same": "与建议值一致。",
        "unreachable_floor": "无论间隔取多少，预期 badput 都不会低于 {min:.2f} %：单是重启就占 "
                             "R/M = {restart:.2f} %，提交延迟占 L/M = {commit:.2f} %，保存阻塞与"
                             "回退重算合计至少 √(2δ/M) = {floor:.2f} %。想达标，可以把目标放宽到 "
                             "{min:.2f} % 以上、缩短重启时间、让保存少阻塞并更快提交（异步保存、"
                             "更快的存储），或换到中断更少的机器上运行。",
        "unreachable_short": "只有不超过 {hi:.1f} 秒的间隔能达标，而允许的最短间隔是 {steps} 步 = "
                             "{seconds:.1f} 秒（上一次保存提交之前不会开始新的保存）。"
                             "请缩短提交延迟或放宽目标。",
        "unreachable_grain": "只有 {lo:.1f} 秒到 {hi:.1f} 秒之间的间隔能达标，但单步 {step:g} 秒，"
                             "没有整数步数落在这个区间内。把目标稍微放宽即可。",
    },
}


def render_measured_section(
    plan: Plan, measured: Measured, planned: Inputs | None = None,
    configured_interval_steps: int | None = None, lang: str = "en",
) -> str:
    """The checklist's measured section (Markdown) in English ("en") or Chinese ("zh")."""
    text = TEXT[lang]
    i, c = plan.inputs, plan.components

    def planned_value(value: float | None) -> str:
        return text["unknown"] if value is None else f"{value:g} s"

    rows = [
        (text["step"], "T", planned.step_seconds if planned else None, measured.step_seconds,
         text["steps"].format(n=measured.step_count)),
        (text["blocking"], "δ", planned.blocking_seconds if planned else None,
         measured.blocking_seconds, text["saves"].format(n=measured.save_count)),
        (text["latency"], "L", planned.commit_latency_seconds if planned else None,
         measured.commit_latency_seconds, text["saves"].format(n=measured.save_count)),
    ]
    lines = [f"**{text['title'].format(path=measured.path)}**", "", text["header"],
             "|---|---|---|---|---|"]
    for name, symbol, planned_s, measured_s, samples in rows:
        lines.append(f"| {name} | `{symbol}` | {planned_value(planned_s)} | {measured_s:.3g} s | "
                     f"{samples} |")
    notes = []
    if measured.save_reason == "all":
        notes.append(text["reason_all"])
    if measured.warmup_excluded:
        notes.append(text["warmup"].format(n=measured.warmup_excluded))
    if measured.warmup_only:
        notes.append(text["warmup_only"])
    if measured.latency_raised:
        notes.append(text["raised"])
    if measured.skipped_lines:
        notes.append(text["skipped"].format(n=measured.skipped_lines))
    if notes:
        lines += ["", " ".join(notes)]
    lines += [
        "",
        text["with"].format(mtbi=i.mtbi_hours, restart=i.restart_seconds,
                            target=i.badput_target_percent),
        "",
        text["recommended"].format(
            n=plan.interval_steps, s=plan.interval_seconds, m=plan.interval_seconds / 60,
            b=100 * plan.expected_badput, sv=100 * c["saving"], rw=100 * c["rework"],
            cl=100 * c["commit_latency"], rs=100 * c["restart"],
        ),
    ]
    if plan.max_interval_steps is not None:
        lines.append(text["max"].format(n=plan.max_interval_steps,
                                        s=plan.max_interval_steps * i.step_seconds))
    else:
        lines.append(text["max_none"].format(reason=explain_unreachable(plan, lang)))
    bound = plan.simple_bound_steps
    lines.append(text["bound"].format(
        bound=text["bound_none"] if bound is None else text["bound_steps"].format(n=bound)))
    if configured_interval_steps is not None:
        same = configured_interval_steps == plan.interval_steps
        lines.append(
            text["configured"].format(
                n=configured_interval_steps,
                b=100 * badput(configured_interval_steps * i.step_seconds, i))
            + (text["same"] if same else text["change"].format(n=plan.interval_steps))
        )
    return "\n".join(lines) + "\n"


def replace_measured_section(document: str, section: str) -> str:
    """Swap what lies between the measured markers; everything else stays as it was."""
    begins = list(BEGIN_MARKER_RE.finditer(document))
    ends = [m.start() for m in re.finditer(re.escape(END_MARKER), document)]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0].end():
        raise ValueError("expected one '<!-- measured:begin -->' line followed by one "
                         f"'{END_MARKER}' line")
    return document[: begins[0].end()] + "\n" + section + document[ends[0]:]


def checklist_language(document: str) -> str:
    match = BEGIN_MARKER_RE.search(document)
    lang = (match and match.group("lang")) or "en"
    return lang if lang in TEXT else "en"


def write_atomically(path: Path, content: str) -> None:
    """Write to a temporary file beside `path`, then rename over it: never half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -------------------------------------------------------------------- plot ----


class PlotUnavailable(RuntimeError):
    pass


def plot_badput(plan: Plan, path: str | os.PathLike) -> None:
    """Write B against the interval, with the recommendation and the target marked (PNG or SVG)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib") from exc

    i = plan.inputs
    lowest = plan.shortest_interval_steps
    highest = max(4 * plan.interval_steps, lowest + 10,
                  2 * (plan.max_interval_steps or 0), plan.simple_bound_steps or 0)
    # Log-spaced integer intervals: the curve spans orders of magnitude in N.
    count = 400
    ratio = (highest / lowest) ** (1 / (count - 1))
    steps = sorted({round(lowest * ratio**k) for k in range(count)} | {plan.interval_steps})
    curves = {"total": [], "saving": [], "interruptions": []}
    for n in steps:
        parts = badput_components(n * i.step_seconds, i)
        curves["total"].append(100 * badput(n * i.step_seconds, i))
        curves["saving"].append(100 * parts["saving"])
        curves["interruptions"].append(100 * (parts["rework"] + parts["commit_latency"]
                                              + parts["restart"]))

    fig = Figure(figsize=(7.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, curves["total"], color="black", label="expected badput B(N·T)")
    ax.plot(steps, curves["saving"], "--", color="tab:blue", label="saving δ/(τ+δ)")
    ax.plot(steps, curves["interruptions"], ":", color="tab:orange",
            label="interruptions (R + (τ+δ)/2 + L)/M")
    ax.axhline(i.badput_target_percent, color="tab:red", linewidth=0.8,
               label=f"target {i.badput_target_percent:g} %")
    ax.plot([plan.interval_steps], [100 * plan.expected_badput], "o", color="tab:green",
            label=f"recommended: {plan.interval_steps} steps, {100 * plan.expected_badput:.2f} %")
    if plan.max_interval_steps is not None:
        n = plan.max_interval_steps
        ax.plot([n], [100 * badput(n * i.step_seconds, i)], "s", color="tab:red",
                label=f"largest meeting target: {n} steps")
    if plan.simple_bound_steps is not None:
        ax.axvline(plan.simple_bound_steps, color="grey", linestyle="-.", linewidth=0.8,
                   label=f"simplified bound: {plan.simple_bound_steps} steps")
    ax.set_xscale("log")
    top = max(3 * i.badput_target_percent, 3 * 100 * plan.expected_badput)
    ax.set_ylim(0, min(100.0, top))
    ax.set_xlabel(f"checkpoint interval N (steps of {i.step_seconds:g} s)")
    ax.set_ylabel("badput (% of machine time)")
    ax.set_title(f"M = {i.mtbi_hours:g} h, δ = {i.blocking_seconds:g} s, "
                 f"L = {i.commit_latency_seconds:g} s, R = {i.restart_seconds:g} s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120, bbox_inches="tight")


# -------------------------------------------------------------- config ----

# Inputs field -> (command-line flag, key in the config's `plan:` section)
FLAGS = {
    "mtbi_hours": ("--mtbi-hours", "mtbi_hours"),
    "step_seconds": ("--step-seconds", "step_time_seconds"),
    "blocking_seconds": ("--blocking-seconds", "checkpoint_save_seconds"),
    # Before anything is measured one save time stands for both δ and L.
    "commit_latency_seconds": ("--commit-latency-seconds", "checkpoint_save_seconds"),
    "restart_seconds": ("--restart-seconds", "restart_seconds"),
    "badput_target_percent": ("--badput-target-percent", "badput_target_percent"),
}


MEASURED_FIELDS = ("step_seconds", "blocking_seconds", "commit_latency_seconds")


@dataclass(frozen=True)
class ConfigValues:
    path: str
    plan: dict
    interval_steps: int | None


def load_config(path: str | os.PathLike) -> ConfigValues:
    """The `plan:` section and checkpoint.interval_steps of a train.yaml."""
    try:
        from omegaconf import OmegaConf
    except ImportError as exc:  # a dependency of this project; only a bare copy of plan.py lacks it
        raise ConfigError("reading a config needs omegaconf: pip install omegaconf") from exc
    try:
        cfg = OmegaConf.load(path)
        plan = OmegaConf.select(cfg, "plan", default=None)
        plan = {} if plan is None else OmegaConf.to_container(plan, resolve=True)
        interval = OmegaConf.select(cfg, "checkpoint.interval_steps", default=None)
    except Exception as exc:  # omegaconf raises many types; all mean "cannot use this file"
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(plan, dict):
        raise ConfigError(f"{path}: `plan:` must be a mapping")
    return ConfigValues(path=str(path), plan=plan,
                        interval_steps=interval if isinstance(interval, int) else None)


# ------------------------------------------------------------- command line ----


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}.plan" if __package__ else "plan",
        description="Plan the checkpoint interval from the time between interruptions, the step "
        "time and the save time, and show the expected badput. Inputs not given as flags come "
        "from measured metrics (--metrics: T, δ, L) or from the config's `plan:` section.",
    )
    num = {"type": float, "default": None}
    parser.add_argument("--mtbi-hours", metavar="H", **num,
                        help="mean time between interruptions, hours")
    parser.add_argument("--step-seconds", metavar="T", **num, help="time of one optimizer step")
    parser.add_argument("--blocking-seconds", metavar="D", **num,
                        help="time one save blocks training (δ)")
    parser.add_argument("--commit-latency-seconds", metavar="L", **num,
                        help="from save start until it is committed (L >= δ; "
                             "sync saves: L = δ; default: δ)")
    parser.add_argument("--restart-seconds", metavar="R", **num,
                        help="from an interruption until training runs again")
    parser.add_argument("--badput-target-percent", metavar="P", **num,
                        help="share of machine time you accept losing, percent (0-100)")
    parser.add_argument("--metrics", metavar="FILE",
                        help="metrics.jsonl (or its folder) from training: T, δ and L are its "
                             "medians")
    parser.add_argument("--config", metavar="PATH",
                        help="config with a `plan:` section "
                             f"(default: {DEFAULT_CONFIG} if present)")
    parser.add_argument("--write", metavar="CHECKLIST",
                        help="refresh the measured section of this checklist in place "
                             "(needs --metrics), e.g. docs/CHECKLIST.md")
    parser.add_argument("--plot", metavar="FILE",
                        help="write a plot of badput against the interval (.png or .svg)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.write and not args.metrics:
        parser.error("--write needs --metrics: it records what training measured")
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        parser.error(f"argument --plot: the file name must end in .png or .svg (got {args.plot})")

    config = None
    config_path = Path(args.config) if args.config else DEFAULT_CONFIG
    if args.config and not config_path.is_file():
        parser.error(f"argument --config: no such file: {config_path}")
    if config_path.is_file():
        try:
            config = load_config(config_path)
        except ValueError as exc:
            parser.error(f"argument --config: {exc}")

    measured = None
    if args.metrics:
        try:
            measured = read_metrics(args.metrics)
        except (MetricsError, OSError) as exc:
            parser.error(f"argument --metrics: {exc}")

    values, origins = resolve_inputs(args, config, measured, parser)
    inputs = Inputs(**values)
    try:
        plan = make_plan(inputs)
    except PlanInputError as exc:
        flag = FLAGS[exc.field][0]
        parser.error(f"argument {flag}: {exc.message}"
                     + ("" if origins[exc.field] == flag else f" (from {origins[exc.field]})"))

    # What the config planned with, shown beside the measurements (display only).
    planned = None
    if config is not None and all(_is_number(config.plan.get(key)) for _, key in FLAGS.values()):
        planned = Inputs(**{field: config.plan[key] for field, (_, key) in FLAGS.items()})
    configured = config.interval_steps if config else None
    if configured is not None and configured < 1:
        configured = None

    if args.json:
        payload = plan.to_json()
        if measured is not None:
            payload["measured"] = dataclasses.asdict(measured)
            payload["planned"] = None if planned is None else dataclasses.asdict(planned)
            payload["configured_interval_steps"] = configured
            payload["configured_badput_percent"] = (
                None if configured is None
                else 100 * badput(configured * inputs.step_seconds, inputs))
        print(json.dumps(payload, ensure_ascii=False))
    else:
        print(format_plan(plan))
        if measured is not None:
            print()
            print(render_measured_section(plan, measured, planned, configured), end="")

    if args.plot:
        try:
            plot_badput(plan, args.plot)
        except PlotUnavailable as exc:
            print(f"plan: {exc}", file=sys.stderr)
            return 1
        print(f"plan: wrote {args.plot}", file=sys.stderr)
    if args.write:
        target = Path(args.write)
        try:
            document = target.read_text(encoding="utf-8")
            lang = checklist_language(document)
            section = render_measured_section(plan, measured, planned, configured, lang)
            write_atomically(target, replace_measured_section(document, section))
        except (OSError, ValueError) as exc:
            parser.error(f"argument --write: {target}: {exc}")
        print(f"plan: refreshed the measured section of {target}", file=sys.stderr)
    return 0


def resolve_inputs(args, config, measured, parser):
    """Each input from its flag, else from the measurements, else from the config."""
    values, origins = {}, {}
    for field, (flag, key) in FLAGS.items():
        flag_value = getattr(args, field)  # argparse dest == Inputs field name
        if flag_value is not None:
            values[field], origins[field] = flag_value, flag
        elif measured is not None and field in MEASURED_FIELDS:
            values[field], origins[field] = getattr(measured, field), f"--metrics {measured.path}"
        elif field == "commit_latency_seconds" and origins.get("blocking_seconds") == \
                FLAGS["blocking_seconds"][0]:
            # δ given by hand and L not: treat it as a synchronous save (L = δ).
            values[field], origins[field] = values["blocking_seconds"], "--blocking-seconds"
        elif config is not None and key in config.plan:
            values[field], origins[field] = config.plan[key], f"plan.{key} in {config.path}"
        else:
            where = f"no plan.{key} in {config.path}" if config else f"no {DEFAULT_CONFIG} here"
            parser.error(f"missing {flag} ({where}; pass the flag or --config PATH)")
    return values, origins


if __name__ == "__main__":
    sys.exit(main())
