"""The checkpoint interval plan: its numbers against an independent computation (plan_model),
its text (plan_report) and its command line (plan)."""

from __future__ import annotations

import json
import math
import random
import sys

import pytest

from conftest import project_module, run_module

FLAG_ORDER = ("--mtbi-hours", "--step-seconds", "--blocking-seconds", "--commit-latency-seconds",
              "--restart-seconds", "--badput-target-percent")
DEFAULTS = (8.0, 2.0, 10.0, 10.0, 120.0, 5.0)  # M (h), T, δ, L, R (s), target (%)


@pytest.fixture(scope="module")
def plan():
    return project_module("interval.command")


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
    assert report.explain_unreachable(p, "zh")


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


@pytest.mark.parametrize("lang", ["en", "zh"])
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
