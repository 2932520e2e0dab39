"""The words of the plan's report in English and Chinese, ``TEXT[lang][key]``: the checklist's
measured section (docs/CHECKLIST.md, in its language) and the sentences the text and JSON share
(why a target cannot be met, what in-place restarts save); interval.report fills them in."""

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
                "(M = {mtbi}, R = {restart:g} s, target = {target:g} %):",
        "mtbi": "{hours:g} h ({seconds:g} s)",
        "mtbi_nodes": ", one node's {node:g} h / {nodes} nodes",
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
        "in_place": "Restarts: a crash is restarted in place in R_in = {rin:.1f} s (measured), "
                    "a preemption is rescheduled in R = {r:g} s (your answer). Assuming a "
                    "share c = {c:g} of the interruptions are crashes (`plan.crash_share`), "
                    "in-place restarts save c(R − R_in)/M = {s:.2f} % at M = {mtbi:g} h: "
                    "expected badput {b:.2f} % → {bin:.2f} %.",
        "in_place_none": "Restarts: a preemption is rescheduled in R = {r:g} s (your answer); "
                         "the in-place restart time R_in of a crash is not measured yet (it is "
                         "once torchrun has restarted the workers in place: `recovered` "
                         "events). The plan assumes c = {c:g} of interruptions are crashes.",
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
                "（M = {mtbi}，R = {restart:g} 秒，目标 = {target:g} %）：",
        "mtbi": "{hours:g} 小时（{seconds:g} 秒）",
        "mtbi_nodes": "，即单节点的 {node:g} 小时 / {nodes} 个节点",
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
        "in_place": "重启：崩溃由 torchrun 原地重启，实测 R_in = {rin:.1f} 秒；抢占由调度器"
                    "重新调度，R = {r:g} 秒（你的回答）。假设中断中有 c = {c:g} 是崩溃"
                    "（`plan.crash_share`），在 M = {mtbi:g} 小时下原地重启节省 "
                    "c(R − R_in)/M = {s:.2f} %：预期 badput {b:.2f} % → {bin:.2f} %。",
        "in_place_none": "重启：抢占由调度器重新调度，R = {r:g} 秒（你的回答）；崩溃的原地重启"
                         "时间 R_in 尚未实测（torchrun 原地重启过 worker 之后，`recovered` "
                         "事件会记录它）。计划假设中断中有 c = {c:g} 是崩溃。",
    },
}
