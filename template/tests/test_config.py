import re
from types import SimpleNamespace

import pytest
import torch

from conftest import PROJECT, ROOT, project_module, run_module


@pytest.fixture
def config_module():
    return project_module("config")


def test_defaults_load_and_overrides_apply(config_module):
    cfg = config_module.load_config(ROOT / "configs/train.yaml",
                                    ["train.max_steps=7", "checkpoint.async_mode=sync"])
    assert cfg.train.max_steps == 7
    assert cfg.checkpoint.async_mode == config_module.AsyncMode.sync


@pytest.mark.parametrize("override, fragment", [
    ("train.max_stepz=3", "max_stepz"),                 # unknown key
    ("train.max_steps=abc", "train.max_steps"),        # wrong type
    ("train.max_steps=0", "train.max_steps"),          # out of range
    ("checkpoint.keep_last=0", "checkpoint.keep_last"),
    ("checkpoint.async_mode=fast", "async_mode"),
    ("train.global_batch_size=15", "train.global_batch_size"),
    ("preemption.signals=[SIGKILL]", "preemption.signals"),
    ("preemption.exit_code=1", "preemption.exit_code"),
    ("nokey", "key=value"),
    ("max_steps=3", "did you mean train.max_steps"),   # a key without its section
    ("checkpoint.dir=", "checkpoint.dir: no value given"),
    ("checkpoint.dir=ftp://host/x", "checkpoint.dir must be a path"),  # not silently local
    ("checkpoint.dir=S3://bucket/x", "checkpoint.dir must be a path"),
])
def test_bad_values_are_refused_naming_the_key(config_module, override, fragment):
    with pytest.raises(config_module.ConfigError, match=fragment.replace("[", r"\[")):
        config_module.load_config(ROOT / "configs/train.yaml", [override])


def test_unknown_key_suggests_the_right_one(config_module):
    with pytest.raises(config_module.ConfigError) as info:
        config_module.load_config(ROOT / "configs/train.yaml", ["train.max_stepz=3"])
    assert "max_steps" in str(info.value)


@pytest.mark.parametrize("override, fragment", [
    ("model.d_model=30", "model.d_model must be a multiple of model.n_heads"),
    ("model.dropout=1.5", "model.dropout"),
    ("model.widht=3", "model.widht"),                   # unknown key of the task's section
    ("model.n_layers=abc", "model.n_layers"),
    ("data.seq_len=1", "data.seq_len"),
])
def test_the_tasks_sections_are_checked_by_the_task(tmp_path, override, fragment):
    """model: and data: belong to task.py, which refuses bad values with the harness's
    messages: exit 2, the key named, no traceback."""
    proc = run_module("train", override, f"log.dir={tmp_path}",
                      f"checkpoint.dir={tmp_path / 'ck'}", check=False)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr and "Traceback" not in proc.stderr


def test_the_harness_accepts_any_key_in_the_tasks_sections(config_module):
    cfg = config_module.load_config(ROOT / "configs/train.yaml",
                                    ["model.vocab=50000", "data.shards=[a, b]"])
    assert cfg.model["vocab"] == 50000 and cfg.data["shards"] == ["a", "b"]


def test_train_cli_reports_bad_config_with_exit_2(tmp_path):
    proc = run_module("train", "train.lr=-1", f"log.dir={tmp_path}", check=False)
    assert proc.returncode == 2
    assert "train.lr" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl is usable with CUDA")
