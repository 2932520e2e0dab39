"""The ledger in the checklist's measured section (``plan --write``), in English or Chinese."""

from __future__ import annotations

from typing import Any

from .accounts import PARTS
from .mtbi import MIN_COUNT, duration, measure_mtbi

TEXT = {
    "en": {
        "title": "**Where the time went** (`python -m {package}.goodput`: {starts} start(s), "
                 "{wall} of wall time{coarse})",
        "coarse": "; from the history alone",
        "header": "| part | seconds | share |",
        "parts": {"productive": "productive steps", "rework": "rework (steps again)",
                  "saving": "saving", "eval": "evaluation", "restart": "restarts",
                  "unaccounted": "unaccounted"},
        "badput": "Measured badput **{measured:.2f} %**; the plan expects {planned:.2f} % at "
                  "`checkpoint.interval_steps={interval}` with an MTBI of {mtbi:g} h.",
        "mtbi": "Measured MTBI {estimate} (95 %: {low} to {high}) from {n} interruption(s) "
                "over {exposure}{few}.",
        "mtbi_none": "No interruption in {exposure} of training.",
        "few": "; fewer than {k}: too few to plan with",
        "lost": "- {kind} at step {step}: {lost} step(s) lost, back after {down}",
    },
    "zh": {
        "title": "**时间花在哪里**(`python -m {package}.goodput`:{starts} 次启动,"
                 "墙钟时间 {wall}{coarse})",
        "coarse": ";仅根据中断历史",
        "header": "| 部分 | 秒 | 占比 |",
        "parts": {"productive": "有效训练步", "rework": "返工(重算的步)", "saving": "保存",
                  "eval": "评估", "restart": "重启", "unaccounted": "未归类"},
        "badput": "实测无效时间 **{measured:.2f} %**;计划在 "
                  "`checkpoint.interval_steps={interval}`、MTBI {mtbi:g} 小时下预期 "
                  "{planned:.2f} %。",
        "mtbi": "实测 MTBI {estimate}(95 % 区间 {low} 至 {high}),来自 {exposure} 内的 "
                "{n} 次中断{few}。",
        "mtbi_none": "训练 {exposure} 内没有中断。",
        "few": ";少于 {k} 次,不足以据此规划",
        "lost": "- {kind},第 {step} 步:损失 {lost} 步,{down} 后恢复",
    },
}


def render_ledger_section(summary: dict[str, Any], package: str, lang: str = "en") -> str:
    """Markdown for a ledger summary (ledger/command.py's ``summarize``)."""
    text = TEXT[lang]
    wall = summary["wall_s"]
    lines = [text["title"].format(package=package, starts=summary["starts"],
                                  wall=duration(wall),
                                  coarse=text["coarse"] if summary["coarse"] else ""),
             "", text["header"], "|---|---|---|"]
    for part in PARTS:
        seconds = summary["parts_s"][part]
        share = 100 * seconds / wall if wall else 0.0
        lines.append(f"| {text['parts'][part]} | {seconds:.1f} | {share:.1f} % |")
    lines += ["", text["badput"].format(
        measured=summary["badput_percent"], planned=summary["planned_badput_percent"],
        interval=summary["interval_steps"], mtbi=summary["planned_mtbi_hours"])]
    mtbi = measure_mtbi(summary["mtbi"]["count"], summary["mtbi"]["exposure_s"])
    if mtbi.count == 0:
        lines.append(text["mtbi_none"].format(exposure=duration(mtbi.exposure_s)))
    else:
        lines.append(text["mtbi"].format(
            estimate=duration(mtbi.estimate_s), low=duration(mtbi.low_s),
            high=duration(mtbi.high_s), n=mtbi.count, exposure=duration(mtbi.exposure_s),
            few="" if mtbi.enough else text["few"].format(k=MIN_COUNT)))
    lines.append("")
    for item in summary["interruptions"]:
        down = "?" if item["downtime_s"] is None else duration(item["downtime_s"])
        lines.append(text["lost"].format(kind=item["kind"], step=item["step"],
                                         lost=item["steps_lost"], down=down))
    return "\n".join(lines).rstrip() + "\n"
