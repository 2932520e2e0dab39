"""The ledger as a picture: one row per start, time running left to right (``--plot``).
The gap before a row is its downtime (detection and queue), a red line an interruption."""

from __future__ import annotations

import os

from ..interval.plot import new_figure
from .accounts import Ledger

COLOURS = {"productive": "#2e7d32", "rework": "#ef6c00", "training": "#66bb6a",
           "saving": "#1565c0", "eval": "#6a1b9a", "restart": "#9e9e9e",
           "downtime": "#e57373"}


def plot_timeline(ledger: Ledger, path: str | os.PathLike) -> None:
    origin = ledger.starts[0]["begin"]
    rows = len(ledger.starts)
    figure = new_figure(10, 1.2 + 0.5 * rows)   # PlotUnavailable without matplotlib
    from matplotlib.patches import Patch
    axes = figure.add_subplot()
    previous_end = None
    for row, span in enumerate(ledger.starts):
        y = rows - 1 - row
        first = min((s[0] for s in span["steps"]), default=span["end"])
        bars = [(span["begin"], first, "restart"), *span["steps"],
                *((a, b, "saving") for a, b in span["saves"]),
                *((a, b, "eval") for a, b in span["evals"])]
        if previous_end is not None and span["begin"] > previous_end:
            bars.insert(0, (previous_end, span["begin"], "downtime"))
        for a, b, part in bars:
            axes.broken_barh([(a - origin, max(b - a, 0.0))], (y - 0.35, 0.7),
                             facecolors=COLOURS[part])
        previous_end = span["end"]
    for item in ledger.interruptions:
        if item["time"] is not None:
            axes.axvline(item["time"] - origin, color="#c62828", linewidth=1)
    axes.set_yticks(range(rows), [f"start {rows - k}" for k in range(rows)])
    axes.set_xlabel("seconds since the first start")
    axes.set_title(f"where the time went: badput {ledger.badput_percent:.1f} %, "
                   f"{len(ledger.interruptions)} interruption(s)")
    axes.legend(handles=[Patch(color=c, label=n) for n, c in COLOURS.items()],
                loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(COLOURS),
                fontsize="small", frameon=False)
    figure.tight_layout()
    figure.savefig(os.fspath(path))
