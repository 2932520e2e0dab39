"""The GPU tier: the CUDA, bf16 and pinned-memory paths, on one CUDA GPU.

Run with ``python -m pytest -m gpu -rs tests/test_gpu.py`` (the template's ``make
gpu-check`` renders a project and runs exactly this). Without CUDA every test here is
skipped with the reason. Nothing downloads: the model is built from its configuration.
Each test prints its figures; none of them is a timed assertion.

- one CUDA rank, FSDP2, ``train.precision=bf16``, process-based background saves staged
  in pinned memory; a resume from the middle checkpoint finishes bit-identical to the
  uninterrupted run (same world size);
- ``bench --json`` on CUDA: the in-loop stall and the blocking time of a save against
  the device-to-host copy bound;
- the project's stager on CUDA, three saves in a row through one stager: each staged in
  pinned host memory, equal to the device state it copied (on torch 2.11 and 2.12.0 DCP
  closes a stager after every stage; runtime/torch_compat.py keeps it open);
- export of the bf16 run to a Hugging Face directory that ``from_pretrained`` loads;
- a warm restart on CUDA: ``resume``'s worker, forked from the zygote (which never
  touches CUDA), initialises CUDA itself; killed, it is forked again and trains on.

Run on the GPU image's own torch (2.9 or newer) by the template's ``make gpu-check
GPU_PYTHON=python3``, which needs nothing there but the wheels of omegaconf and antlr4.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import (
    cmdline,
    finish,
    parents,
    project_module,
    read_metrics,
    run_module,
    start,
    wait_until,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: the GPU tier runs on a machine with a GPU "
                              "(make gpu-check)"),
]

STEPS = 8
RUN = ["train.precision=bf16", "distributed.parallelism=fsdp", "checkpoint.async_mode=process",
       f"train.max_steps={STEPS}", "checkpoint.interval_steps=4", "checkpoint.keep_last=2",
       "log.every_steps=1", "model.d_model=128", "model.n_layers=2"]


def losses(log_dir) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_metrics(log_dir) if e["event"] == "step"}


def test_bf16_fsdp_run_saves_in_the_background_and_resumes_bit_identical(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_module("train", *RUN, f"checkpoint.dir={full / 'ckpt'}", f"log.dir={full / 'logs'}",
               timeout=480)
    saves = [e for e in read_metrics(full / "logs") if e["event"] == "save"]
    assert [e["step"] for e in saves] == [4, 8] and {e["mode"] for e in saves} == {"process"}
    print("bf16 saves:", [(e["step"], e["blocking_s"], e["commit_latency_s"]) for e in saves])

    # The same run resumed from its checkpoint of step 4, on the same world size.
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(full / "ckpt" / "step_000000004", resumed / "ckpt" / "step_000000004")
    run_module("train", *RUN, f"checkpoint.dir={resumed / 'ckpt'}",
               f"log.dir={resumed / 'logs'}", timeout=480)
    reference, after = losses(full / "logs"), losses(resumed / "logs")
    assert sorted(after) == list(range(5, STEPS + 1))
    assert all(after[s] == reference[s] for s in after), (reference, after)


def test_staging_copies_into_pinned_host_memory_save_after_save():
    staging = project_module("checkpoint.save.staging")
    device = torch.device("cuda", 0)
    stager = staging.ReusingStager(staging.StagingOptions(
        use_pinned_memory=True, use_shared_memory=True, use_async_staging=True,
        use_non_blocking_copy=True), device=device)
    weights = torch.randn(1024, 1024, device=device)
    try:
        for step in range(3):
            weights.mul_(1.5)          # queued on the compute stream before the copy
            staged = stager.stage({"w": weights, "step": step})
            staged = staged.result() if hasattr(staged, "result") else staged
            assert staged["w"].device.type == "cpu" and staged["w"].is_pinned()
            assert torch.equal(staged["w"], weights.cpu()) and staged["step"] == step
    finally:
        stager.close()
    print("pinned staging: full stages", stager.full_stages, "fast stages", stager.fast_stages)
    assert (stager.full_stages, stager.fast_stages) == (1, 2)


def test_bench_on_cuda_reports_the_stall_and_blocking_against_the_copy_bound(tmp_path):
    proc = run_module("bench", "--json", "--repeats", "2", "model.d_model=512",
                      "model.n_layers=8", "checkpoint.async_mode=process", timeout=480)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["device"] == "cuda"
    med = report["median_s"]
    for name in ("copy_bound", "async_blocking", "stall", "load", "read_bound"):
        assert med.get(name) is not None, name
    print("cuda bench medians:", med)
    print("cuda bench ratios:", report["ratios"])


def test_a_bf16_run_exports_to_hugging_face(tmp_path):
    transformers = pytest.importorskip("transformers")
    llama = ["model.kind=hf", "model.config_class=LlamaConfig", "model.config.hidden_size=64",
             "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
             "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
             "model.config.vocab_size=256", "model.config.max_position_embeddings=128"]
    ckpt = tmp_path / "ckpt"
    run_module("train", *llama, "train.precision=bf16", "train.max_steps=4",
               "checkpoint.interval_steps=4", f"checkpoint.dir={ckpt}",
               f"log.dir={tmp_path / 'logs'}", timeout=480)
    out = tmp_path / "hf"
    run_module("export", "--format", "hf", "--dtype", "bf16", "--out", str(out), *llama,
               f"checkpoint.dir={ckpt}", timeout=300)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    newest = project_module("checkpoint").newest_complete_checkpoint(
        project_module("checkpoint").open_storage(str(ckpt)))
    assert newest is not None and newest.record["device_type"] == "cuda"


def test_a_warm_restart_on_cuda_forks_a_worker_that_initialises_cuda_itself(tmp_path):
    import os
    import signal
    import time

    ckpt, logs, log = tmp_path / "ckpt", tmp_path / "logs", tmp_path / "resume.log"
    proc = start("resume", "--nproc-per-node", "1", *RUN[:3], "train.max_steps=100000",
                 "checkpoint.interval_steps=4", "model.d_model=128", "model.n_layers=2",
                 f"checkpoint.dir={ckpt}", f"log.dir={logs}", log_file=log)
    attempts = project_module("recovery.attempts")

    def worker(since: float) -> int | None:
        found = [int(r["pid"]) for r in attempts.read_records(logs)
                 if r.get("state") == "running" and r.get("started", 0) >= since]
        return found[0] if found else None

    try:
        began = time.time()
        first = wait_until(lambda: worker(began - 1), proc, "a worker", log_file=log)
        wait_until(lambda: [e for e in read_metrics(logs) if e["event"] == "save"], proc,
                   "a checkpoint", log_file=log)
        assert b"launch.zygote" in cmdline(parents()[first])
        killed = time.time()
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: [e for e in read_metrics(logs) if e["event"] == "recovered"],
                   proc, "the first step after the kill", timeout=300, log_file=log)
        again = worker(killed)
        assert again is not None and b"launch.zygote" in cmdline(parents()[again])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        code = finish(proc, 180)
    recovered = [e for e in read_metrics(logs) if e["event"] == "recovered"][-1]
    print("warm restart on CUDA: failure -> first step "
          f"{recovered['failure_to_first_step_s']:.2f} s")
    text = log.read_text(errors="replace")
    assert code == 75, text[-4000:]
    assert text.count("1 rank(s) on cuda") >= 2 and "warm start:" not in text, text[-4000:]
