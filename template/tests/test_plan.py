"""The checkpoint interval plan: its numbers against an independent computation (interval/formulas.py),
its text (interval/report.py) and its command line (plan)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys

import pytest

from conftest import PACKAGE, ROOT, project_module, run_module, suite_env

FLAG_ORDER = ("--mtbi-hours", "--step-seconds", "--blocking-seconds", "--commit-latency-seconds",
              "--restart-seconds", "--badput-target-percent")
DEFAULTS = (8.0, 2.0, 10.0, 10.0, 120.0, 5.0)  # M (h), T, δ, L, R (s), target (%)
# The report's languages in this render: English, and Chinese where docs_language is zh.
LANGUAGES = sorted(project_module("interval.text").TEXT)


@pytest.fixture(scope="module")
def plan():
    return project_module("tools.plan")


@pytest.fixture(scope="module")
def model():
    return project_module("interval.formulas")


@pytest.fixture(scope="module")
def report():
    return project_module("interval.report")


@pytest.fixture
def run_plan(plan, capsys, monkeypatch, tmp_path):
    """Run `plan` in-process from an empty folder; return (exit code, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)  # no configs/train.yaml here: only what the test passes counts

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = plan.main(list(args))
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


def flags(values=DEFAULTS) -> list[str]:
    args = []
    for flag, value in zip(FLAG_ORDER, values):
        args += [flag, repr(float(value))]  # repr: argparse gets the exact float
    return args


# -------------------------------------------- independent reference model ----
# Written from the formulas, not from plan_model.py: math.sqrt, B rearranged over a
# common denominator, and the largest interval found by searching the integers
# instead of solving the quadratic.


def reference(mtbi_h, step, d, latency, restart, target_pct):
    mtbi, target = mtbi_h * 3600, target_pct / 100

    def b_of(tau):
        x = tau + d
        return (d * mtbi + x * (restart + latency + x / 2)) / (x * mtbi)

    if d < 2 * mtbi:
        r = d / (2 * mtbi)
        tau_star = math.sqrt(2 * d * mtbi) * (1 + math.sqrt(r) / 3 + r / 9) - d
    else:
        tau_star = mtbi
    shortest = max(1, math.ceil(max(latency - d, 0) / step))
    n = max(1, round(tau_star / step), math.ceil(max(latency - d, 0) / step))

    # B(n·T) is convex in n: its integer minimum is next to the real one, at τ = √(2δM) - δ.
    x_opt = (math.sqrt(2 * d * mtbi) - d) / step
    near = {shortest, max(shortest, math.floor(x_opt)), max(shortest, math.ceil(x_opt))}
    best = min(near, key=lambda k: b_of(k * step))
    n_max = None
    if b_of(best * step) <= target:
        lo, hi = best, best + 1  # lo meets the target; grow hi until it does not
        while b_of(hi * step) <= target:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if b_of(mid * step) <= target else (lo, mid)
        n_max = lo
    bound = 2 * (target * mtbi - d) / step
    return {
        "tau_star": tau_star, "n": n, "shortest": shortest, "b": b_of, "best": best,
        "n_max": n_max, "bound": bound, "target": target, "interval_seconds": n * step,
        "badput_pct": 100 * b_of(n * step),
        "components_pct": {"saving": 100 * d / (n * step + d),
                           "rework": 100 * (n * step + d) / (2 * mtbi),
                           "commit_latency": 100 * latency / mtbi,
                           "restart": 100 * restart / mtbi},
    }


def random_inputs(rng: random.Random, k: int):
    def logu(lo, hi):
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))

    mtbi_h, step = logu(0.05, 500), logu(0.01, 60)
    d = logu(0.001, 600)
    if k % 7 == 0:  # δ >= 2M: Daly's formula gives way to τ* = M
        d = 2 * mtbi_h * 3600 * rng.uniform(1, 3)
    elif k % 11 == 0:
        d = 0.0
    latency = d if k % 3 == 0 else d + logu(0.01, 2000)  # L = δ (sync) and L > δ (async)
    restart = 0.0 if k % 13 == 0 else logu(1, 3000)
    target = logu(0.05, 60)
    return mtbi_h, step, d, latency, restart, target


