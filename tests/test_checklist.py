"""docs/CHECKLIST.md, rendered by copier, shows the numbers the generated `plan` computes.

copier runs no code, so includes/plan.jinja repeats the plan model's formulas in
Jinja for the copy-time checklist and configs/train.yaml. These tests hold the two
copies together: full renders of a few answer sets (English and Chinese, reachable
and unreachable targets) compared with `python -m <package>.plan --json`, and the
Jinja expressions against the interval.formulas module on many random answers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from jinja2 import FileSystemLoader
from jinja2.sandbox import SandboxedEnvironment

from conftest import REPO, package_of, render, run_in

PLAN_JINJA = "includes/plan.jinja"
# Answer -> key in the config's `plan:` section (the answers keep their names for
# `copier update`; the config spells seconds `_s` like its other keys).
PLAN_KEYS = {"mtbi_hours": "mtbi_hours", "step_time_seconds": "step_time_s",
             "checkpoint_save_seconds": "checkpoint_save_s", "restart_seconds": "restart_s",
             "badput_target_percent": "badput_target_percent", "nodes": "nodes"}

ANSWER_SETS = {
    "defaults": {},
    # Spot machines interrupted hourly with a slow restart: R/M alone is 16.7 %.
    "spot-unreachable": {
        "mtbi_hours": 1.0, "checkpoint_save_seconds": 60.0,
        "restart_seconds": 600.0, "badput_target_percent": 5.0, "nodes": 2,
        "launchers": ["kubernetes", "slurm"], "cloud": "aws", "grace_period_seconds": 90.0,
        "checkpoint_dir": "/tmp/ckpt", "async_mode": "sync",
    },
    "dedicated": {
        # 72 h per node on 2 nodes: the job is interrupted every 36 h.
        "project_name": "big-run", "mtbi_hours": 72.0, "nodes": 2, "step_time_seconds": 0.35,
        "checkpoint_save_seconds": 45.0, "restart_seconds": 300.0, "badput_target_percent": 4.0,
        "cloud": "gcp", "checkpoint_dir": "s3://bucket/big-run", "async_mode": "thread",
        "launchers": ["skypilot"], "grace_period_seconds": 25.0,
    },
    # Long steps: the intervals meeting the target all lie below one step.
    "long-steps-unreachable": {
        "mtbi_hours": 0.5, "step_time_seconds": 300.0,
        "checkpoint_save_seconds": 5.0, "restart_seconds": 0.0, "badput_target_percent": 8.0,
        "cloud": "azure", "checkpoint_dir": "/mnt/shared/ckpt",
    },
    # The intervals meeting the target lie between two whole numbers of steps.
    "between-steps-unreachable": {
        "mtbi_hours": 0.5, "step_time_seconds": 120.0, "checkpoint_save_seconds": 10.0,
        "restart_seconds": 30.0, "badput_target_percent": 13.0, "launchers": ["kubernetes"],
    },
}

# Second cell of each table row -> how plan's JSON fills the third cell.
NUMBER_REGEX = re.compile(r"\d+(?:\.\d+)?(?:e[+-]\d+)?")


# The template formats with Jinja's `'%g' | format(x)` and friends: the same here.
def g(x: float) -> str:
    return "%g" % x  # noqa: UP031


def f1(x: float) -> str:
    return "%.1f" % x  # noqa: UP031


def f2(x: float) -> str:
    return "%.2f" % x  # noqa: UP031


def f0(x: float) -> str:
    return "%.0f" % x  # noqa: UP031


def expected_rows(plan: dict, plan_r: dict) -> dict[str, list[str]]:
    """plan: run with R_in = 0; plan_r: without R_in (R_in = R), as the two-tier figures are."""
    i, c = plan["inputs"], plan["badput_components_percent"]
    two, two_r = plan["two_tier"], plan_r["two_tier"]
    shards = two["memory_shards_per_rank"]
    n, n_max, bound = (plan["interval_steps"], plan["max_interval_steps_for_target"],
                       plan["simple_bound_max_interval_steps"])
    return {
        "M_node": [g(i["mtbi_hours"])],
        "n": [str(i["nodes"])],
        "M": [g(i["job_mtbi_hours"]), f0(i["mtbi_seconds"])],
        "T": [g(i["step_seconds"])],
        "δ": [g(i["blocking_seconds"])],
        "L": [g(i["commit_latency_seconds"])],
        "R": [g(i["restart_seconds"])],
        "target": [g(i["badput_target_percent"])],
        "N": [str(n), f1(plan["interval_seconds"]), f1(plan["interval_seconds"] / 60)],
        "τ*": [f1(plan["young_daly_interval_seconds"])],
        "B(N·T)": [f2(plan["expected_badput_percent"])],
        "δ/(τ+δ)": [f2(c["saving"])],
        "(τ+δ)/(2M)": [f2(c["rework"])],
        "L/M": [f2(c["commit_latency"])],
        "R/M": [f2(c["restart"])],
        "B_min": [f2(plan["min_badput_percent"])],
        "N_max": [] if n_max is None else [str(n_max), f1(plan["max_interval_seconds_for_target"])],
        "2(target·M − δ)/T": [] if bound is None else [str(bound)],
        "c": [g(i["crash_share"])],
        "c(R − R_in)/M": [f2(plan["in_place_saving_percent"])],   # plan run with R_in = 0
        # Two tiers: copy time takes δ_m = δ, L_m = δ_m, ν = 0.2 and R_in = R.
        "δ_m": [g(two["memory_blocking_seconds"])],
        "L_m": [g(two["memory_commit_latency_seconds"])],
        "ν": [g(i["node_loss_share"])],
        "a": [g(two["memory_share"])],
        "B1(N·T)": [f2(two_r["badput_without_memory_percent"])],
        "N_m": [str(two["optimal_memory_interval_steps"]),
                f1(two["optimal_memory_interval_seconds"])],
        "N_d": [str(two["optimal_durable_interval_steps"]),
                f1(two["optimal_durable_interval_seconds"])],
        "B2(N_d·T, N_m·T)": [f2(two_r["badput_with_memory_percent"])],
        "K": [str(two_r["recommended_memory_interval_steps"])],
        "shards": ([str(shards[k]) for k in ("own", "partner")]
                   if i["nodes"] >= 2 else [str(shards["own"])]),
    }


def table_rows(markdown: str) -> dict[str, str]:
    rows = {}
    for match in re.finditer(r"^\| [^|]+ \| `([^`]+)` \| ([^|]+) \|$", markdown, re.MULTILINE):
        assert match.group(1) not in rows, f"two rows for {match.group(1)}"
        rows[match.group(1)] = match.group(2)
    return rows


def numeric(answers: dict) -> dict:
    """The recorded answers with the numbers as numbers (the answers file records the
    numeric questions as text: they are `type: str` in copier.yml)."""
    floats = set(PLAN_KEYS) | {"grace_period_seconds"}
    return {name: float(value) if name in floats - {"nodes"}
            else int(value) if name in ("keep_last", "nodes")
            else value for name, value in answers.items()}


def run_plan(dst: Path, package: str, *args: str) -> subprocess.CompletedProcess:
    return run_in(dst, "-m", f"{package}.plan", *args, timeout=120, check=False)


@pytest.fixture(scope="module", params=[(name, language) for name in ANSWER_SETS
                                        for language in ("en", "zh")], ids="-".join)
def project(request, tmp_path_factory):
    """A rendered project, its recorded answers, and plan --json for those answers."""
    name, language = request.param
    dst = tmp_path_factory.mktemp(f"{name}-{language}")
    render(dst, **ANSWER_SETS[name], docs_language=language)
    answers = numeric(yaml.safe_load((dst / ".copier-answers.yml").read_text(encoding="utf-8")))
    package = answers["package_name"]
    save = repr(answers["checkpoint_save_seconds"])
    proc = run_plan(dst, package, "--json",
                    "--mtbi-hours", repr(answers["mtbi_hours"]),
                    "--step-seconds", repr(answers["step_time_seconds"]),
                    "--blocking-seconds", save, "--commit-latency-seconds", save,
                    "--restart-seconds", repr(answers["restart_seconds"]),
                    "--badput-target-percent", repr(answers["badput_target_percent"]),
                    "--nodes", str(answers["nodes"]), "--in-place-restart-seconds", "0")
    assert proc.returncode == 0, proc.stderr
    # Without R_in, as the copy-time two-tier figures (R_in = R, nothing measured).
    proc_r = run_plan(dst, package, "--json")
    assert proc_r.returncode == 0, proc_r.stderr
    checklist = (dst / "docs" / "CHECKLIST.md").read_text(encoding="utf-8")
    return {"dst": dst, "answers": answers, "package": package, "plan": json.loads(proc.stdout),
            "plan_r": json.loads(proc_r.stdout), "checklist": checklist, "name": name}


def test_checklist_has_no_unrendered_jinja(project):
    for token in ("{{", "}}", "{%", "%}", "{#", "#}"):
        assert token not in project["checklist"]


def test_checklist_is_in_the_chosen_language(project):
    has_chinese = re.search(r"[\u4e00-\u9fff]", project["checklist"]) is not None
    assert has_chinese == (project["answers"]["docs_language"] == "zh")


def test_plan_tables_show_plans_numbers(project):
    rows = table_rows(project["checklist"])
    expected = expected_rows(project["plan"], project["plan_r"])
    assert set(rows) == set(expected)
    for symbol, numbers in expected.items():
        assert NUMBER_REGEX.findall(rows[symbol]) == numbers, (symbol, rows[symbol])


def test_target_reachability_matches_plan(project):
    plan, checklist = project["plan"], project["checklist"]
    unreachable = re.search(r"^\*\*(The .* target cannot be met\.|目标 .* 无法达到。)\*\*(.*)$",
                            checklist, re.MULTILINE)
    assert (unreachable is None) == plan["target_reachable"]
    assert project["name"].endswith("unreachable") == (not plan["target_reachable"])
    if unreachable is None:
        return
    window = plan["target_window_seconds"]
    if window is None:  # no interval at all: the floor and its parts
        c = plan["badput_components_percent"]
        numbers = {f2(plan["min_badput_percent"]), f2(c["restart"]), f2(c["commit_latency"]),
                   f2(plan["min_saving_and_rework_percent"])}
    elif window[1] < plan["inputs"]["step_seconds"]:
        numbers = {f1(window[1])}
    else:
        numbers = {f1(window[0]), f1(window[1])}
    assert set(re.findall(r"\d+\.\d+", unreachable.group(2))) == numbers


def test_saving_more_often_misjudgment_uses_plans_numbers(project):
    plan = project["plan"]
    line = next(line for line in project["checklist"].splitlines() if line.startswith("1. **"))
    assert NUMBER_REGEX.findall(line[len("1. "):]) == [
        str(plan["interval_steps"]), f2(plan["expected_badput_percent"]),
        str(plan["half_interval_steps"]), f2(plan["badput_percent_at_half_interval"]),
        str(plan["double_interval_steps"]), f2(plan["badput_percent_at_double_interval"]),
        str(project["answers"]["keep_last"]),
    ]


def test_every_decimal_in_the_checklist_comes_from_the_plan(project):
    """A catch-all: any figure with a decimal point is one of plan's, formatted alike.

    The grace-period checks add figures of their own, from the answers.
    """
    answers = project["answers"]
    known = {g(answers["step_time_seconds"] + answers["checkpoint_save_seconds"]),
             g(answers["grace_period_seconds"])}

    def collect(value):
        if isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, list):
            for v in value:
                collect(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            known.update({g(value), f1(value), f2(value), f1(value / 60)})

    collect(project["plan"])
    collect(project["plan_r"])
    decimals = set(re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", project["checklist"]))
    assert decimals <= known, decimals - known


def test_train_yaml_interval_is_plans(project, default_project):
    config = yaml.safe_load((project["dst"] / "configs" / "train.yaml").read_text())
    assert config["checkpoint"]["interval_steps"] == project["plan"]["interval_steps"]
    answers = project["answers"]
    # Every answer lands in plan:, beside the planner's own stated assumptions.
    assert set(config["plan"]) - {"crash_share", "node_loss_share"} == set(PLAN_KEYS.values())
    formulas, _ = load_plan_modules(default_project)
    assert config["plan"]["node_loss_share"] == formulas.NODE_LOSS_SHARE
    assert config["plan"]["crash_share"] == formulas.CRASH_SHARE
    for answer, key in PLAN_KEYS.items():
        assert config["plan"][key] == answers[answer], key


def test_copy_time_jinja_stays_in_the_template_repository(project):
    assert not (project["dst"] / "includes").exists()
    questions = yaml.safe_load((REPO / "copier.yml").read_text(encoding="utf-8"))
    assert not [name for name in questions if name.startswith("plan_")]


def test_plan_without_flags_reads_the_rendered_config(project):
    proc = run_plan(project["dst"], project["package"], "--json", "--in-place-restart-seconds", "0")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == project["plan"]


def test_checklist_states_match_the_answers(project):
    answers, checklist = project["answers"], project["checklist"]
    boxes = re.findall(r"^- \[([ x])\] \*\*", checklist, re.MULTILINE)
    # persistent storage, shards + metadata, who may write the directory, interval, async,
    # drill, grace period
    assert len(boxes) == 7
    directory = answers["checkpoint_dir"]
    assert (boxes[0] == "x") == bool(re.match(r"(s3|gs|gcs|az|abfs|abfss)://", directory))
    assert boxes[1] == "x"
    assert boxes[2] == " "  # only the job may write checkpoint.dir: the user's to check
    assert boxes[3] == "x"
    assert (boxes[4] == "x") == (answers["async_mode"] != "sync")
    assert boxes[5] == " "  # the drill is the user's to run
    grace, needed = answers["grace_period_seconds"], (answers["step_time_seconds"]
                                                      + answers["checkpoint_save_seconds"])
    notice = {"aws": 120, "gcp": 30, "azure": 30}.get(answers["cloud"], math.inf)
    # A grace period longer than the cloud's notice is itself a failure (it is flagged).
    assert (boxes[-1] == "x") == (needed <= grace <= notice)  # the grace item comes last
    assert "--save-ranks 8 --resume-ranks 4 --out drill-out" in checklist


def test_grace_windows_quoted_are_the_generated_files(project):
    """The checklist quotes torchrun's, Kubernetes' and Slurm's windows as the project sets them."""
    answers, checklist, dst = project["answers"], project["checklist"], project["dst"]
    timeout = math.ceil(answers["grace_period_seconds"]) + 30
    assert f"--shutdown-timeout {timeout}`" in checklist
    launch = [dst / "launch" / "kubernetes.yaml", dst / "launch" / "slurm.sbatch"]
    for path, launcher, setting in zip(launch, ("kubernetes", "slurm"),
                                       (f"terminationGracePeriodSeconds: {timeout}",
                                        f"--signal=B:USR1@{timeout}")):
        assert (setting in checklist) == (launcher in answers["launchers"])
        if launcher in answers["launchers"]:
            assert setting in path.read_text(encoding="utf-8")


