"""What the interruption drill measured, and the verdict: report.json, report.md, loss.png.

All read back from the runs' ``metrics.jsonl``, however the runs were started; each field:
docs/RESUMING.md, "Reading the report".
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runtime.metrics import Event, read_events

# Another world size sums gradients in another order (about 1e-7 relative); a wrong data
# position, learning-rate step or optimizer state moves the loss by 1e-3 or more.
RESHARD_REL_TOL = 1e-4


class DrillError(RuntimeError):
    """A phase did not go as planned; the message says which and where its log is."""


@dataclass
class Run:
    """The events of one training process group, from its ``start`` event on."""

    start: dict[str, Any]
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def first_step(self) -> int | None:
        return min(self.steps) if self.steps else None

    @property
    def last_step(self) -> int:
        return max(self.steps) if self.steps else self.start.get("step", 0)

    def median(self, key: str) -> float | None:
        values = [e[key] for e in self.steps.values() if key in e]
        return statistics.median(values) if values else None


def split_runs(log_dir: Path) -> list[Run]:
    """The runs that appended to ``log_dir/metrics.jsonl``, in order (one per start event).

    A start that trained no step where the run before ended is left out: torchrun's
    restart after a worker aborted in torch's teardown (torch 2.11: "terminate called
    without an active exception") finds the run finished and is no run of its own.
    """
    runs: list[Run] = []
    for event in read_events(log_dir, Event.start, Event.step)[0]:
        if event["event"] == Event.start:
            runs.append(Run(event))
        elif runs:
            runs[-1].steps[int(event["step"])] = event
    return [run for i, run in enumerate(runs)
            if i == 0 or run.steps or run.start.get("step") != runs[i - 1].last_step]


def compare(reference: dict[int, dict], other: dict[int, dict]) -> dict[str, Any]:
    """Per-step loss and grad-norm differences of ``other`` against ``reference``."""
    rows, missing = [], []
    for step in sorted(other):
        ref = reference.get(step)
        if ref is None:
            missing.append(step)
            continue
        row = {"step": step}
        for key in ("loss", "grad_norm"):
            a, b = ref[key], other[step][key]
            row[f"reference_{key}"], row[key] = a, b
            row[f"abs_{key}_diff"] = abs(b - a)
            row[f"rel_{key}_diff"] = abs(b - a) / abs(a) if a else (0.0 if a == b else math.inf)
        rows.append(row)
    return {
        "compared_steps": [r["step"] for r in rows],
        "missing_from_reference": missing,
        **{f"max_{column}": max((r[column] for r in rows), default=None)
           for column in ("abs_loss_diff", "rel_loss_diff", "abs_grad_norm_diff",
                          "rel_grad_norm_diff")},
        "rows": rows,
    }


def judge(diffs: dict[str, Any], *, same_world: bool, expected_steps: list[int],
          problems: list[str]) -> tuple[bool, str]:
    """Passed or not, and one sentence saying why."""
    problems = list(problems)
    if diffs["compared_steps"] != expected_steps:
        problems.append(f"compared steps {_span(diffs['compared_steps'])}, expected "
                        f"{_span(expected_steps)}")
    if problems:
        return False, "; ".join(problems)
    if same_world:
        ok = diffs["max_abs_loss_diff"] == 0 and diffs["max_abs_grad_norm_diff"] == 0
        return ok, ("bit-identical to the uninterrupted run: every loss and grad norm equal"
                    if ok else
                    f"not bit-identical on the same world size: max loss difference "
                    f"{diffs['max_abs_loss_diff']:.3g}, max grad-norm difference "
                    f"{diffs['max_abs_grad_norm_diff']:.3g}")
    ok = diffs["max_rel_loss_diff"] < RESHARD_REL_TOL
    return ok, (f"max relative loss difference {diffs['max_rel_loss_diff']:.2g} "
                f"{'<' if ok else '>='} {RESHARD_REL_TOL:g} after resharding")


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps else "none"


def build(drill, kill: dict[str, Any],
          facts: Callable[[dict[str, str], dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Compare a finished drill's runs, write report.json, report.md and loss.png; ``facts``
    adds rows to report.md's table (a node loss: drill_nodes.markdown_facts)."""
    reference_runs = split_runs(drill.out / "reference" / "logs")
    runs = split_runs(drill.out / "interrupted" / "logs")
    if len(reference_runs) != 1 or len(runs) != 2:
        return failure(drill, "expected one reference run and two runs in interrupted/ (before and "
                              f"after the kill), found {len(reference_runs)} and {len(runs)}")
    reference, (before, after) = reference_runs[0], runs
    resumed_from = int(after.start["step"])
    loss = kill.get("node_loss")
    problems = list(loss["problems"]) if loss else []
    if resumed_from == 0:
        problems.append("the resumed run started from step 0: it found no checkpoint")
    if after.last_step != drill.steps:
        problems.append(f"the resumed run ended at step {after.last_step}, not {drill.steps}")
    diffs = compare(reference.steps, after.steps)
    same_world = drill.save_ranks == drill.resume_ranks
    passed, verdict = judge(diffs, same_world=same_world,
                            expected_steps=list(range(resumed_from + 1, drill.steps + 1)),
                            problems=problems)
    # The run before the kill differs from the reference only on a nondeterministic machine,
    # and then a same-world-size difference is not the resume's fault.
    determinism = compare(reference.steps, before.steps)
    if not passed and same_world and determinism["max_abs_loss_diff"]:
        verdict += ("; the two runs already differed before the kill (max "
                    f"{determinism['max_abs_loss_diff']:.3g}): this machine's kernels are "
                    "not deterministic")
    dropout = float(drill.cfg.model.get("dropout", 0) or 0)
    if not passed and not same_world and dropout > 0:
        verdict += (f"; expected with model.dropout={dropout:g}: on another world size the random "
                    "streams are reseeded, so the dropout masks differ. Drill with model.dropout=0")
    first_after = after.steps.get(after.first_step) if after.steps else None
    report = {
        "passed": passed,
        "verdict": verdict,
        "save_world_size": drill.save_ranks,
        "resume_world_size": drill.resume_ranks,
        "steps": drill.steps,
        "interval_steps": drill.interval,
        "interrupt_after_checkpoint": drill.interrupt_at,
        "interrupted_at_step": before.last_step,
        "resumed_from_step": resumed_from,
        "steps_redone": before.last_step - resumed_from,
        "processes_killed": kill["processes_killed"],
        "save_nodes": drill.save_nodes,
        "kill": drill.kill,
        "node_loss": loss,
        "global_batch_size": drill.cfg.train.global_batch_size,
        "saved_grad_accum_steps": before.start.get("grad_accum_steps"),
        "resume_grad_accum_steps": after.start.get("grad_accum_steps"),
        "dropout": dropout,
        **{key: diffs[key] for key in ("max_abs_loss_diff", "max_rel_loss_diff",
                                       "max_abs_grad_norm_diff", "max_rel_grad_norm_diff")},
        "tolerance": 0.0 if same_world else RESHARD_REL_TOL,
        "before_kill_max_abs_loss_diff": determinism["max_abs_loss_diff"],
        "resume_seconds": (first_after["time"] - kill["killed_at"]) if first_after else None,
        "resume_to_start_seconds": after.start["time"] - kill["killed_at"],
        "samples_per_s_before": before.median("samples_per_s"),
        "samples_per_s_after": after.median("samples_per_s"),
        "compared_steps": diffs["compared_steps"],
        "per_step": diffs["rows"],
        "wall_seconds": round(time.monotonic() - drill.started, 1),
        "commands": _shell_commands(drill),
    }
    report["plot"] = plot(drill.out / "loss.png", reference, before, after, report)
    write_report(drill.out, report, render_markdown(report, facts))
    return report


