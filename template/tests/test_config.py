import pytest
import torch

from conftest import ROOT, project_module, run_module


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


def test_bench_refuses_an_object_store_dir_instead_of_writing_a_local_folder(tmp_path):
    proc = run_module("bench", "--dir", "s3://bucket/x", "--config",
                      str(ROOT / "configs/train.yaml"), cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--dir s3://bucket/x" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []          # no folder named "s3:" or anything else


@pytest.mark.parametrize("command", ["train", "resume", "drill", "plan", "bench"])
def test_commands_answer_help(command):
    proc = run_module(command, "--help")
    assert "usage" in proc.stdout.lower()