def test_json_matches_independent_computation_on_random_inputs(run_plan):
    rng = random.Random(20261129)
    seen = {"delta_ge_2m": 0, "latency_gt_delta": 0, "reachable": 0, "unreachable": 0,
            "commit_floor": 0}
    for k in range(300):
        values = random_inputs(rng, k)
        code, out, err = run_plan(*flags(values), "--json")
        assert code == 0, (values, err)
        got = json.loads(out)
        ref = reference(*values)
        where = f"case {k}: {values}"

        assert got["young_daly_interval_seconds"] == pytest.approx(ref["tau_star"], rel=1e-9,
                                                                     abs=1e-9), where
        ratio = ref["tau_star"] / values[1]
        # round() may only differ where τ*/T sits on a .5 tie, up to rounding.
        if got["interval_steps"] != ref["n"]:
            assert abs(ratio - math.floor(ratio) - 0.5) < 1e-9, where
        assert got["interval_seconds"] == pytest.approx(got["interval_steps"] * values[1]), where
        assert got["shortest_interval_steps"] == ref["shortest"], where
        assert got["interval_steps"] >= ref["shortest"], where
        if got["interval_steps"] == ref["n"]:
            assert got["expected_badput_percent"] == pytest.approx(ref["badput_pct"], rel=1e-9)
            for name, value in ref["components_pct"].items():
                assert got["badput_components_percent"][name] == pytest.approx(
                    value, rel=1e-9, abs=1e-12), (where, name)
        assert sum(got["badput_components_percent"].values()) == pytest.approx(
            got["expected_badput_percent"], rel=1e-9), where

        b, target, step = ref["b"], ref["target"], values[1]
        n_max = got["max_interval_steps_for_target"]
        if n_max is None:
            assert ref["n_max"] is None or b(ref["n_max"] * step) == pytest.approx(target), where
            assert got["unreachable_reason"], where
            seen["unreachable"] += 1
        else:
            # Equal to the search, or on the boundary where both are right up to rounding.
            assert n_max >= ref["shortest"], where
            assert b(n_max * step) <= target * (1 + 1e-9), where
            assert b((n_max + 1) * step) > target * (1 - 1e-9), where
            assert ref["n_max"] is not None and abs(n_max - ref["n_max"]) <= 1, where
            seen["reachable"] += 1
        bound = got["simple_bound_max_interval_steps"]
        if bound is None:
            assert ref["bound"] < 1 + 1e-9, where
        else:
            assert ref["bound"] - 1 - 1e-9 < bound <= ref["bound"] + 1e-9, where
        seen["delta_ge_2m"] += values[2] >= 2 * values[0] * 3600
        seen["latency_gt_delta"] += values[3] > values[2]
        seen["commit_floor"] += ref["shortest"] > 1
    # The random inputs did reach every branch.
    assert min(seen.values()) >= 5, seen


def test_daly_matches_the_paper_example(model):
    # Daly (2006), fig. 3: M = 24 h, δ = 5 min gives an optimum of about 117 min.
    assert model.daly_interval(300, 24 * 3600) / 60 == pytest.approx(116.7, abs=0.05)
    # Young's first-order term alone: √(2 · 300 · 86400) = 7200 s.
    assert model.young_interval(300, 24 * 3600) == pytest.approx(7200)


def test_job_on_n_nodes_plans_with_the_nodes_mtbi_divided_by_n(model):
    """mtbi_hours is one node's: 4 nodes of 32 h each are a job interrupted every 8 h."""
    one = model.make_plan(model.Inputs(*DEFAULTS))
    four = model.make_plan(model.Inputs(32.0, *DEFAULTS[1:], nodes=4))
    assert four.inputs.mtbi_seconds == one.inputs.mtbi_seconds == 8 * 3600
    assert four.inputs.job_mtbi_hours == 8.0
    assert (four.interval_steps, four.expected_badput) == (one.interval_steps, one.expected_badput)
    # More nodes at the same per-node MTBI: interrupted more often, saving more often.
    assert model.make_plan(model.Inputs(*DEFAULTS, nodes=4)).interval_steps < one.interval_steps


def test_nodes_from_the_flag_and_the_config(run_plan, tmp_path):
    _, out, _ = run_plan(*flags((32.0, *DEFAULTS[1:])), "--nodes", "4", "--json")
    _, expected, _ = run_plan(*flags(), "--json")
    got = json.loads(out)
    assert got["inputs"]["nodes"] == 4 and got["inputs"]["job_mtbi_hours"] == 8.0
    assert got["interval_steps"] == json.loads(expected)["interval_steps"]
    _, text, _ = run_plan(*flags((32.0, *DEFAULTS[1:])), "--nodes", "4")
    assert "M = 8 h (28800 s), one node's 32 h / 4 nodes" in text
    config = tmp_path / "train.yaml"
    config.write_text(PLAN_SECTION + "  nodes: 4\n")
    _, out, _ = run_plan("--config", str(config), "--json")
    assert json.loads(out)["inputs"]["nodes"] == 4
    assert json.loads(out)["inputs"]["mtbi_seconds"] == 2 * 3600
    code, _, err = run_plan(*flags(), "--nodes", "0")
    assert code == 2 and "argument --nodes: must be a whole number >= 1" in err
    code, _, err = run_plan("--config", str(config), "plan.nodes=0")
    assert code == 2 and "plan.nodes must be a whole number >= 1" in err


def test_save_longer_than_twice_mtbi_uses_mtbi(model):
    assert model.daly_interval(delta=8000, mtbi=3600) == 3600


