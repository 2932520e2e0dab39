"""The plan as a picture: expected badput against the checkpoint interval (``plan --plot``)."""

from __future__ import annotations

import os

from .formulas import Plan, badput, badput_components

PLOT_SUFFIXES = (".png", ".svg")


class PlotUnavailable(RuntimeError):
    pass


def new_figure(width: float, height: float):
    """A matplotlib Figure on the Agg canvas; PlotUnavailable without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib, the project's `plot` extra: "
                              "python -m pip install -e '.[plot]' (in the project "
                              "directory)") from exc
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def plot_badput(plan: Plan, path: str | os.PathLike) -> None:
    """Write B against the interval, with the recommendation and the target marked (PNG or SVG)."""
    i = plan.inputs
    lowest = plan.shortest_interval_steps
    highest = max(4 * plan.interval_steps, lowest + 10,
                  2 * (plan.max_interval_steps or 0), plan.simple_bound_steps or 0)
    # Log-spaced integer intervals: the curve spans orders of magnitude in N.
    count = 400
    ratio = (highest / lowest) ** (1 / (count - 1))
    steps = sorted({round(lowest * ratio**k) for k in range(count)} | {plan.interval_steps})
    parts = [badput_components(n * i.step_seconds, i) for n in steps]

    fig = new_figure(10, 4.5)
    ax = fig.add_subplot()
    ax.plot(steps, [100 * badput(n * i.step_seconds, i) for n in steps], color="black",
            label="expected badput B(N·T)")
    ax.plot(steps, [100 * p["saving"] for p in parts], "--", color="tab:blue",
            label="saving δ/(τ+δ)")
    ax.plot(steps, [100 * (p["rework"] + p["commit_latency"] + p["restart"]) for p in parts],
            ":", color="tab:orange", label="interruptions (R + (τ+δ)/2 + L)/M")
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
    ax.set_ylim(0, min(100.0, max(3 * i.badput_target_percent, 3 * 100 * plan.expected_badput)))
    ax.set_xlabel(f"checkpoint interval N (steps of {i.step_seconds:g} s)")
    ax.set_ylabel("badput (% of machine time)")
    nodes = "" if i.nodes == 1 else f" ({i.mtbi_hours:g} h / {i.nodes} nodes)"
    ax.set_title(f"M = {i.job_mtbi_hours:g} h{nodes}, T = {i.step_seconds:g} s, "
                 f"δ = {i.blocking_seconds:g} s, L = {i.commit_latency_seconds:g} s, "
                 f"R = {i.restart_seconds:g} s, target {i.badput_target_percent:g} %")
    ax.grid(True, which="both", alpha=0.3)
    # Beside the axes, not on them: inside, it would hide part of the curve.
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.savefig(path, dpi=120, bbox_inches="tight")

