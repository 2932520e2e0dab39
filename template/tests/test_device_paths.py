"""What the CUDA paths depend on, checked where a CPU can check it.

None of these needs a GPU: each checks the part of a CUDA fix that is visible on the
host (the writer's setting, which call moves the model, the config's order of bounds,
the adapters a real run reuses, how DataLoader workers start). What only a GPU shows is
in tests/test_gpu.py (``make gpu-check``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, project_module

# Every test here touches an API that differs between torch releases (make test-torch).
pytestmark = pytest.mark.torch_api

CONFIG = ROOT / "configs" / "train.yaml"
SMALL = ["model.d_model=32", "model.n_layers=1", "data.corpus_chars=20000"]


def config(*overrides: str):
    return project_module("config").load_config(CONFIG, [*SMALL, *overrides])


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group in this process (FSDP2, DDP and DCP need one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield project_module("runtime.distributed").Runtime(0, 1, 0, torch.device("cpu"), "gloo")
    finally:
        dist.destroy_process_group()


def test_async_saves_tell_the_writer_the_state_is_on_the_host(tmp_path):
    """With our own stager DCP skips the writer's stage(), which is what turns the GPU
    copy-ahead off; left on, the writer opens a CUDA context in the background."""
    local = project_module("checkpoint.store.storage").LocalStorage
    writers = []

    class Recording(local):
        def writer(self, name):
            writers.append(super().writer(name))
            return writers[-1]

    pipeline = project_module("checkpoint.save.pipeline").SavePipeline(
        Recording(tmp_path / "ckpt"), mode="thread", keep_last=2, is_coordinator=True,
        device=torch.device("cpu"))
    pipeline.prepare()
    pipeline.save(1, {"w": torch.ones(64)}, "interval", {"world_size": 1})
    pipeline.wait_staged()
    assert pipeline.wait() is not None, pipeline.last_error
    pipeline.close()
    assert [w.per_thread_copy_ahead for w in writers] == [0]


def test_the_state_adapters_are_reused_across_the_saves_of_a_real_run(tmp_path, one_rank_group):
    """The trainer builds its model/optimizer adapter once: the saves of a training run
    reuse get_state_dict's names instead of walking the model at every save."""
    cfg = config("train.max_steps=6", "checkpoint.interval_steps=2", "checkpoint.async_mode=sync",
                 f"checkpoint.dir={tmp_path / 'ckpt'}", f"log.dir={tmp_path / 'logs'}")
    metrics = project_module("runtime.metrics").MetricsLog(None)
    watch = project_module("preemption.watch").PreemptionWatch(cfg.preemption.signals)
    stop = project_module("preemption.stop").StopCoordinator(watch, one_rank_group, 30.0)
    checkpointer = project_module("checkpoint").Checkpointer.open(cfg, one_rank_group, metrics,
                                                                  stop)
    try:
        trainer = project_module("loop.trainer").Trainer(
            cfg, project_module("loop.task_contract").load_task(), one_rank_group,
            checkpointer, metrics)
        assert trainer.resume() is None
        outcome = trainer.run()
    finally:
        checkpointer.release()
    assert (outcome.status, outcome.step) == ("finished", 6)
    assert trainer.state() is trainer.state()
    assert trainer.state()["app"].reused == 2      # saves 4 and 6 reused the first walk


def test_a_watchdog_bound_not_below_the_collective_timeout_is_refused():
    """A hung first step must meet the watchdog (a `hang` event, exit 124) before the
    process group's timeout aborts the collective (exit -6 with NCCL, no event)."""
    error = project_module("config").ConfigError
    defaults = config()
    assert defaults.recovery.first_step_timeout_s < defaults.recovery.collective_timeout_s
    for override in ("recovery.first_step_timeout_s=900", "recovery.step_timeout_s=1200",
                     "recovery.collective_timeout_s=600"):
        with pytest.raises(error, match=r"must be shorter than recovery.collective_timeout_s"):
            config(override)
    config("recovery.first_step_timeout_s=300", "recovery.collective_timeout_s=400")


@pytest.mark.parametrize("parallelism, moved", [("fsdp", False), ("ddp", True)])
def test_only_ddp_moves_the_whole_model_to_the_device(monkeypatch, one_rank_group,
                                                      parallelism, moved):
    """FSDP2 moves each unit's shard itself: the whole fp32 model must never be put on
    one GPU before sharding. DDP replicates the model, so it moves it whole."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    calls = []
    original = torch.nn.Module.to

    def recording_to(self, *args, **kwargs):
        if self is model:
            calls.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    cfg = config(f"distributed.parallelism={parallelism}")
    project_module("loop.parallelize").wrap_model(model, [model[0]], cfg, one_rank_group)
    assert bool(calls) is moved, calls


def test_tf32_without_cuda_is_refused_naming_the_key(one_rank_group):
    with pytest.raises(project_module("config").ConfigError, match="train.tf32=true needs CUDA"):
        project_module("loop.parallelize").wrap_model(torch.nn.Linear(2, 2), [],
                                                      config("train.tf32=true"), one_rank_group)


def test_dataloader_workers_start_as_configured(tmp_path, one_rank_group):
    """auto is fork on CPU and forkserver on CUDA; forkserver workers deliver the same
    batches as the training process reads without workers."""
    trainer_mod = project_module("loop.trainer")
    task = project_module("loop.task_contract").load_task()
    batches = {}
    for method, workers in (("forkserver", 1), ("auto", 0)):
        cfg = config(f"loader.num_workers={workers}", f"loader.start_method={method}",
                     "checkpoint.async_mode=sync", f"checkpoint.dir={tmp_path / method}")
        trainer = trainer_mod.Trainer(cfg, task, one_rank_group,
                                      _no_checkpoints(), project_module("runtime.metrics")
                                      .MetricsLog(None))
        assert project_module("loop.loader").start_method(method, torch.device("cpu")) == (
            "forkserver" if method == "forkserver" else "fork")
        source = trainer.micro_batches()
        batches[method] = [next(source) for _ in range(3)]
        del source
    for a, b in zip(batches["forkserver"], batches["auto"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(project_module("config").ConfigError, match="loader.start_method"):
        config("loader.start_method=thread")


def _no_checkpoints():
    """What the trainer reads of a checkpointer before training: nothing is saved."""
    class NoCheckpoints:
        first_start = True
    return NoCheckpoints()