def test_nccl_without_cuda_is_refused_in_one_sentence(tmp_path):
    proc = run_module("train", "distributed.backend=nccl", f"log.dir={tmp_path / 'logs'}",
                      f"checkpoint.dir={tmp_path / 'ckpt'}", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "distributed.backend=nccl needs CUDA" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.torch_api
def test_a_torch_older_than_the_projects_minimum_is_refused_in_one_sentence(
        tmp_path, monkeypatch, capsys):
    compat = project_module("runtime.torch_compat")
    assert compat.torch_too_old("2.9.0") is None and compat.torch_too_old("2.11.0+cu130") is None
    # NVIDIA's builds are named after the coming release: their numeric release counts.
    assert compat.torch_too_old("2.9.0a0+50eac811a6.nv25.09") is None
    assert compat.torch_too_old("2.12.0a0+git1a2b3c4") is None
    assert compat.torch_too_old("2.15.0") is None and compat.torch_too_old("3.0") is None
    assert compat.torch_too_old("2.8.0+cu128").startswith(
        "torch 2.8.0+cu128 is older than 2.9, the oldest release this project runs on")
    assert compat.torch_too_old("2.9.0a0") is None and compat.torch_too_old("2.8.9") is not None
    # One fact, two places: the code's minimum is pyproject.toml's, which admits 2.9's
    # pre-release builds (2.9.0a0 sorts below 2.9.0).
    floor = re.search(r'"torch>=([0-9a-z.]+)"', (PROJECT / "pyproject.toml").read_text()).group(1)
    assert floor == ".".join(map(str, compat.MIN_TORCH)) + ".0a0"
    # train, resume before it starts torchrun, and bench, under a torch that says it is 2.8.
    # (Were a check gone, its command would end at once: one step, a dry run, a refusal
    # of sync mode that names no torch.)
    for command, first in (("loop.job", "train.max_steps=1"), ("launch.supervisor", "--dry-run"),
                           ("tools.bench", "checkpoint.async_mode=sync")):
        module = project_module(command)
        monkeypatch.setattr(module, "torch_too_old",
                            lambda: compat.torch_too_old("2.8.0+cu128"))
        assert module.main([first, f"checkpoint.dir={tmp_path / 'ckpt'}",
                            f"log.dir={tmp_path / 'logs'}"]) == 2, command
        assert "torch 2.8.0+cu128 is older than 2.9" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "logs").exists()


def test_bench_refuses_an_object_store_dir_instead_of_writing_a_local_folder(tmp_path):
    proc = run_module("bench", "--dir", "s3://bucket/x", "--config",
                      str(ROOT / "configs/train.yaml"), cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--dir s3://bucket/x" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []          # no folder named "s3:" or anything else


@pytest.mark.parametrize("command, args, said", [
    ("plan", ["train.lr=-1"], "error: train.lr"),
    ("verify", ["no/such/dir"], "error: no/such/dir does not exist"),
])
def test_a_refusal_is_one_error_line_and_exit_2(command, args, said):
    """Every command refuses one way: it raises Refused, and exit_codes.refusals around
    its main says the one line and ends with the status (2 here), without a traceback."""
    proc = run_module(command, *args, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(said), proc.stderr
    assert "Traceback" not in proc.stderr
    exit_codes = project_module("runtime.exit_codes")

    @exit_codes.refusals
    def refuses(argv):
        raise exit_codes.Refused(f"a sentence for {argv}", exit_codes.NOT_SAVED)

    assert refuses(["x"]) == exit_codes.NOT_SAVED    # a refusal's own status, when it has one


@pytest.mark.parametrize("command", ["train", "resume", "drill", "plan", "bench"])
def test_commands_answer_help(command):
    proc = run_module(command, "--help")
    assert "usage" in proc.stdout.lower()


# ------------------------------------------- a config a merge or an edit broke --
# `copier update` leaves both sides of a conflict in configs/train.yaml between git's
# markers (and exits 0): every command that reads the config says where, in one line.

# The markers are built, never spelled out: this file must not look like a conflict.
START, MIDDLE, END = "<" * 7, "=" * 7, ">" * 7
CONFLICT = (f"{START} before updating\n  max_steps: 30\n{MIDDLE}\n  max_steps: 40\n"
            f"{END} after updating\n")


def with_lines(tmp_path, insert: str, before: str = "  max_steps:"):
    """ROOT's configs/train.yaml with ``insert`` put before the first line starting
    ``before``, written to ``tmp_path``; returns the path and that line's number."""
    text = (ROOT / "configs/train.yaml").read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith(before))
    path = tmp_path / "train.yaml"
    path.write_text("".join(lines[:at]) + insert + "".join(lines[at:]), encoding="utf-8")
    return path, at + 1


@pytest.mark.parametrize("marker", [f"{START} before updating", MIDDLE,
                                    f"{END} after updating", START],
                         ids=["start", "middle", "end", "start-without-label"])
def test_a_conflict_marker_is_named_with_its_line(config_module, tmp_path, marker):
    path, line = with_lines(tmp_path, marker + "\n")
    with pytest.raises(config_module.ConfigError) as info:
        config_module.load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path} line {line}: a merge-conflict marker")
    assert f"keep one side of each {START} ... {END} block" in message and "\n" not in message


def test_a_whole_conflict_names_its_first_line_and_every_marker(config_module, tmp_path):
    path, line = with_lines(tmp_path, CONFLICT)
    with pytest.raises(config_module.ConfigError) as info:
        config_module.load_config(path)
    assert str(info.value).startswith(
        f"{path} line {line}: a merge-conflict marker left by `copier update` "
        f"(3 marker lines: {line}, {line + 2}, {line + 4})")


