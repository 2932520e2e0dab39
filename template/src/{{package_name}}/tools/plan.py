"""The `plan` command: the checkpoint interval plan (interval/) on the command line, with
what the interruption history measured (ledger/). Usage: python -m <package>.plan --help.

Each input comes from its flag, else from what training measured (--metrics: T, δ, L),
else from the config's checked `plan:` section (configs/train.yaml by default; key=value
overrides as for training). Formulas: interval.formulas; text, checklist: interval.report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .. import PACKAGE
from ..checkpoint.store.storage import open_storage
from ..config import DEFAULT_CONFIG, Config, ConfigError, load_config
from ..interval.formulas import badput, make_plan, make_two_tier
from ..interval.inputs import (
    FLAGS,
    Inputs,
    MetricsError,
    PlanInputError,
    configured_inputs,
    read_metrics,
)
from ..interval.plot import PLOT_SUFFIXES, PlotUnavailable, plot_badput
from ..interval.report import (
    checklist_language,
    format_plan,
    format_two_tier,
    render_measured_section,
    replace_measured_section,
    to_json,
    two_tier_json,
    write_atomically,
)
from ..ledger.advice import inputs_from, mtbi_notice, run_ledger
from ..ledger.advice import measured as ledger_measured
from ..ledger.command import summarize
from ..ledger.mtbi import describe as describe_mtbi
from ..ledger.report import render_ledger_section
from ..runtime.exit_codes import Refused, refusals

# Without a flag or a config: assumptions (half of the interruptions are crashes, a fifth
# node losses) and the default node count (one node, so the job's MTBI is the node's).
ASSUMED = {name: Inputs.__dataclass_fields__[name].default
           for name in ("crash_share", "nodes", "node_loss_share")}
# Inputs the config has no key for: a flag or the model's default (δ_m = δ, L_m = δ_m).
MEMORY_FLAGS = {"memory_blocking_seconds": "--memory-blocking-seconds",
                "memory_send_seconds": "--memory-send-seconds"}

MEASURED_FIELDS = ("step_seconds", "blocking_seconds", "commit_latency_seconds")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.plan",
        description="Plan the checkpoint interval from the time between interruptions, the step "
        "time and the save time, and show the expected badput. Inputs not given as flags come "
        "from measured metrics (--metrics: T, δ, L) or from the config's `plan:` section.",
        epilog="Overrides are key=value pairs for the config, e.g. plan.mtbi_hours=4; exit "
        "status 2: bad flags or configuration.",
    )
    for flag, metavar, text in (
        ("--mtbi-hours", "H", "mean time between interruptions of one node, hours"),
        ("--nodes", "N", ("nodes the job runs on (default 1): the job's MTBI is the node's "
                          "divided by N, since any node's loss interrupts the job")),
        ("--step-seconds", "T", "time of one optimizer step"),
        ("--blocking-seconds", "D", "time one save blocks training (δ)"),
        ("--commit-latency-seconds", "L", ("from save start until it is committed (L >= δ; "
                                           "sync saves: L = δ; default: δ)")),
        ("--restart-seconds", "R", "from an interruption until training runs again"),
        ("--badput-target-percent", "P",
         "share of machine time you accept losing, percent (0-100)"),
        ("--crash-share", "C", ("assumed share of interruptions that are crashes, restarted "
                                "in place, rather than preemptions, rescheduled (0-1; default "
                                "0.5)")),
        ("--node-loss-share", "NU", ("assumed share of interruptions that take one node, its "
                                     "memory with it, while the job's other machines stay: the "
                                     "memory tier's partner copy survives them (0-1, crash "
                                     "share + this <= 1; default 0.2)")),
        ("--memory-interval-steps", "K", ("memory tier: a copy in host memory and on a partner "
                                          "node every K steps, 0 = off (default: checkpoint."
                                          "memory_interval_steps of the config, else 0); "
                                          "badput is shown at K too")),
        ("--memory-blocking-seconds", "D_M", ("time one memory save blocks training (δ_m; "
                                              "default δ: both are one copy of the state into "
                                              "host memory)")),
        ("--memory-send-seconds", "S", ("time to send a memory copy to the partner rank: the "
                                        "memory commit latency is L_m = δ_m + S (default 0)")),
        ("--in-place-restart-seconds", "R_IN", ("from a crash until training runs again after "
                                                "torchrun restarted the workers in place "
                                                "(default: measured by --metrics)")),
    ):
        parser.add_argument(flag, metavar=metavar, default=None, help=text,
                            type=int if flag in ("--nodes", "--memory-interval-steps") else float)
    parser.add_argument("--metrics", metavar="FILE",
                        help="metrics.jsonl (or its folder) from training: T, δ and L are its "
                             "medians")
    parser.add_argument("--from-history", action="store_true",
                        help="plan with what the interruption history measured: the MTBI, "
                             "the crash and node-loss shares, R and R_in (python -m "
                             f"{PACKAGE}.goodput shows them; at least 3 interruptions)")
    parser.add_argument("--config", metavar="PATH",
                        help="config with a `plan:` section "
                             f"(default: {DEFAULT_CONFIG} if present)")
    parser.add_argument("--write", metavar="CHECKLIST",
                        help="refresh the measured section of this checklist in place "
                             "(needs --metrics), e.g. docs/CHECKLIST.md")
    parser.add_argument("--plot", metavar="FILE",
                        help="write a plot of badput against the interval (.png or .svg)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. plan.restart_s=300")
    return parser


@refusals
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.write and not args.metrics:
        parser.error("--write needs --metrics: it records what training measured")
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        parser.error(f"argument --plot: the file name must end in .png or .svg (got {args.plot})")

    # No config when none was named and there is no configs/train.yaml here.
    try:
        config = (None if args.config is None and not args.overrides
                  and not DEFAULT_CONFIG.is_file() else load_config(args.config, args.overrides))
    except ConfigError as exc:  # it names the key at fault
        raise Refused(exc) from exc
    config_path = args.config or str(DEFAULT_CONFIG)

    measured = None
    if args.metrics:
        try:
            measured = read_metrics(args.metrics)
        except (MetricsError, OSError) as exc:
            parser.error(f"argument --metrics: {exc}")

    values, origins = resolve_inputs(args, config, config_path, measured, parser)
    for field, flag in MEMORY_FLAGS.items():
        if getattr(args, field) is not None:
            values[field], origins[field] = getattr(args, field), flag
        elif measured is not None and getattr(measured, field) is not None:
            values[field], origins[field] = getattr(measured, field), f"--metrics {measured.path}"
    inputs = Inputs(**values)
    in_place = args.in_place_restart_seconds
    if in_place is None and measured is not None:
        in_place = measured.in_place_restart_seconds
    if args.from_history:
        inputs, in_place = _from_history(args, config, inputs, in_place, origins, parser)
    elif config is not None:
        _say_measured_mtbi(config, inputs)
    origins["in_place_restart_seconds"] = "--in-place-restart-seconds"
    # The memory tier at the configured intervals: checkpoint.memory_interval_steps (or
    # the flag) with the config's durable interval, or the recommended one without a config.
    # What the config planned with and its interval are shown beside the measurements.
    memory_steps, configured, planned = args.memory_interval_steps, None, None
    origins["memory_interval_steps"] = "--memory-interval-steps"
    if config is not None:
        configured, planned = config.checkpoint.interval_steps, configured_inputs(config)
        if memory_steps is None:
            memory_steps = config.checkpoint.memory_interval_steps
            origins["memory_interval_steps"] = f"checkpoint.memory_interval_steps in {config_path}"
    try:
        plan = make_plan(inputs, in_place)
        two_tier = make_two_tier(plan, memory_steps or 0, configured)
    except PlanInputError as exc:
        flag = (FLAGS[exc.field][0] if exc.field in FLAGS
                else MEMORY_FLAGS.get(exc.field, f"--{exc.field.replace('_', '-')}"))
        parser.error(f"argument {flag}: {exc.message}"
                     + ("" if origins[exc.field] == flag else f" (from {origins[exc.field]})"))

    if args.json:
        payload = {**to_json(plan), "two_tier": two_tier_json(two_tier)}
        if measured is not None:
            payload["measured"] = dataclasses.asdict(measured)
            payload["planned"] = None if planned is None else dataclasses.asdict(planned)
            payload["configured_interval_steps"] = configured
            payload["configured_badput_percent"] = (
                None if configured is None
                else 100 * badput(configured * inputs.step_seconds, inputs))
        print(json.dumps(payload, ensure_ascii=False))
    else:
        print(f"{format_plan(plan)}\n\n{format_two_tier(two_tier)}")
        if measured is not None:
            print("\n" + render_measured_section(plan, measured, planned, configured), end="")

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
            section += _ledger_markdown(config, lang)
            write_atomically(target, replace_measured_section(document, section))
        except (OSError, ValueError) as exc:
            parser.error(f"argument --write: {target}: {exc}")
        print(f"plan: refreshed the measured section of {target}", file=sys.stderr)
    return 0


def _from_history(args, config: Config | None, inputs: Inputs, in_place: float | None,
                  origins: dict[str, str], parser) -> tuple[Inputs, float | None]:
    """The inputs with the history's measurements for the config's (a flag still wins)."""
    if config is None:
        parser.error("--from-history needs a config: the history is in its checkpoint.dir")
    try:
        found = ledger_measured(run_ledger(config)[0])
        from_history = inputs_from(inputs, found)
    except (LookupError, ValueError) as exc:
        parser.error(f"argument --from-history: {exc}")
    fields = ("mtbi_hours", "crash_share", "node_loss_share", "restart_seconds")
    kept = {field: getattr(inputs, field) for field in fields if getattr(args, field) is not None}
    for field in fields:
        if field not in kept and getattr(from_history, field) != getattr(inputs, field):
            origins[field] = "--from-history"
    if in_place is None and found.in_place_restart_s is not None:
        in_place = found.in_place_restart_s
    print(f"plan: from the history, {describe_mtbi(found.mtbi)}", file=sys.stderr)
    return dataclasses.replace(from_history, **kept), in_place


def _ledger_markdown(config: Config | None, lang: str) -> str:
    """The goodput ledger for the checklist's measured section ("" without config or records)."""
    if config is None:
        return ""
    try:
        ledger, skipped, has_metrics = run_ledger(config)
    except LookupError:                      # nothing recorded yet
        return ""
    except Exception as exc:  # noqa: BLE001 - the checklist stands without the ledger
        print(f"plan: the checklist leaves out the ledger: the history in "
              f"checkpoint.dir={config.checkpoint.dir} could not be read "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return ""
    summary = summarize(ledger, config, skipped, has_metrics=has_metrics)
    return "\n" + render_ledger_section(summary, PACKAGE, lang)


def _say_measured_mtbi(config: Config, inputs: Inputs) -> None:
    """Unasked: one line when the history's MTBI interval excludes the configured one."""
    try:
        notice = mtbi_notice(config, open_storage(config.checkpoint.dir), inputs)
    except Exception:  # noqa: BLE001 - the plan stands without the history
        return
    if notice is not None:
        print(notice, file=sys.stderr)


def resolve_inputs(args, config: Config | None, config_path: str, measured, parser):
    """Each input from its flag, else from the measurements, else from the config."""
    values, origins = {}, {}
    for field, (flag, key) in FLAGS.items():
        if (flag_value := getattr(args, field)) is not None:  # argparse dest == Inputs field
            values[field], origins[field] = flag_value, flag
        elif measured is not None and field in MEASURED_FIELDS:
            values[field], origins[field] = getattr(measured, field), f"--metrics {measured.path}"
        elif field == "commit_latency_seconds" and origins.get("blocking_seconds") == \
                FLAGS["blocking_seconds"][0]:
            # δ given by hand and L not: treat it as a synchronous save (L = δ).
            values[field], origins[field] = values["blocking_seconds"], "--blocking-seconds"
        elif config is not None:
            values[field], origins[field] = getattr(config.plan, key), f"plan.{key} in {config_path}"
        elif field in ASSUMED:
            values[field] = ASSUMED[field]
            origins[field] = "the default" if field == "nodes" else "an assumption"
        else:
            parser.error(f"missing {flag} (no {DEFAULT_CONFIG} here; pass the flag or "
                         "--config PATH)")
    return values, origins