def test_free_saves_mean_saving_every_step(model):
    p = model.make_plan(model.Inputs(8, 2, 0, 0, 120, 5))
    assert p.interval_steps == 1
    assert p.components["saving"] == 0


def test_slow_commit_sets_the_shortest_interval(model):
    # δ = 1 s but L = 301 s: a save every 300 steps at least, whatever τ* says.
    p = model.make_plan(model.Inputs(mtbi_hours=1, step_seconds=1, blocking_seconds=1,
                                     commit_latency_seconds=301, restart_seconds=10,
                                     badput_target_percent=50))
    assert p.daly_interval_seconds < 300
    assert p.interval_steps == p.shortest_interval_steps == 300


def test_unreachable_target_says_why(model, report):
    # R/M alone is 10 % here, above the 5 % target.
    p = model.make_plan(model.Inputs(1, 2, 10, 10, 360, 5))
    assert p.max_interval_steps is None
    reason = report.explain_unreachable(p)
    assert "restart" in reason
    assert f"{100 * p.min_badput:.2f} %" in reason
    assert all(report.explain_unreachable(p, lang) for lang in LANGUAGES)


def test_components_add_up(model):
    p = model.make_plan(model.Inputs(*DEFAULTS))
    assert sum(p.components.values()) == pytest.approx(p.expected_badput, rel=1e-12)


@pytest.mark.parametrize(("change", "flag"), [
    ({0: 0}, "--mtbi-hours"),
    ({0: -3}, "--mtbi-hours"),
    ({0: float("nan")}, "--mtbi-hours"),
    ({1: 0}, "--step-seconds"),
    ({2: -1}, "--blocking-seconds"),
    ({3: -1}, "--commit-latency-seconds"),
    ({3: 5}, "--commit-latency-seconds"),  # L < δ = 10
    ({4: -0.5}, "--restart-seconds"),
    ({5: 0}, "--badput-target-percent"),
    ({5: 100}, "--badput-target-percent"),
    ({5: 250}, "--badput-target-percent"),
    ({1: float("inf")}, "--step-seconds"),
])
def test_bad_input_names_the_flag(run_plan, change, flag):
    values = [change.get(i, v) for i, v in enumerate(DEFAULTS)]
    code, out, err = run_plan(*flags(values))
    assert code == 2
    assert f"argument {flag}:" in err
    assert "Traceback" not in err
    assert out == ""


def test_missing_input_without_config_is_an_error(run_plan):
    code, _, err = run_plan("--step-seconds", "2")
    assert code == 2
    assert "missing --mtbi-hours" in err


