"""What a checkpoint interval plan says: text for people (``format_plan``, ``format_two_tier``),
JSON for tools (``to_json``, ``two_tier_json``: `plan --json`), and the Markdown measured
section of docs/CHECKLIST.md with the helpers that refresh it in place (``plan --write``).
The numbers come from interval.formulas, the words of the checklist from interval.text."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from .formulas import Plan, TwoTierPlan, badput, min_saving_and_rework
from .inputs import Inputs, Measured
from .text import TEXT

END_MARKER = "<!-- measured:end -->"
# The begin marker names the checklist's language: --write refreshes the section in it.
BEGIN_MARKER_RE = re.compile(r"<!-- measured:begin(?: lang=(?P<lang>[a-z]+))? -->")


def explain_unreachable(plan: Plan, lang: str = "en") -> str | None:
    """Why no interval meets the target and what would help; None when one does."""
    if plan.target_reachable:
        return None
    i, c, text = plan.inputs, plan.components, TEXT[lang]
    window = plan.target_window_seconds
    if window is None:
        return text["unreachable_floor"].format(
            min=100 * plan.min_badput, restart=100 * c["restart"],
            commit=100 * c["commit_latency"], floor=100 * min_saving_and_rework(i))
    shortest = plan.shortest_interval_steps
    if window[1] < shortest * i.step_seconds:
        return text["unreachable_short"].format(
            hi=window[1], steps=shortest, seconds=shortest * i.step_seconds)
    return text["unreachable_grain"].format(lo=window[0], hi=window[1], step=i.step_seconds)


def format_plan(plan: Plan) -> str:
    i, c = plan.inputs, plan.components
    lines = [
        "Checkpoint plan",
        (f"  inputs: M = {mtbi_text(i)}, T = {i.step_seconds:g} s, "
         f"δ = {i.blocking_seconds:g} s, L = {i.commit_latency_seconds:g} s, "
         f"R = {i.restart_seconds:g} s, target = {i.badput_target_percent:g} %"),
        (f"  recommended interval: {plan.interval_steps} steps = {plan.interval_seconds:.1f} s "
         f"({plan.interval_seconds / 60:.1f} min); "
         f"Daly τ* = {plan.daly_interval_seconds:.1f} s, "
         f"Young √(2δM) = {plan.young_interval_seconds:.1f} s"),
        f"  expected badput: {100 * plan.expected_badput:.2f} %",
        f"    saving (blocked)    δ/(τ+δ)    {100 * c['saving']:6.2f} %",
        f"    rework              (τ+δ)/2M   {100 * c['rework']:6.2f} %",
        f"    commit latency      L/M        {100 * c['commit_latency']:6.2f} %",
        f"    restart             R/M        {100 * c['restart']:6.2f} %",
        f"  no interval does better than {100 * plan.min_badput:.2f} %",
        "  " + in_place_line(plan),
    ]
    if plan.max_interval_steps is not None:
        n = plan.max_interval_steps
        lines.append(f"  largest interval that meets the {i.badput_target_percent:g} % target: "
                     f"{n} steps = {n * i.step_seconds:.1f} s")
    else:
        lines.append(f"  the {i.badput_target_percent:g} % target cannot be met. "
                     + explain_unreachable(plan))
    bound = plan.simple_bound_steps
    lines.append("  simplified bound N <= 2(target·M - δ)/T: "
                 + (f"{bound} steps" if bound is not None else "no interval (below one step)")
                 + "; it charges one save per interruption instead of one per interval, so it "
                 "never counts what saving often costs and only caps the interval from above")
    return "\n".join(lines)


def mtbi_text(i: Inputs, lang: str = "en") -> str:
    """The job's MTBI and where it comes from: one node's MTBI and the node count."""
    text = TEXT[lang]
    job = text["mtbi"].format(hours=i.job_mtbi_hours, seconds=i.mtbi_seconds)
    nodes = "" if i.nodes == 1 else text["mtbi_nodes"].format(node=i.mtbi_hours, nodes=i.nodes)
    return job + nodes


def in_place_line(plan: Plan, lang: str = "en") -> str:
    """In-place restarts (R_in) next to a reschedule (R), and the badput they save."""
    i, text = plan.inputs, TEXT[lang]
    if plan.in_place_saving is None:
        return text["in_place_none"].format(r=i.restart_seconds, c=i.crash_share)
    return text["in_place"].format(
        rin=plan.in_place_restart_seconds, r=i.restart_seconds, c=i.crash_share,
        mtbi=i.job_mtbi_hours, s=100 * plan.in_place_saving, b=100 * plan.expected_badput,
        bin=100 * plan.expected_badput_with_in_place)


def percent(x: float | None) -> float | None:
    return None if x is None else 100 * x


def to_json(plan: Plan) -> dict:
    """The plan as plain data: what `plan --json` prints."""
    i = plan.inputs
    window = plan.target_window_seconds
    return {
        "interval_steps": plan.interval_steps,
        "interval_seconds": plan.interval_seconds,
        "young_daly_interval_seconds": plan.daly_interval_seconds,
        "young_interval_seconds": plan.young_interval_seconds,
        "shortest_interval_steps": plan.shortest_interval_steps,
        "expected_badput_percent": 100 * plan.expected_badput,
        "badput_components_percent": {k: 100 * v for k, v in plan.components.items()},
        "min_badput_percent": 100 * plan.min_badput,
        "min_saving_and_rework_percent": 100 * min_saving_and_rework(i),
        "target_reachable": plan.target_reachable,
        "max_interval_steps_for_target": plan.max_interval_steps,
        "max_interval_seconds_for_target": (None if plan.max_interval_steps is None
                                            else plan.max_interval_steps * i.step_seconds),
        "target_window_seconds": None if window is None else list(window),
        "unreachable_reason": explain_unreachable(plan),
        "simple_bound_max_interval_steps": plan.simple_bound_steps,
        "half_interval_steps": plan.half_interval_steps,
        "badput_percent_at_half_interval": 100 * plan.badput_at_half_interval,
        "double_interval_steps": plan.double_interval_steps,
        "badput_percent_at_double_interval": 100 * plan.badput_at_double_interval,
        "in_place_restart_seconds": plan.in_place_restart_seconds,
        "in_place_saving_percent": percent(plan.in_place_saving),
        "expected_badput_with_in_place_percent": percent(plan.expected_badput_with_in_place),
        "inputs": {
            "mtbi_hours": i.mtbi_hours,          # one node's
            "nodes": i.nodes,
            "job_mtbi_hours": i.job_mtbi_hours,  # M, what the formulas use
            "mtbi_seconds": i.mtbi_seconds,      # M in seconds
            "step_seconds": i.step_seconds,
            "blocking_seconds": i.blocking_seconds,
            "commit_latency_seconds": i.commit_latency_seconds,
            "restart_seconds": i.restart_seconds,
            "badput_target_percent": i.badput_target_percent,
            "crash_share": i.crash_share,
            "node_loss_share": i.node_loss_share,
        },
    }


KEEPS = {"node_memory": "the node's memory copy", "partner_copy": "the partner's copy",
         "durable": "the durable save"}


def format_two_tier(two: TwoTierPlan) -> str:
    p = two.plan
    i, step = p.inputs, p.inputs.step_seconds
    r_in = ("(measured or given)" if p.in_place_restart_seconds is not None
            else "(= R: not measured)")
    dm = "(= δ: one copy into host memory)" if i.memory_blocking_seconds is None else "(given)"
    lines = [
        "Two tiers: memory and durable (checkpoint.memory_interval_steps)",
        (f"  inputs: δ_m = {i.memory_blocking:g} s {dm}, L_m = {i.memory_commit_latency:g} s "
         f"(δ_m + {i.memory_send_seconds:g} s to the partner), R_in = "
         f"{two.in_place_restart_seconds:g} s {r_in}, crash c = {i.crash_share:g}, "
         f"node loss ν = {i.node_loss_share:g}, the memory tier covers a = "
         f"{two.memory_share:g}" + ("" if i.nodes >= 2 else " (one node: no partner)")),
        (f"  without the memory tier: B1 = {100 * two.badput_without:.2f} % (durable every "
         f"{p.interval_steps} steps; every interruption back to the durable save)"),
    ]
    if two.optimal_memory_interval_steps is None:
        lines.append("  with the memory tier: it covers no interruption here (a = 0)")
    else:
        n_m, n_d = two.optimal_memory_interval_steps, two.optimal_durable_interval_steps
        lines.append(f"  with the memory tier at its optimum: memory every {n_m} steps = "
                     f"{n_m * step:.1f} s, durable every {n_d} steps = {n_d * step:.1f} s: "
                     f"B2 = {100 * two.badput_with:.2f} %")
    if two.configured_badput is not None:
        lines.append(f"  at the configured memory interval, {two.configured_memory_interval_steps}"
                     f" steps (durable every {two.configured_durable_interval_steps} steps): "
                     f"B2 = {100 * two.configured_badput:.2f} %")
    if two.pays:
        lines.append(f"  recommended: checkpoint.memory_interval_steps: "
                     f"{two.recommended_memory_interval_steps}, checkpoint.interval_steps: "
                     f"{two.recommended_durable_interval_steps}")
    else:
        even = two.break_even_memory_blocking_seconds
        lines.append("  recommended: checkpoint.memory_interval_steps: 0 (off): the memory tier "
                     "does not lower badput here"
                     + ("" if even is None else
                        f"; it would once a memory save blocks less than about {even:.2f} s "
                        "(first order)"))
    lines.append("  per failure kind:")
    lines.append(f"    {'kind':<20} {'share':>5}  {'resumes from':<24}  {'restart':>8}  "
                 "work lost (badput) without / with the tier")
    for k in two.failure_kinds:
        lines.append(f"    {k.kind.replace('_', ' '):<20} {k.share:5.2f}  {KEEPS[k.keeps]:<24}  "
                     f"{k.restart_seconds:6.1f} s  {k.lost_seconds_without:.1f} s "
                     f"({100 * k.badput_without:.2f} %) / {k.lost_seconds_with:.1f} s "
                     f"({100 * k.badput_with:.2f} %)")
    m = two.memory_shards
    lines.append(f"  memory per rank with the tier on: {m['own']} + {m['partner']} shards (its own "
                 "+ its partner's: two slots each, the newest copy and the one before it); "
                 "in checkpoint.memory_dir, freed when the job ends")
    return "\n".join(lines)


def two_tier_json(two: TwoTierPlan) -> dict:
    """The two-tier figures as plain data: `plan --json`'s ``two_tier``."""
    i, step = two.plan.inputs, two.plan.inputs.step_seconds
    n_m = two.optimal_memory_interval_steps
    return {
        "memory_blocking_seconds": i.memory_blocking,
        "memory_commit_latency_seconds": i.memory_commit_latency,
        "memory_send_seconds": i.memory_send_seconds,
        "in_place_restart_seconds": two.in_place_restart_seconds,
        "node_loss_share": i.node_loss_share,
        "memory_share": two.memory_share,
        "durable_share": two.durable_share,
        "badput_without_memory_percent": percent(two.badput_without),
        "memory_interval_seconds_optimal": two.memory_interval_seconds,
        "durable_interval_seconds_optimal": two.durable_interval_seconds,
        "optimal_memory_interval_steps": n_m,
        "optimal_memory_interval_seconds": None if n_m is None else n_m * step,
        "optimal_durable_interval_steps": two.optimal_durable_interval_steps,
        "optimal_durable_interval_seconds": two.optimal_durable_interval_steps * step,
        "badput_with_memory_percent": percent(two.badput_with),
        "memory_tier_pays": two.pays,
        "recommended_memory_interval_steps": two.recommended_memory_interval_steps,
        "recommended_durable_interval_steps": two.recommended_durable_interval_steps,
        "break_even_memory_blocking_seconds": two.break_even_memory_blocking_seconds,
        "configured_memory_interval_steps": two.configured_memory_interval_steps,
        "configured_durable_interval_steps": two.configured_durable_interval_steps,
        "configured_badput_percent": percent(two.configured_badput),
        "failure_kinds": [
            {"kind": k.kind, "share": k.share, "keeps": k.keeps,
             "restart_seconds": k.restart_seconds,
             "lost_seconds_without_memory": k.lost_seconds_without,
             "lost_seconds_with_memory": k.lost_seconds_with,
             "badput_percent_without_memory": 100 * k.badput_without,
             "badput_percent_with_memory": 100 * k.badput_with}
            for k in two.failure_kinds],
        "memory_shards_per_rank": dict(two.memory_shards),
    }