@pytest.mark.parametrize("insert, where, problem", [
    # an unclosed list: the parser finds out on the next line, and says where it began
    ("  lr: [0.1, 0.2\n", "line {next}, column ", ("did not find expected ',' or ']' while "
                                                  "parsing a flow sequence that starts at "
                                                  "line {line}, column 7")),
    ("\tlr: 0.1\n", "line {line}, column 1", "found character that cannot start any token"),
    ("  lr: a: b\n", "line {line}, column 8", "mapping values are not allowed"),
], ids=["unclosed-list", "tab", "colon-in-a-value"])
def test_invalid_yaml_names_the_line_the_column_and_the_problem(config_module, tmp_path,
                                                                 insert, where, problem):
    path, line = with_lines(tmp_path, insert)
    with pytest.raises(config_module.ConfigError) as info:
        config_module.load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path} {where.format(line=line, next=line + 1)}"), message
    assert f": not valid YAML ({problem.format(line=line)}" in message and "\n" not in message


def test_a_config_that_is_not_a_mapping_is_refused_in_one_sentence(config_module, tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("- train\n- checkpoint\n", encoding="utf-8")
    with pytest.raises(config_module.ConfigError, match="top level must be a mapping"):
        config_module.load_config(path)


@pytest.mark.parametrize("command, broken", [
    ("train", CONFLICT), ("resume", CONFLICT), ("plan", CONFLICT),
    ("train", "  lr: [0.1\n"),
], ids=["train-conflict", "resume-conflict", "plan-conflict", "train-invalid-yaml"])
def test_commands_refuse_a_broken_config_with_exit_2_and_the_line(tmp_path, command, broken):
    """The command's own default configs/train.yaml (relative to where it runs), as a
    `copier update` or an edit leaves it: exit 2, one line, no traceback."""
    (tmp_path / "configs").mkdir()
    _, line = with_lines(tmp_path / "configs", broken)
    proc = run_module(command, cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [text for text in proc.stderr.splitlines() if text.startswith("error:")]
    where = f"error: configs/train.yaml line {line + (0 if START in broken else 1)}"
    assert len(errors) == 1 and errors[0].startswith(where), proc.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "configs"]  # nothing written


# ------------------------------------------- a changed train.max_steps on resume --

@pytest.mark.parametrize("saved, now", [(2000, 2001), (2_000_000, 2_000_001)])
def test_the_schedule_warning_shows_the_digits_that_differ(config_module, saved, now):
    """Both learning rates with as many digits as tell them apart (0.00167248 instead of
    0.00167142, never 0.00167 instead of 0.00167), each the value rounded."""
    restore = project_module("checkpoint.load.restore")
    schedule = project_module("config.schedule")
    train = ["train.lr=0.003", "train.warmup_steps=20", "train.min_lr_ratio=0.1"]
    cfg = config_module.load_config(ROOT / "configs/train.yaml",
                                    [*train, f"train.max_steps={now}"])
    train_then = {"max_steps": saved, "warmup_steps": 20, "min_lr_ratio": 0.1}
    config_then = {"train": train_then}
    record = {"config": config_then}
    said = []
    step = saved // 2
    restore.warn_if_schedule_changed(SimpleNamespace(record=record), cfg, step, said.append)
    found = re.search(r"the learning rate is (\S+) instead of (\S+)\.", said[0])
    assert found, said
    after = 0.003 * schedule.lr_factor(step, 20, now, 0.1)
    before = 0.003 * schedule.lr_factor(step, 20, saved, 0.1)
    assert found.group(1) != found.group(2)
    assert float(found.group(1)) == pytest.approx(after, rel=1e-6)
    assert float(found.group(2)) == pytest.approx(before, rel=1e-6)


def test_the_schedule_warning_in_the_warm_up_says_the_rate_is_the_same(config_module):
    restore = project_module("checkpoint.load.restore")
    cfg = config_module.load_config(ROOT / "configs/train.yaml",
                                    ["train.warmup_steps=20", "train.max_steps=2001"])
    said = []
    train_saved = {"max_steps": 2000}
    saved = {"train": train_saved}
    restore.warn_if_schedule_changed(SimpleNamespace(record={"config": saved}), cfg, 5,
                                     said.append)
    assert "the learning rate is still " in said[0] and "instead of" not in said[0]