def failure(drill, error: str) -> dict[str, Any]:
    """The report of a drill that could not finish."""
    report = {"passed": False, "verdict": error, "error": error,
              "save_world_size": drill.save_ranks, "resume_world_size": drill.resume_ranks,
              "wall_seconds": round(time.monotonic() - drill.started, 1),
              "commands": _shell_commands(drill)}
    text = (f"# Interruption drill: {drill.save_ranks} → {drill.resume_ranks} rank(s)\n\n"
            f"**FAILED** — {error}\n\n" + _commands_md(report))
    write_report(drill.out, report, text)
    return report


def _shell_commands(drill) -> dict[str, str]:
    return {name: shlex.join(cmd) for name, cmd in drill.commands.items()}


def write_report(out: Path, report: dict[str, Any], markdown: str) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out / "report.md").write_text(markdown, encoding="utf-8")


def num(value: float | None, spec: str = ".3g") -> str:
    return "n/a" if value is None else format(value, spec)


def render_markdown(r: dict[str, Any],
                    more: Callable[[dict[str, str], dict[str, Any]], None] | None = None) -> str:
    same = r["save_world_size"] == r["resume_world_size"]
    criterion = ("bit-identical losses and grad norms (same world size)" if same else
                 f"relative loss difference below {RESHARD_REL_TOL:g} (another world size)")
    facts = {
        "killed (SIGKILL)": f"at step {r['interrupted_at_step']}, {r['processes_killed']} "
                            "processes: torchrun, workers, checkpoint writers",
        "resumed from": f"the checkpoint of step {r['resumed_from_step']} "
                        f"(steps redone: {r['steps_redone']})",
        "gradient accumulation": f"{r['saved_grad_accum_steps']} on {r['save_world_size']} rank(s) "
                                 f"→ {r['resume_grad_accum_steps']} on {r['resume_world_size']} "
                                 f"(global batch {r['global_batch_size']}, unchanged)",
        "resume time": f"{num(r['resume_seconds'], '.1f')} s from the kill to the first step "
                       f"after it ({num(r['resume_to_start_seconds'], '.1f')} s to the start)",
        "throughput (median)": f"{num(r['samples_per_s_before'], ',.1f')} samples/s before, "
                               f"{num(r['samples_per_s_after'], ',.1f')} after",
        "max loss difference": f"{num(r['max_abs_loss_diff'])} absolute, "
                               f"{num(r['max_rel_loss_diff'])} relative",
        "max grad-norm difference": f"{num(r['max_abs_grad_norm_diff'])} absolute, "
                                    f"{num(r['max_rel_grad_norm_diff'])} relative",
        "before the kill": f"max loss difference {num(r['before_kill_max_abs_loss_diff'])} "
                           "against the reference (0: this machine is deterministic)",
    }
    if more is not None:
        more(facts, r)
    lines = [f"# Interruption drill: {r['save_world_size']} → {r['resume_world_size']} rank(s)",
             "", f"**{'PASSED' if r['passed'] else 'FAILED'}** — {r['verdict']}.", "",
             f"Criterion: {criterion}.", "", "| | |", "|---|---|"]
    lines += [f"| {label} | {value} |" for label, value in facts.items()]
    lines += ["", "## Steps after the resume", "",
              ("| step | reference loss | resumed loss | rel. diff | reference grad norm | "
               "resumed grad norm | rel. diff |"),
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["per_step"]:
        lines.append(f"| {row['step']} | {row['reference_loss']:.7g} | {row['loss']:.7g} | "
                     f"{row['rel_loss_diff']:.2g} | {row['reference_grad_norm']:.7g} | "
                     f"{row['grad_norm']:.7g} | {row['rel_grad_norm_diff']:.2g} |")
    lines.append("")
    if r.get("plot"):
        lines += [f"![loss curves]({Path(r['plot']).name})", ""]
    lines.append(_commands_md(r))
    return "\n".join(lines)


def _commands_md(r: dict[str, Any]) -> str:
    commands = "\n".join(f"# {name}\n{cmd}" for name, cmd in r["commands"].items())
    return f"## Commands\n\n```bash\n{commands}\n```\n"


def plot(path: Path, reference: Run, before: Run, after: Run, r: dict[str, Any]) -> str | None:
    """Both loss curves, the checkpoint and the kill; None (with a hint) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("the plot needs matplotlib, the project's `plot` extra: python -m pip install "
              "-e '.[plot]' (in the project directory); the reports are written without it",
              flush=True)
        return None

    def curve(run: Run) -> tuple[list[int], list[float]]:
        steps = sorted(run.steps)
        return steps, [run.steps[s]["loss"] for s in steps]

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5.5),
                                      gridspec_kw={"height_ratios": [3, 1]})
    top.plot(*curve(reference), color="black", lw=1.5,
             label=f"reference, {r['save_world_size']} rank(s), uninterrupted")
    top.plot(*curve(before), "o", ms=4, mfc="none", color="tab:blue",
             label=f"interrupted run, {r['save_world_size']} rank(s)")
    top.plot(*curve(after), "x", ms=5, color="tab:orange",
             label=f"resumed, {r['resume_world_size']} rank(s)")
    for ax in (top, bottom):
        ax.axvline(r["resumed_from_step"], ls="--", color="gray", lw=1)
        ax.axvline(r["interrupted_at_step"], ls=":", color="red", lw=1)
    for key, label, ha, color in (("resumed_from_step", "checkpoint ", "right", "gray"),
                                  ("interrupted_at_step", " kill -9", "left", "red")):
        top.text(r[key], top.get_ylim()[1], label, va="top", ha=ha, color=color)
    top.set_ylabel("loss")
    top.legend(loc="lower left", fontsize=8)
    top.set_title(f"{'PASSED' if r['passed'] else 'FAILED'}: {r['verdict']}", fontsize=9)
    steps = [row["step"] for row in r["per_step"]]
    diffs = [row["rel_loss_diff"] for row in r["per_step"]]
    if any(diffs):
        # A log scale cannot show 0, and 0 is the common case: draw it on the floor.
        floor = min([d for d in diffs if d > 0] + [RESHARD_REL_TOL]) / 10
        bottom.semilogy(steps, [max(d, floor) for d in diffs], "x-", color="tab:orange",
                        label=f"|resumed - reference| / reference (0 drawn at {floor:.0e})")
        if r["save_world_size"] != r["resume_world_size"]:
            bottom.axhline(RESHARD_REL_TOL, color="red", lw=1, label="tolerance")
        bottom.legend(loc="center left", fontsize=7)
    else:
        bottom.text(0.5, 0.5, "every difference is 0 (bit-identical)", ha="center",
                    va="center", transform=bottom.transAxes)
        bottom.set_yticks([])
    bottom.set(ylabel="rel. loss diff", xlabel="step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