def test_write_refreshes_the_rendered_checklist_in_its_language(project, tmp_path):
    dst, package = project["dst"], project["package"]
    metrics = tmp_path / "metrics.jsonl"
    events = [{"event": "start", "step": 0}]
    events += [{"event": "step", "step": s, "step_time_s": 1.5 + 0.1 * (s % 3)} for s in range(9)]
    events += [{"event": "save", "step": s, "reason": "interval", "mode": "process",
                "blocking_s": 0.2 * s, "commit_latency_s": 3.0 * s} for s in (1, 2, 3, 4)]
    metrics.write_text("".join(json.dumps(e) + "\n" for e in events))
    path = dst / "docs" / "CHECKLIST.md"
    before = path.read_text(encoding="utf-8")
    proc = run_plan(dst, package, "--metrics", str(metrics), "--write", "docs/CHECKLIST.md")
    assert proc.returncode == 0, proc.stderr
    after = path.read_text(encoding="utf-8")
    outside = re.compile(r"(?s)(.*<!-- measured:begin lang=\w+ -->\n).*(<!-- measured:end -->.*)")
    assert outside.match(before).groups() == outside.match(after).groups()
    inside = after.split("<!-- measured:begin")[1].split("<!-- measured:end -->")[0]
    title = "实测数据" if project["answers"]["docs_language"] == "zh" else "Measured in"
    assert title in inside
    path.write_text(before, encoding="utf-8")  # leave the module's project as rendered


