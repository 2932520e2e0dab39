"""Hugging Face causal LMs on token data: resumes, preemption with DataLoader workers, export.

The model is a 2-layer Llama built from its configuration class (no download, no
weights); the data is the generated corpus prepared with the bytes tokenizer.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import (
    ROOT,
    checkpoint_process_rank,
    children,
    cmdline,
    finish,
    forked_children,
    project_module,
    read_events,
    run_module,
    start,
    wait_until,
)

transformers = pytest.importorskip("transformers")

CONFIG = str(ROOT / "configs" / "train.yaml")
LLAMA = ("model.kind=hf", "model.config_class=LlamaConfig", "model.config.hidden_size=64",
         "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
         "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
         "model.config.vocab_size=257", "model.config.max_position_embeddings=128")
BATCH = ("train.global_batch_size=16", "train.micro_batch_size=2", "data.seq_len=64")
DRILL_STEPS = 8
GRACE = 30.0


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("tokens")
    corpus = project_module("datasets").generate_corpus(100_000)
    (base / "corpus.txt").write_text(corpus.replace(". ", ".\n\n"))  # sentences as documents
    code = project_module("tools.prepare_data").main(["--input", str(base / "corpus.txt"),
                                                "--tokenizer", "bytes", "--out",
                                                str(base / "tok")])
    assert code == 0
    return base / "tok"


def data(token_dir: Path, *extra: str) -> list[str]:
    return ["data.kind=tokens", f"data.path={token_dir}", *BATCH, *extra]


def config(*overrides: str):
    return project_module("config").load_config(CONFIG, list(overrides))


# ------------------------------------------------------------ configuration --
@pytest.mark.parametrize("override, fragment", [
    ("model.config.vocab_size=200", "vocabulary has 257 tokens but the model's has 200"),
    ("model.config.hiden_size=32", "model.config.hiden_size: not a field of LlamaConfig"),
    ("model.config_class=BertTokenizer", "model.config_class: 'BertTokenizer' is not"),
    ("model.path=/nowhere/llama", "needs exactly one of model.path"),
    ("model.attn=sdpa", "model.attn: not a key of model"),
    ("data.seq_len=200", "data.seq_len=200 is longer than the model's max_position_embeddings"),
])
def test_bad_model_configuration_is_refused_naming_the_key(token_dir, override, fragment):
    cfg = config(*LLAMA, *data(token_dir), override)
    error = project_module("config").ConfigError
    with pytest.raises(error, match=re.escape(fragment)):
        project_module("loop.task_contract").load_task().build_model(cfg)


def test_vocabulary_mismatch_stops_training_with_exit_2(token_dir, tmp_path):
    proc = run_module("train", *LLAMA, *data(token_dir), "model.config.vocab_size=200",
                      f"checkpoint.dir={tmp_path / 'c'}", f"log.dir={tmp_path / 'l'}",
                      check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "the data's vocabulary has 257 tokens but the model's has 200" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 is allowed with CUDA")
def test_bf16_without_cuda_is_refused_naming_the_key():
    distributed = project_module("runtime.distributed")
    runtime = distributed.Runtime(0, 1, 0, torch.device("cpu"), "gloo")
    with pytest.raises(project_module("config").ConfigError, match="train.precision=bf16 needs CUDA"):
        project_module("loop.parallelize").wrap_model(torch.nn.Linear(2, 2), [], config("train.precision=bf16"), runtime)


@pytest.mark.torch_api
def test_pretrained_weights_load_at_the_first_start_only(token_dir, tmp_path, caplog):
    pretrained = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=257, max_position_embeddings=128))
    pretrained.save_pretrained(tmp_path / "llama")
    cfg = config("model.kind=hf", f"model.path={tmp_path / 'llama'}", *data(token_dir),
                 f"checkpoint.dir={tmp_path / 'ckpt'}")
    expected = pretrained.state_dict()
    task = project_module("task")
    context = project_module("config").TaskContext
    caplog.set_level(logging.INFO)
    first = task.build_model(cfg, context(first_start=True)).state_dict()
    assert all(torch.equal(first[k], expected[k]) for k in expected)
    assert "loading pretrained weights" in caplog.text

    # Once a checkpoint is committed (the harness says: not the first start), the model is
    # built from config.json alone: the resume loads the checkpoint's weights, never the
    # pretrained ones again.
    caplog.clear()
    again = task.build_model(cfg, context(first_start=False)).state_dict()
    assert not torch.equal(again["model.layers.0.mlp.up_proj.weight"],
                           expected["model.layers.0.mlp.up_proj.weight"])
    assert "loading pretrained weights" not in caplog.text


@pytest.mark.torch_api
def test_activation_checkpointing_recomputes_and_changes_no_name_or_number(token_dir):
    distributed = project_module("runtime.distributed")
    runtime = distributed.Runtime(0, 1, 0, torch.device("cpu"), "gloo")
    task = project_module("loop.task_contract").load_task()
    batch = torch.utils.data.default_collate([task.build_data(config(*data(token_dir)))[i]
                                              for i in range(2)])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = {}
        for on in (False, True):
            cfg = config(*LLAMA, *data(token_dir), f"train.activation_checkpointing={on}")
            torch.manual_seed(0)
            model = task.build_model(cfg)
            calls = []
            layer = model.model.layers[0]
            original = layer.forward
            layer.forward = lambda *a, _f=original, _c=calls, **k: _c.append(1) or _f(*a, **k)
            model = project_module("loop.parallelize").wrap_model(model, task.shard_units(model), cfg, runtime)
            loss, _ = task.loss_and_metrics(model, batch)
            loss.backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            results[on] = (len(calls), loss.item(), grads, list(model.state_dict()))
    finally:
        dist.destroy_process_group()
    assert results[False][0] == 1 and results[True][0] == 2  # forward, then recomputed
    assert results[True][1] == results[False][1]
    assert all(torch.equal(results[True][2][n], g) for n, g in results[False][2].items())
    assert results[True][3] == results[False][3]  # checkpoints keep their names


def test_tiny_model_needs_no_transformers(tmp_path):
    script = (
        "import sys\n"
        "for name in ('transformers', 'tokenizers', 'safetensors', 'huggingface_hub'):\n"
        "    sys.modules[name] = None  # import fails as if not installed\n"
        f"from {project_module('task').__package__} import config, export, prepare_data, task\n"
        f"cfg = config.load_config({CONFIG!r}, ['checkpoint.dir={tmp_path}'])\n"
        "from importlib import import_module\n"
        "build_model = import_module(task.__package__ + '.loop.task_contract').load_task()"
        ".build_model\n"
        "print(type(build_model(cfg)).__name__)\n"
        "try:\n"
        "    build_model(config.load_config("
        f"{CONFIG!r}, ['model.kind=hf', 'model.config_class=LlamaConfig']))\n"
        "except config.ConfigError as exc:\n"
        "    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""},
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    hint = ("model.kind=hf needs transformers: pip install -e '.[hf]' (transformers, "
            "tokenizers, safetensors)")
    assert proc.stdout.splitlines() == ["TinyLM", hint]


# ----------------------------------------------------------------- drills --
def drill(token_dir: Path, out: Path, save: int, resume: int) -> dict:
    # Synchronous saves spare each run the background checkpoint process: how a save is
    # written changes no number (the default task's drill test covers that mode).
    proc = run_module("drill", "--save-ranks", str(save), "--resume-ranks", str(resume),
                      "--steps", str(DRILL_STEPS), "--out", str(out), *LLAMA,
                      *data(token_dir, "loader.num_workers=2"), "checkpoint.async_mode=sync",
                      "checkpoint.keep_last=4", timeout=900, check=False)
    report = json.loads((out / "report.json").read_text())
    assert proc.returncode == 0 and report["passed"], f"{report['verdict']}\n{proc.stdout}"
    assert report["compared_steps"] == list(range(DRILL_STEPS // 2 + 1, DRILL_STEPS + 1))
    assert report["resumed_from_step"] == DRILL_STEPS // 2
    return report


@pytest.fixture(scope="module")
def drill_two_to_one(token_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf-drill") / "drill"
    drill(token_dir, out, 2, 1)
    return out


@pytest.mark.slow
def test_drill_llama_on_tokens_two_ranks_to_one(drill_two_to_one):
    report = json.loads((drill_two_to_one / "report.json").read_text())
    assert (report["save_world_size"], report["resume_world_size"]) == (2, 1)
    assert report["max_rel_loss_diff"] < 1e-4 and report["before_kill_max_abs_loss_diff"] == 0
    assert report["resume_grad_accum_steps"] == 2 * report["saved_grad_accum_steps"]


def steps_of_last_run(log_dir: Path) -> dict[int, tuple[float, float]]:
    """(loss, grad norm) by step of the newest run in ``log_dir``, as the drill reads it."""
    run = project_module("tools.drill_report").split_runs(log_dir)[-1]
    return {step: (e["loss"], e["grad_norm"]) for step, e in run.steps.items()}


@pytest.mark.slow
def test_same_llama_checkpoint_resumed_on_two_ranks_is_bit_identical(drill_two_to_one,
                                                                      token_dir, tmp_path):
    """The checkpoint the killed 2-rank run left, resumed on 2 ranks through ``resume``:
    every later step equals the uninterrupted run's (the drill's reference)."""
    name = project_module("checkpoint").step_name(DRILL_STEPS // 2)
    shutil.copytree(drill_two_to_one / "interrupted" / "checkpoints" / name,
                    tmp_path / "ckpt" / name)
    run_module("resume", "--nproc-per-node", "2", *LLAMA, *data(token_dir, "loader.num_workers=2"),
               f"train.max_steps={DRILL_STEPS}", "checkpoint.async_mode=sync",
               f"checkpoint.dir={tmp_path / 'ckpt'}", f"log.dir={tmp_path / 'logs'}",
               timeout=600)
    resumed = steps_of_last_run(tmp_path / "logs")
    reference = steps_of_last_run(drill_two_to_one / "reference" / "logs")
    assert sorted(resumed) == list(range(DRILL_STEPS // 2 + 1, DRILL_STEPS + 1))
    assert resumed == {step: reference[step] for step in resumed}  # losses, grad norms equal


def training_processes(resume_pid: int) -> list[int]:
    """The ranks' processes: the children of the zygote (recovery.warm_start), which
    ``resume`` starts beside torchrun, but their checkpoint processes; else the children
    of torchrun."""
    zygote = b"launch.zygote"
    started = children(resume_pid)
    forked = [rank for pid in started if zygote in cmdline(pid) for rank in children(pid)
              if checkpoint_process_rank(rank) is None]
    return forked or [rank for pid in started for rank in children(pid)]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_sigterm_with_dataloader_workers_commits_a_final_checkpoint(token_dir, tmp_path):
    logs, ckpt, log_file = tmp_path / "logs", tmp_path / "ckpt", tmp_path / "job.log"
    args = [*LLAMA, *data(token_dir, "loader.num_workers=2"), "train.max_steps=300",
            "checkpoint.interval_steps=4", f"preemption.grace_period_s={GRACE:g}",
            f"checkpoint.dir={ckpt}", f"log.dir={logs}"]
    proc = start("resume", "--nproc-per-node", "2", *args, log_file=log_file)
    wait_until(lambda: len(read_events(logs, "step")) >= 6, proc, "six steps",
               log_file=log_file)
    workers = {pid: forked_children(pid) for pid in training_processes(proc.pid)}
    assert len(workers) == 2 and all(len(w) == 2 for w in workers.values()), workers
    proc.send_signal(signal.SIGTERM)  # a scheduler signals the resume command
    code = finish(proc, GRACE + 90)
    log = log_file.read_text(errors="replace")
    assert code == 75, log[-6000:]
    stops = read_events(logs, "preemption")
    assert len(stops) == 1, log[-6000:]
    stop = stops[0]
    assert stop["final_checkpoint_step"] == stop["stop_step"]
    assert 0 < stop["signal_to_commit_s"] < GRACE
    newest = project_module("checkpoint").newest_complete_checkpoint(
        project_module("checkpoint").open_storage(str(ckpt)))
    assert newest.step == stop["stop_step"] and newest.record["reason"] == "preemption"
    assert "DataLoader worker" not in log and "exited unexpectedly" not in log


# ----------------------------------------------------------------- export --
def logits(model: torch.nn.Module, token_dir: Path) -> torch.Tensor:
    windows = project_module("datasets").TokenWindows(token_dir, seq_len=64)
    batch = torch.stack([windows[i][0] for i in range(4)])
    with torch.no_grad():
        return model.eval()(batch).logits


def trained_model(checkpoint: Path, tmp_path: Path) -> torch.nn.Module:
    """The checkpoint's model, read back with PyTorch's own converter (not export.py)."""
    dcp_to_torch_save(checkpoint, tmp_path / "full.pt")
    weights = torch.load(tmp_path / "full.pt", weights_only=False)["app"]["model"]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=257, max_position_embeddings=128))
    model.load_state_dict(weights, strict=True)
    return model


@pytest.mark.slow
def test_export_hf_loads_with_from_pretrained_and_gives_the_trained_logits(
        drill_two_to_one, token_dir, tmp_path):
    reference = drill_two_to_one / "reference" / "checkpoints"  # saved on 2 ranks
    storage = project_module("checkpoint").open_storage(str(reference))
    newest = project_module("checkpoint").newest_complete_checkpoint(storage)
    assert newest.world_size == 2 and newest.step == DRILL_STEPS
    out = tmp_path / "hf"
    proc = run_module("export", "--format", "hf", "--out", str(out), f"checkpoint.dir={reference}")
    assert "from_pretrained" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(exported).__name__ == "LlamaForCausalLM" and exported.dtype == torch.float32
    expected = logits(trained_model(Path(newest.path), tmp_path), token_dir)
    torch.testing.assert_close(logits(exported, token_dir), expected, rtol=1e-5, atol=0)

    # Sharded above --max-shard-size, from the checkpoint the 1-rank resume saved.
    resumed = drill_two_to_one / "interrupted" / "checkpoints"
    newest_resumed = project_module("checkpoint").newest_complete_checkpoint(
        project_module("checkpoint").open_storage(str(resumed)))
    assert newest_resumed.world_size == 1
    export = project_module("tools.export")
    assert export.main([newest_resumed.path, "--format", "hf", "--out", str(tmp_path / "sh"),
                        "--max-shard-size", "200KB", "--config", CONFIG]) == 0
    index = json.loads((tmp_path / "sh" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sh")
    full = trained_model(Path(newest_resumed.path), tmp_path)
    torch.testing.assert_close(logits(sharded, token_dir), logits(full, token_dir),
                               rtol=1e-5, atol=0)

    # torch format: one torch.save file, the weights by parameter name.
    assert export.main([newest_resumed.path, "--format", "torch", "--out",
                        str(tmp_path / "pt"), "--config", CONFIG]) == 0
    weights = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert weights.keys() == full.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in full.state_dict().items())


@pytest.mark.torch_api
@pytest.mark.slow
def test_a_short_llama_run_exports_to_hugging_face_and_to_one_torch_file(token_dir, tmp_path):
    """The export path on its own (DCP's HuggingFaceStorageWriter, torch.save): what the
    torch compatibility legs run; the test above checks the logits too."""
    ckpt = tmp_path / "ckpt"
    run_module("train", *LLAMA, *data(token_dir), "train.max_steps=2",
               "checkpoint.interval_steps=2", f"checkpoint.dir={ckpt}",
               f"log.dir={tmp_path / 'logs'}", timeout=300)
    run_module("export", "--format", "hf", "--out", str(tmp_path / "hf"), *LLAMA,
               f"checkpoint.dir={ckpt}", timeout=300)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    weights = exported.state_dict()
    run_module("export", "--format", "torch", "--out", str(tmp_path / "pt"), *LLAMA,
               f"checkpoint.dir={ckpt}", timeout=300)
    saved = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert set(saved) == set(weights), sorted(set(saved) ^ set(weights))[:5]
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, weights[name].detach(), rtol=0, atol=0)