def render_measured_section(
    plan: Plan, measured: Measured, planned: Inputs | None = None,
    configured_interval_steps: int | None = None, lang: str = "en",
) -> str:
    """The checklist's measured section (Markdown) in English ("en") or Chinese ("zh")."""
    text = TEXT[lang]
    i, c = plan.inputs, plan.components
    saves = text["saves"].format(n=measured.save_count)
    lines = [f"**{text['title'].format(path=measured.path)}**", "", text["header"],
             "|---|---|---|---|---|"]
    for name, symbol, field, samples in (
            ("step", "T", "step_seconds", text["steps"].format(n=measured.step_count)),
            ("blocking", "δ", "blocking_seconds", saves),
            ("latency", "L", "commit_latency_seconds", saves)):
        value = text["unknown"] if planned is None else f"{getattr(planned, field):g} s"
        lines.append(f"| {text[name]} | `{symbol}` | {value} | {getattr(measured, field):.3g} s | "
                     f"{samples} |")
    # Each note is shown when its value is true; {n} in a note is that value.
    notes = [text[key].format(n=value) for key, value in (
        ("reason_all", measured.save_reason == "all"), ("warmup", measured.warmup_excluded),
        ("warmup_only", measured.warmup_only), ("raised", measured.latency_raised),
        ("skipped", measured.skipped_lines)) if value]
    if notes:
        lines += ["", " ".join(notes)]
    lines += [
        "",
        text["with"].format(mtbi=mtbi_text(i, lang), restart=i.restart_seconds,
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
        bound=text["bound_none"] if bound is None else text["steps"].format(n=bound)))
    lines.append("- " + in_place_line(plan, lang))
    if configured_interval_steps is not None:
        n = configured_interval_steps
        lines.append(text["configured"].format(n=n, b=100 * badput(n * i.step_seconds, i))
                     + (text["same"] if n == plan.interval_steps
                        else text["change"].format(n=plan.interval_steps)))
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