# ------------------------------------------- includes/plan.jinja against interval.formulas


def load_plan_modules(project: Path):
    """interval.formulas and interval.report of a default render (its words are rendered per
    docs_language), imported as modules of a package named template_pkg."""
    if "template_pkg" not in sys.modules:
        source = project / "src" / package_of(project)
        spec = importlib.util.spec_from_file_location(
            "template_pkg", source / "__init__.py", submodule_search_locations=[str(source)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = package  # dataclasses look their module up while made
        spec.loader.exec_module(package)
    return (importlib.import_module("template_pkg.interval.formulas"),
            importlib.import_module("template_pkg.interval.report"))


def copy_time_plan():
    """includes/plan.jinja as copier's templates import it: answers in, its variables out."""
    # Loader rooted at the template repository and the filters copier adds, as in copier.
    env = SandboxedEnvironment(loader=FileSystemLoader(str(REPO)),
                               extensions=["jinja2_ansible_filters.AnsibleCoreFiltersExtension"])
    template = env.get_template(PLAN_JINJA)
    return lambda answers: template.make_module(dict(answers))


def test_copy_time_formulas_equal_plan_model_on_random_answers(default_project):
    plan, report = load_plan_modules(default_project)
    evaluate = copy_time_plan()
    rng = random.Random(5)
    kinds = {"reachable": 0, "no window": 0, "window between steps": 0}
    nodes_seen = set()
    for k in range(500):
        answers = {
            "mtbi_hours": math.exp(rng.uniform(math.log(0.05), math.log(500))),
            "step_time_seconds": math.exp(rng.uniform(math.log(0.01), math.log(600))),
            "checkpoint_save_seconds": math.exp(rng.uniform(math.log(0.01), math.log(2000))),
            "restart_seconds": 0.0 if k % 10 == 0 else rng.uniform(0, 3000),
            "badput_target_percent": math.exp(rng.uniform(math.log(0.1), math.log(90))),
            # One node, or a job of several whose MTBI is the node's / nodes.
            "nodes": 1 if k % 3 == 0 else rng.choice([2, 3, 8, 64, 1024]),
        }
        if k % 9 == 0:  # a save longer than 2M: τ* = M
            answers["checkpoint_save_seconds"] = answers["mtbi_hours"] * 3600 * rng.uniform(2, 5)
        elif k % 5 == 0:  # near an answer set whose target window falls between two steps
            answers.update({key: value * rng.uniform(0.98, 1.02) for key, value in
                            ANSWER_SETS["between-steps-unreachable"].items()
                            if key not in ("launchers", "nodes")})
        got = evaluate(answers)
        nodes_seen.add(answers["nodes"])
        d = answers["checkpoint_save_seconds"]
        p = plan.make_plan(plan.Inputs(answers["mtbi_hours"], answers["step_time_seconds"], d, d,
                                       answers["restart_seconds"],
                                       answers["badput_target_percent"],
                                       nodes=answers["nodes"]))
        out = report.to_json(p)
        c = out["badput_components_percent"]
        # Same operations in the same order: equal floats, not merely close ones.
        assert (got.M, got.job_mtbi_hours) == (p.inputs.mtbi_seconds, p.inputs.job_mtbi_hours)
        assert (got.tau_seconds, got.interval_steps, got.badput_percent) \
            == (p.daly_interval_seconds, p.interval_steps, 100 * p.expected_badput), answers
        window = out["target_window_seconds"] or [None, None]
        expected = {
            "saving_percent": c["saving"], "rework_percent": c["rework"],
            "commit_latency_percent": c["commit_latency"], "restart_percent": c["restart"],
            "min_badput_percent": out["min_badput_percent"],
            "min_saving_and_rework_percent": out["min_saving_and_rework_percent"],
            "window_low_seconds": window[0], "window_high_seconds": window[1],
            "max_interval_steps": out["max_interval_steps_for_target"] or 0,
            "simple_bound_steps": out["simple_bound_max_interval_steps"] or 0,
            "half_interval_steps": out["half_interval_steps"],
            "badput_half_percent": out["badput_percent_at_half_interval"],
            "double_interval_steps": out["double_interval_steps"],
            "badput_double_percent": out["badput_percent_at_double_interval"],
        }
        assert {name: getattr(got, name) for name in expected} == expected, answers
        assert got.crash_share == plan.CRASH_SHARE
        assert got.in_place_max_saving_percent == 100 * plan.in_place_saving(p.inputs, 0.0)
        # Two tiers: δ_m = δ, L_m = δ_m, ν = NODE_LOSS_SHARE, R_in = R (not measured).
        two = plan.make_two_tier(p)
        assert got.node_loss_share == p.inputs.node_loss_share == plan.NODE_LOSS_SHARE
        assert (got.dm, got.lm) == (p.inputs.memory_blocking, p.inputs.memory_commit_latency)
        failure = {k.kind: k for k in two.failure_kinds}
        expected = {
            "memory_share": two.memory_share, "durable_share": two.durable_share,
            "job_loss_share": plan.job_loss_share(p.inputs),
            "memory_tau_seconds": two.memory_interval_seconds,
            "durable_tau_seconds": two.durable_interval_seconds,
            "memory_interval_steps": two.optimal_memory_interval_steps,
            "durable_interval_steps": two.optimal_durable_interval_steps,
            "badput_without_memory": two.badput_without,
            "badput_with_memory": two.badput_with,
            "memory_tier_pays": two.pays,
            "recommended_memory_interval_steps": two.recommended_memory_interval_steps,
            "recommended_durable_interval_steps": two.recommended_durable_interval_steps,
            "break_even_memory_blocking_seconds": two.break_even_memory_blocking_seconds,
            "lost_without": failure["crash"].lost_seconds_without,
            "lost_memory": failure["crash"].lost_seconds_with,
            "lost_durable": failure["job_loss"].lost_seconds_with,
            "lost_node": failure["node_loss"].lost_seconds_with,
            "memory_shards_own": two.memory_shards["own"],
            "memory_shards_partner": two.memory_shards["partner"],
        }
        assert {name: getattr(got, name) for name in expected} == expected, answers
        assert (got.badput_without_memory_percent, got.badput_with_memory_percent) \
            == (100 * two.badput_without, 100 * two.badput_with), answers
        if p.max_interval_steps is not None:
            kinds["reachable"] += 1
        elif p.target_window_seconds is None:
            kinds["no window"] += 1
        else:
            kinds["window between steps"] += 1
    assert min(kinds.values()) >= 3, kinds
    assert {1, 1024} <= nodes_seen, nodes_seen


def two_tier_section(checklist: str) -> str:
    return re.search(r"(?s)### (?:Two tiers: memory and durable|两级检查点：内存与持久存储)\n"
                     r"(.*?)\n### ", checklist).group(1)


def test_two_tier_section_quotes_the_plan(project):
    """The failure kinds, the verdict and how to turn the memory tier on, from plan's figures."""
    two, answers = project["plan_r"]["two_tier"], project["answers"]
    section = two_tier_section(project["checklist"])
    kinds = {k["kind"]: k for k in two["failure_kinds"]}
    bullets = [line for line in section.splitlines() if line.startswith("- **")]
    assert len(bullets) == 3  # crash, node loss, job loss
    assert NUMBER_REGEX.findall(bullets[0]) == [
        g(kinds["crash"]["share"]), f1(kinds["crash"]["lost_seconds_with_memory"]),
        f1(kinds["crash"]["lost_seconds_without_memory"])]
    # A node loss keeps the partner's copy on 2 nodes or more, and falls back to durable on one.
    assert kinds["node_loss"]["keeps"] == ("partner_copy" if answers["nodes"] >= 2 else "durable")
    assert ("partner" in bullets[1] and "durable" not in bullets[1]
            or "伙伴的副本还在" in bullets[1]) == (answers["nodes"] >= 2)
    assert NUMBER_REGEX.findall(bullets[2]) == [  # the 1 of 1 − c − ν first
        "1", g(kinds["job_loss"]["share"]), f1(kinds["job_loss"]["lost_seconds_with_memory"])]
    verdict = next(line for line in section.splitlines()
                   if line.startswith(("At your answers", "按你的回答")))
    if two["memory_tier_pays"]:
        assert f"checkpoint.memory_interval_steps: {two['optimal_memory_interval_steps']}`" \
            in verdict
    else:
        assert f2(two["break_even_memory_blocking_seconds"]) in verdict
        assert "--memory-blocking-seconds" in verdict
    for needed in ("`checkpoint.memory_interval_steps: K`", "`configs/train.yaml`",
                   "`checkpoint.memory_dir`", "`/dev/shm`"):
        assert needed in section


# ------------------------------------------- grace period against the notice ----


def grace_box(checklist: str) -> str:
    (box,) = re.findall(r"^- \[([ x])\] \*\*(?:Grace period long enough|宽限期够用)\*\*",
                        checklist, re.MULTILINE)
    return box


@pytest.mark.parametrize("language", ["en", "zh"])
def test_grace_period_longer_than_the_notice_is_flagged(tmp_path, language):
    """cloud=gcp gives 30 s: a 45.5 s grace period is not ticked but flagged, with both."""
    dst = render(tmp_path / "p", cloud="gcp", grace_period_seconds=45.5, docs_language=language)
    checklist = (dst / "docs" / "CHECKLIST.md").read_text(encoding="utf-8")
    assert grace_box(checklist) == " "
    flagged = [line for line in checklist.splitlines() if "❌" in line and "45.5" in line]
    assert len(flagged) == 1 and "30" in flagged[0], flagged
    assert ("at most 30" if language == "en" else "不超过 30") in flagged[0]
    # Within the notice: no such line.
    dst = render(tmp_path / "q", cloud="gcp", grace_period_seconds=30.0, docs_language=language)
    checklist = (dst / "docs" / "CHECKLIST.md").read_text(encoding="utf-8")
    assert grace_box(checklist) == "x"
    assert "❌" not in "".join(line for line in checklist.splitlines() if "notice" in line
                               or "通知" in line)


def test_notice_windows_are_the_generated_packages(default_project):
    """includes/clouds.jinja (copy time) and preemption.NOTICE_WINDOW_S (run time) agree."""
    load_plan_modules(default_project)  # registers the render's package as template_pkg
    preemption = importlib.import_module("template_pkg.preemption.watch")
    env = SandboxedEnvironment(loader=FileSystemLoader(str(REPO)))
    windows = env.get_template("includes/clouds.jinja").make_module({}).notice_window_seconds
    assert {source.value: seconds for source, seconds in preemption.NOTICE_WINDOW_S.items()} \
        == windows