def test_errors_and_help_from_a_real_process(tmp_path):
    proc = run_module("plan", "--mtbi-hours", "8", "--step-seconds", "-1", "--blocking-seconds",
                      "1", "--restart-seconds", "1", "--badput-target-percent", "5",
                      cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "--step-seconds" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "--badput-target-percent" in run_module("plan", "--help", cwd=tmp_path).stdout


def test_plan_and_goodput_import_no_torch(tmp_path):
    """The commands that only read settings and records start without torch (about 2.5 s
    of CPU a start): plan, run for real in the project, and goodput."""
    code = ("import runpy, sys\n"
            "for command, args in (('plan', ['--json']), ('goodput', ['--help'])):\n"
            "    sys.argv = [command, *args]\n"
            "    try:\n"
            f"        runpy.run_module('{PACKAGE}.' + command, run_name='__main__')\n"
            "    except SystemExit as end:\n"
            "        assert end.code in (0, None), (command, end.code)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=suite_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[]"


def test_text_output_shows_the_plan(run_plan, model):
    code, out, _ = run_plan(*flags())
    p = model.make_plan(model.Inputs(*DEFAULTS))
    assert code == 0
    assert f"{p.interval_steps} steps" in out
    assert f"{100 * p.expected_badput:.2f} %" in out


PLAN_SECTION = ("plan:\n  mtbi_hours: 8.0\n  step_time_s: 2.0\n  checkpoint_save_s: 10.0\n"
                "  restart_s: 120.0\n  badput_target_percent: 5.0\n")


def test_config_supplies_inputs_and_flags_override_it(run_plan, tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("checkpoint:\n  interval_steps: 100\n" + PLAN_SECTION)
    _, out, _ = run_plan("--config", str(config), "--json")
    _, expected, _ = run_plan(*flags(), "--json")
    assert json.loads(out) == json.loads(expected)
    _, out, _ = run_plan("--config", str(config), "--step-seconds", "4", "--json")
    assert json.loads(out)["inputs"]["step_seconds"] == 4
    # key=value overrides, as for training.
    _, out, _ = run_plan("--config", str(config), "--json", "plan.restart_s=300")
    assert json.loads(out)["inputs"]["restart_seconds"] == 300
    code, _, err = run_plan("--config", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "--config" in err


@pytest.mark.parametrize(("section", "key"), [
    ("  mtbi_hours: .nan\n", "plan.mtbi_hours"),
    ("  mtbi_hours: 0\n", "plan.mtbi_hours"),
    ("  step_time_s: .inf\n", "plan.step_time_s"),
    ("  step_time_s: -2\n", "plan.step_time_s"),
    ("  checkpoint_save_s: -1\n", "plan.checkpoint_save_s"),
    ("  checkpoint_save_s: .inf\n", "plan.checkpoint_save_s"),
    ("  restart_s: .nan\n", "plan.restart_s"),
    ("  restart_s: -0.5\n", "plan.restart_s"),
    ("  badput_target_percent: 100\n", "plan.badput_target_percent"),
    ("  badput_target_percent: .nan\n", "plan.badput_target_percent"),
    ("  badput_target_percent: -.inf\n", "plan.badput_target_percent"),
    ("  step_time_seconds: 2.0\n", "step_time_seconds"),  # the old spelling: an unknown key
])
def test_bad_plan_config_names_the_key(run_plan, tmp_path, section, key):
    config = tmp_path / "train.yaml"
    config.write_text("plan:\n" + section)
    code, out, err = run_plan("--config", str(config))
    assert code == 2
    assert err.startswith("error: ") and key in err
    assert "Traceback" not in err
    assert out == ""
    if "." in key:  # a range: the message says which values are accepted
        assert "must be" in err


def test_bad_plan_override_names_the_key(run_plan, tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(PLAN_SECTION)
    code, _, err = run_plan("--config", str(config), "plan.mtbi_hours=inf")
    assert code == 2
    assert "plan.mtbi_hours must be a finite number > 0" in err


# ------------------------------------------------------------------ metrics ----


def write_metrics(path, *, warmup=(9.0, 30.0), saves=((0.5, 4.0), (0.7, 5.0), (0.6, 6.0)),
                  step_times=(2.0, 2.4, 1.9, 2.1, 2.2), restart=True, tail=""):
    events = [{"event": "start", "step": 0, "world_size": 2}]
    events += [{"event": "step", "step": i + 1, "loss": 1.0, "grad_norm": 1.0,
                "step_time_s": t, "samples_per_s": 1.0, "lr": 0.1} for i, t in enumerate(step_times)]
    if warmup:
        events.append({"event": "save", "step": 10, "reason": "interval", "mode": "process",
                       "blocking_s": warmup[0], "commit_latency_s": warmup[1]})
    events += [{"event": "save", "step": 20 + 10 * i, "reason": "interval", "mode": "process",
                "blocking_s": b, "commit_latency_s": c} for i, (b, c) in enumerate(saves)]
    events.append({"event": "save", "step": 99, "reason": "final", "mode": "sync",
                   "blocking_s": 50.0, "commit_latency_s": 50.0})
    if restart:  # its first save is a warm-up again
        events += [{"event": "start", "step": 99},
                   {"event": "save", "step": 110, "reason": "interval", "mode": "process",
                    "blocking_s": 8.0, "commit_latency_s": 25.0}]
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + tail)
    return path


def test_metrics_give_medians_without_warmup_saves(run_plan, tmp_path):
    metrics = write_metrics(tmp_path / "metrics.jsonl", tail='{"event": "step", "ste')
    code, out, err = run_plan("--metrics", str(metrics), "--mtbi-hours", "8",
                              "--restart-seconds", "120", "--badput-target-percent", "5",
                              "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["inputs"]["step_seconds"] == 2.1
    assert got["inputs"]["blocking_seconds"] == 0.6
    assert got["inputs"]["commit_latency_seconds"] == 5.0
    assert got["measured"]["warmup_excluded"] == 2
    assert got["measured"]["skipped_lines"] == 1
    assert got["measured"]["save_reason"] == "interval"
    # The folder works as well as the file.
    _, again, _ = run_plan("--metrics", str(tmp_path), "--mtbi-hours", "8", "--restart-seconds",
                           "120", "--badput-target-percent", "5", "--json")
    assert json.loads(again)["inputs"] == got["inputs"]


def test_metrics_without_interval_saves_use_all_saves(model, tmp_path):
    metrics = write_metrics(tmp_path / "metrics.jsonl", warmup=None, saves=(), restart=False)
    measured = model.read_metrics(metrics)
    assert measured.save_reason == "all"
    # The final save is the run's only save, hence its first: kept, and said to be a warm-up.
    assert measured.save_count == 1
    assert measured.warmup_only
    assert measured.blocking_seconds == 50.0


def test_metrics_give_the_memory_tier_its_measured_stall_and_send_time(run_plan, model,
                                                                       tmp_path):
    metrics = write_metrics(tmp_path / "metrics.jsonl", restart=False)
    memory = [(0.9, 5.0, 5.0), (0.03, 0.02, 0.2), (0.05, 0.03, 0.1), (0.04, 0.01, 0.3)]
    events = [{"event": "memory_save", "step": 20 + i, "stall_s": stall, "commit_s": commit,
               "replicate_s": send, "error": None}   # the first of the start: a warm-up
              for i, (stall, commit, send) in enumerate(memory)]
    events.append({"event": "memory_save", "step": 30, "stall_s": 9.0, "commit_s": 9.0,
                   "replicate_s": 9.0, "error": "lost"})
    with open(metrics, "a", encoding="utf-8") as out:
        out.writelines(json.dumps(e) + "\n" for e in events)
    measured = model.read_metrics(metrics)
    assert measured.memory_save_count == 3
    assert measured.memory_blocking_seconds == 0.04
    assert measured.memory_send_seconds == pytest.approx(0.22)
    code, out, err = run_plan("--metrics", str(metrics), "--mtbi-hours", "8",
                              "--restart-seconds", "120", "--badput-target-percent", "5",
                              "--json")
    assert code == 0, err
    two = json.loads(out)["two_tier"]
    assert two["memory_blocking_seconds"] == 0.04
    assert two["memory_send_seconds"] == pytest.approx(0.22)


@pytest.mark.parametrize(("content", "fragment"), [
    (None, "no such file"),
    ('{"event": "start"}\n', "no step events"),
    ('{"event": "step", "step": 1, "step_time_s": 2.0}\n', "no save events"),
])
def test_unusable_metrics_are_clear_errors(run_plan, tmp_path, content, fragment):
    metrics = tmp_path / "metrics.jsonl"
    if content is not None:
        metrics.write_text(content)
    code, _, err = run_plan("--metrics", str(metrics), *flags()[:2])
    assert code == 2
    assert "--metrics" in err
    assert fragment in err
    assert "Traceback" not in err


@pytest.mark.parametrize("lang", LANGUAGES)
def test_write_refreshes_only_the_measured_section(run_plan, tmp_path, lang):
    metrics = write_metrics(tmp_path / "metrics.jsonl")
    head = f"# Checklist\n\nkept before\n\n<!-- measured:begin lang={lang} -->\n"
    tail = "<!-- measured:end -->\n\nkept after\n"
    checklist = tmp_path / "CHECKLIST.md"
    checklist.write_text(head + "nothing measured yet\n" + tail, encoding="utf-8")
    code, out, err = run_plan("--metrics", str(metrics), *flags()[:2], "--restart-seconds", "120",
                              "--badput-target-percent", "5", "--write", str(checklist), "--json")
    assert code == 0, err
    text = checklist.read_text(encoding="utf-8")
    assert text.startswith(head)
    assert text.endswith(tail)
    assert "nothing measured yet" not in text
    interval = json.loads(out)["interval_steps"]
    assert (f"**{interval} 步**" if lang == "zh" else f"**{interval} steps**") in text
    # Refreshing again replaces the section instead of adding another.
    run_plan("--metrics", str(metrics), *flags()[:2], "--restart-seconds", "120",
             "--badput-target-percent", "5", "--write", str(checklist))
    assert checklist.read_text(encoding="utf-8") == text
    assert not list(tmp_path.glob(".CHECKLIST.md.*"))  # no temporary file left behind


def test_write_needs_markers_and_metrics(run_plan, tmp_path):
    metrics = write_metrics(tmp_path / "metrics.jsonl")
    checklist = tmp_path / "CHECKLIST.md"
    checklist.write_text("# no markers here\n")
    code, _, err = run_plan("--metrics", str(metrics), *flags(), "--write", str(checklist))
    assert code == 2
    assert "measured:begin" in err
    assert checklist.read_text() == "# no markers here\n"
    code, _, err = run_plan(*flags(), "--write", str(checklist))
    assert code == 2
    assert "--write needs --metrics" in err


# --------------------------------------------------------------------- plot ----


@pytest.mark.parametrize(("name", "magic"), [("badput.png", b"\x89PNG"), ("badput.svg", b"<svg")])
def test_plot_writes_a_picture(run_plan, tmp_path, name, magic):
    pytest.importorskip("matplotlib")
    target = tmp_path / name
    code, _, err = run_plan(*flags(), "--plot", str(target))
    assert code == 0, err
    data = target.read_bytes()
    assert len(data) > 1000
    assert magic in data[:400]


def test_plot_without_matplotlib_says_how_to_get_it(run_plan, monkeypatch, tmp_path):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # makes the import fail
    code, _, err = run_plan(*flags(), "--plot", str(tmp_path / "b.png"))
    assert code == 1
    assert "pip install -e '.[plot]'" in err


def test_plot_rejects_other_formats(run_plan, tmp_path):
    code, _, err = run_plan(*flags(), "--plot", str(tmp_path / "b.jpg"))
    assert code == 2
    assert "--plot" in err


# ---------------------------------------------------------------- two tiers ----
# An independent B2, written from the docstring's formula: each kind of interruption
# by what survives it, summed over the kinds.


def reference_b2(inputs, tau_d, tau_m, r_in=None):
    """B2(τ_d, τ_m); tau_m None: the memory tier off, every kind back to the durable save."""
    mtbi = inputs.mtbi_hours * 3600 / inputs.nodes
    d, latency, r = inputs.blocking_seconds, inputs.commit_latency_seconds, inputs.restart_seconds
    dm = d if inputs.memory_blocking_seconds is None else inputs.memory_blocking_seconds
    lm = dm + inputs.memory_send_seconds
    r_in = r if r_in is None else r_in
    back_to_durable = (tau_d + d) / 2 + latency
    back_to_memory = back_to_durable if tau_m is None else (tau_m + dm) / 2 + lm
    kinds = [  # (share, restart, work lost)
        (inputs.crash_share, r_in, back_to_memory),
        (inputs.node_loss_share, r, back_to_memory if inputs.nodes >= 2 else back_to_durable),
        (1 - inputs.crash_share - inputs.node_loss_share, r, back_to_durable),
    ]
    stalls = d / (tau_d + d) + (0 if tau_m is None else dm / (tau_m + dm))
    return stalls + sum(share * (restart + lost) for share, restart, lost in kinds) / mtbi


def test_two_tier_without_the_memory_tier_is_the_one_tier_badput(model):
    i = model.Inputs(*DEFAULTS, nodes=2)
    for tau in (2.0, 100.0, 752.0, 5000.0):
        # R_in not known: every interruption rescheduled, B itself.
        assert model.two_tier_badput(tau, None, i) == pytest.approx(model.badput(tau, i),
                                                                    rel=1e-12)
        # R_in known: B - S, the one-tier plan with in-place restarts.
        assert model.two_tier_badput(tau, None, i, 30.0) == pytest.approx(
            model.badput(tau, i) - model.in_place_saving(i, 30.0), rel=1e-12)
    # A memory tier that covers nothing and costs nothing changes nothing.
    free = model.Inputs(*DEFAULTS, crash_share=0.0, node_loss_share=0.0,
                        memory_blocking_seconds=0.0, nodes=2)
    for tau_m in (2.0, 50.0, 1e6):
        assert model.two_tier_badput(752.0, tau_m, free) == pytest.approx(
            model.two_tier_badput(752.0, None, free), rel=1e-12)
    # The plan's B1 is at the one-tier interval N.
    p = model.make_plan(i)
    two = model.make_two_tier(p)
    assert two.badput_without == pytest.approx(p.expected_badput, rel=1e-12)


def test_two_tier_badput_matches_the_independent_formula(model):
    rng = random.Random(7)
    for k in range(200):
        c = rng.uniform(0, 1)
        i = model.Inputs(rng.uniform(0.5, 100), rng.uniform(0.1, 10), rng.uniform(0, 60),
                         0, rng.uniform(0, 600), 5, crash_share=c,
                         node_loss_share=rng.uniform(0, 1 - c), nodes=rng.choice([1, 2, 16]),
                         memory_blocking_seconds=None if k % 2 else rng.uniform(0, 5),
                         memory_send_seconds=rng.uniform(0, 3))
        i = dataclasses.replace(i, commit_latency_seconds=i.blocking_seconds + rng.uniform(0, 60))
        tau_d, tau_m = rng.uniform(1, 1e4), rng.uniform(1, 1e4)
        r_in = None if k % 3 else rng.uniform(0, 100)
        for tm in (tau_m, None):
            assert model.two_tier_badput(tau_d, tm, i, r_in) == pytest.approx(
                reference_b2(i, tau_d, tm, r_in), rel=1e-9, abs=1e-15), (k, i)


def test_memory_tier_lowers_badput_when_memory_saves_are_cheap(model):
    # 2 nodes, a memory save blocks 0.2 s against a durable save's 10 s.
    cheap = model.Inputs(16.0, *DEFAULTS[1:], nodes=2, memory_blocking_seconds=0.2)
    p = model.make_plan(cheap)
    two = model.make_two_tier(p)
    assert two.pays and two.badput_with < two.badput_without
    assert two.recommended_memory_interval_steps == two.optimal_memory_interval_steps > 0
    assert two.recommended_memory_interval_steps < p.interval_steps
    # Durable saves come less often: they now cover only the job losses.
    assert two.recommended_durable_interval_steps > p.interval_steps
    assert two.break_even_memory_blocking_seconds > 0.2
    # A memory save as slow as a durable one (the default, δ_m = δ) does not pay: to first
    # order √a + √(1 - a) >= 1. The recommendation is then 0, off.
    same = model.make_two_tier(model.make_plan(dataclasses.replace(
        cheap, memory_blocking_seconds=None)))
    assert not same.pays and same.badput_with > same.badput_without
    assert same.recommended_memory_interval_steps == 0
    assert same.recommended_durable_interval_steps == p.interval_steps
    assert same.break_even_memory_blocking_seconds < cheap.blocking_seconds


def test_one_node_node_losses_fall_back_to_durable(model):
    """With one node there is no partner: a node loss costs what a job loss costs."""
    one = model.Inputs(*DEFAULTS, nodes=1, memory_blocking_seconds=0.2)
    two_nodes = model.Inputs(16.0, *DEFAULTS[1:], nodes=2, memory_blocking_seconds=0.2)
    assert one.mtbi_seconds == two_nodes.mtbi_seconds  # the same job MTBI
    kinds = {k.kind: k for k in model.make_two_tier(model.make_plan(one)).failure_kinds}
    assert kinds["node_loss"].keeps == kinds["job_loss"].keeps == "durable"
    assert kinds["crash"].keeps == "node_memory"
    assert kinds["node_loss"].lost_seconds_with == kinds["job_loss"].lost_seconds_with
    assert model.memory_share(one) == 0.5 and model.durable_share(one) == 0.5
    assert model.memory_share(two_nodes) == 0.7
    kinds2 = {k.kind: k for k in model.make_two_tier(model.make_plan(two_nodes)).failure_kinds}
    assert kinds2["node_loss"].keeps == "partner_copy"
    assert kinds2["node_loss"].lost_seconds_with == kinds2["crash"].lost_seconds_with
    # At the same intervals, losing the partner's cover costs badput.
    assert model.two_tier_badput(1000.0, 100.0, one) > model.two_tier_badput(1000.0, 100.0,
                                                                              two_nodes)
    assert model.two_tier_badput(1000.0, 100.0, one) == pytest.approx(
        reference_b2(one, 1000.0, 100.0), rel=1e-12)
    # One node holds no partner's copies.
    assert model.memory_shards_per_rank(1) == {"own": 2, "partner": 0, "own_peak": 2,
                                               "partner_peak": 0}
    assert model.memory_shards_per_rank(4) == {"own": 2, "partner": 2, "own_peak": 2,
                                               "partner_peak": 2}


def test_two_tier_recommendation(model):
    i = model.Inputs(16.0, *DEFAULTS[1:], nodes=2, memory_blocking_seconds=0.5,
                     memory_send_seconds=3.0)
    p = model.make_plan(i)
    two = model.make_two_tier(p)
    mtbi, step = i.mtbi_seconds, i.step_seconds

    def daly(delta, m):  # Daly (2006), written out again
        return math.sqrt(2 * delta * m) * (1 + math.sqrt(delta / (2 * m)) / 3
                                           + delta / (2 * m) / 9) - delta

    # The memory tier covers crashes and node losses: rate (c + ν)/M; durable the rest.
    assert two.memory_interval_seconds == pytest.approx(daly(0.5, mtbi / 0.7), rel=1e-12)
    assert two.durable_interval_seconds == pytest.approx(daly(10.0, mtbi / 0.3), rel=1e-12)
    assert two.optimal_memory_interval_steps == max(round(two.memory_interval_seconds / step),
                                                    math.ceil(3.0 / step))
    assert two.optimal_durable_interval_steps == round(two.durable_interval_seconds / step)
    # Each near its own integer optimum of B2 (the two parts are separate).
    n_m, n_d = two.optimal_memory_interval_steps, two.optimal_durable_interval_steps
    best = reference_b2(i, n_d * step, n_m * step)
    assert two.badput_with == pytest.approx(best, rel=1e-12)
    for dm, dd in ((n_m // 2, 0), (2 * n_m, 0), (0, n_d // 2), (0, 2 * n_d)):
        other = reference_b2(i, (dd or n_d) * step, (dm or n_m) * step)
        assert best < other
    # No interruption the memory tier covers: no memory interval, off.
    none = model.make_two_tier(model.make_plan(dataclasses.replace(
        i, crash_share=0.0, node_loss_share=0.0)))
    assert none.optimal_memory_interval_steps is None and none.badput_with is None
    assert none.recommended_memory_interval_steps == 0 and not none.pays
    # No job losses: nothing prices rare durable saves, so N_d stays the one-tier N.
    all_memory = dataclasses.replace(i, crash_share=0.7, node_loss_share=0.3)
    q = model.make_plan(all_memory)
    assert model.make_two_tier(q).optimal_durable_interval_steps == q.interval_steps


def test_plan_prints_the_two_tiers(run_plan, model, tmp_path):
    args = (*flags((16.0, *DEFAULTS[1:])), "--nodes", "2", "--memory-blocking-seconds", "0.2")
    code, out, err = run_plan(*args, "--json")
    assert code == 0, err
    got = json.loads(out)["two_tier"]
    i = model.Inputs(16.0, *DEFAULTS[1:], nodes=2, memory_blocking_seconds=0.2)
    two = model.make_two_tier(model.make_plan(i))
    assert got["badput_without_memory_percent"] == 100 * two.badput_without
    assert got["badput_with_memory_percent"] == 100 * two.badput_with
    assert got["memory_tier_pays"] is True
    assert got["recommended_memory_interval_steps"] == two.optimal_memory_interval_steps > 0
    assert got["memory_share"] == 0.7 and got["node_loss_share"] == 0.2
    assert [k["kind"] for k in got["failure_kinds"]] == ["crash", "node_loss", "job_loss"]
    assert [k["keeps"] for k in got["failure_kinds"]] == ["node_memory", "partner_copy",
                                                         "durable"]
    assert sum(k["share"] for k in got["failure_kinds"]) == pytest.approx(1)
    assert got["memory_shards_per_rank"] == {"own": 2, "partner": 2, "own_peak": 2,
                                             "partner_peak": 2}
    assert got["configured_badput_percent"] is None  # the memory tier is off unless configured
    code, text, _ = run_plan(*args)
    assert code == 0
    assert "Two tiers: memory and durable" in text
    for needed in ("crash", "node loss", "job loss", f"{100 * two.badput_without:.2f} %",
                   f"{100 * two.badput_with:.2f} %", "2 + 2 shards", "two slots each",
                   f"checkpoint.memory_interval_steps: {two.optimal_memory_interval_steps}"):
        assert needed in text, needed
    # The configured memory interval: from the config (with its durable interval) or the
    # flag (a project without the memory tier refuses the key: config/parts.py).
    parts = project_module("config.parts")
    rendered = parts.rendered(parts.MEMORY_TIER)
    config = tmp_path / "train.yaml"
    config.write_text("checkpoint:\n  interval_steps: 400\n"
                      + ("  memory_interval_steps: 50\n" if rendered else "")
                      + PLAN_SECTION + "  node_loss_share: 0.3\n")
    memory = [] if rendered else ["--memory-interval-steps", "50"]
    code, out, err = run_plan("--config", str(config), *memory, "--json")
    assert code == 0, err
    got = json.loads(out)["two_tier"]
    i = model.Inputs(*DEFAULTS, node_loss_share=0.3)
    assert (got["configured_memory_interval_steps"], got["configured_durable_interval_steps"]) \
        == (50, 400)
    assert got["configured_badput_percent"] == pytest.approx(
        100 * reference_b2(i, 400 * 2.0, 50 * 2.0), rel=1e-12)
    _, text, _ = run_plan("--config", str(config), *memory)
    assert "at the configured memory interval, 50 steps (durable every 400 steps)" in text
    _, out, _ = run_plan("--config", str(config), "--memory-interval-steps", "0", "--json")
    assert json.loads(out)["two_tier"]["configured_badput_percent"] is None
    _, out, _ = run_plan(*flags(), "--memory-interval-steps", "20", "--json")
    got = json.loads(out)
    assert got["two_tier"]["configured_durable_interval_steps"] == got["interval_steps"]


@pytest.mark.parametrize(("args", "flag"), [
    (("--node-loss-share", "1.5"), "--node-loss-share"),
    (("--node-loss-share", "-0.1"), "--node-loss-share"),
    (("--node-loss-share", "0.6"), "--node-loss-share"),  # c + ν = 1.1 with c = 0.5
    (("--crash-share", "0.9"), "--node-loss-share"),      # with ν = 0.2
    (("--memory-interval-steps", "-1"), "--memory-interval-steps"),
    (("--memory-blocking-seconds", "-1"), "--memory-blocking-seconds"),
    (("--memory-send-seconds", "nan"), "--memory-send-seconds"),
])
def test_bad_two_tier_input_names_the_flag(run_plan, args, flag):
    code, out, err = run_plan(*flags(), *args)
    assert code == 2
    assert f"argument {flag}:" in err
    assert "Traceback" not in err
    assert out == ""


@pytest.mark.parametrize("section", [
    "  node_loss_share: 1.5\n", "  node_loss_share: -0.1\n", "  node_loss_share: .nan\n",
    "  node_loss_share: 0.6\n",                       # c + ν > 1 with c = 0.5
    "  crash_share: 0.9\n",                           # with the default ν = 0.2
])
def test_bad_node_loss_share_names_the_key(run_plan, tmp_path, section):
    config = tmp_path / "train.yaml"
    config.write_text("plan:\n" + section)
    code, out, err = run_plan("--config", str(config))
    assert code == 2
    assert err.startswith("error: plan.node_loss_share must be")
    assert "Traceback" not in err
    assert out == ""
    # At most 1: the shares of crashes, node losses and job losses add up to one.
    ok = tmp_path / "ok.yaml"
    ok.write_text("plan:\n  crash_share: 0.7\n  node_loss_share: 0.3\n")
    assert run_plan("--config", str(ok), *flags(), "--json")[0] == 0
