"""A deliberately slow checkpoint storage, and a probe that saves and trains through it.

``SlowWriter`` is the project's filesystem writer that sleeps before writing: a slow disk or
object store. In ``process`` mode DCP pickles the writer into its checkpoint process,
which imports this module by name, so it lives here, at module level, on the path
(tests/ is on PYTHONPATH when ``test_save_path`` runs the probe).

The probe runs in a process of its own (``python -c "import slow_storage;
slow_storage.main()" MODE DELAY_S``: DCP's checkpoint process and the process group
stay out of the test process) and prints one JSON line: how long ``save()`` took
against the write, and the step times of a training loop with a save in flight.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# The suite root (conftest.py): the project with the suite's own task and config.
ROOT = Path(os.environ.get("SUITE_ROOT") or Path(__file__).resolve().parents[1])
PACKAGE = next(p.parent.name for p in sorted((ROOT / "src").glob("*/train.py")))
SAVE_STEP = 1000   # the one save of the training loop (its interval: no other step is due)


def _module(name: str):
    return importlib.import_module(f"{PACKAGE}.{name}")


class SlowWriter(_module("checkpoint.store.checksummed_writer").LocalWriter):
    """The project's filesystem writer, sleeping ``delay_s`` before it writes anything."""

    def __init__(self, path: str, delay_s: float) -> None:
        super().__init__(path, sync_files=True)
        self.delay_s = delay_s

    def write_data(self, plan, planner):
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)


def slow_storage(root: Path, delay_s: float):
    """The project's local storage, writing through SlowWriter."""
    local = _module("checkpoint.store.storage").LocalStorage

    class SlowStorage(local):
        def writer(self, name: str) -> SlowWriter:
            return SlowWriter(self.path(name), delay_s)

    return SlowStorage(root)


def main() -> None:
    mode, delay_s = sys.argv[1], float(sys.argv[2])
    root = Path(tempfile.mkdtemp(prefix="slow-storage-"))
    config = _module("config")
    cfg = config.load_config(ROOT / "configs/train.yaml",
                             ["model.d_model=32", "model.n_layers=1",
                              f"checkpoint.async_mode={mode}", "train.max_steps=1000000000",
                              f"log.dir={root / 'logs'}"])
    distributed = _module("runtime.distributed")
    runtime = distributed.setup(cfg.distributed.backend)
    pipeline = _module("checkpoint.save.pipeline").SavePipeline(
        slow_storage(root / "ckpt", delay_s), mode=config.AsyncMode(mode), keep_last=5,
        is_coordinator=True, device=runtime.device)
    pipeline.prepare()
    # The project's trainer and checkpointer, saving through the slow storage.
    metrics = _module("runtime.metrics").MetricsLog(None)
    watch = _module("preemption.watch").PreemptionWatch(cfg.preemption.signals)
    stop = _module("preemption.stop").StopCoordinator(watch, runtime, 30.0)
    checkpointer = _module("checkpoint").Checkpointer(cfg, runtime, metrics, stop, pipeline,
                                                      None, None, None)
    trainer = _module("loop.trainer").Trainer(cfg, _module("loop.task_contract").load_task(),
                                              runtime, checkpointer, metrics)
    trainer.resume()
    batches = trainer.micro_batches()
    checkpointer.at_step_end(0)                   # the start: the checkpoint process
    trainer.train_step(batches)            # the optimizer has state now
    state = trainer.state()
    failure = (pipeline.warm_up(state, 120, str(root / "checkpoint-process.log"))
               or pipeline.wait_ready())
    assert failure is None, failure

    # One save: how long the call and the staging take, whether it is committed yet.
    began = time.perf_counter()
    pipeline.save(1, state, "interval", {"world_size": 1})
    call_s = time.perf_counter() - began
    pipeline.wait_staged()
    blocking_s = time.perf_counter() - began
    committed_at_return = pipeline.poll() is not None or pipeline.newest() is not None
    result = pipeline.wait()
    newest = pipeline.newest()
    save = {"call_s": call_s, "blocking_s": blocking_s,
            "committed_at_return": committed_at_return,
            "commit_latency_s": result.commit_latency_s if result else None,
            "newest_step": newest.step if newest else None}

    # The training loop, whose one save (at SAVE_STEP) is written while it trains on.
    bench_loop = _module("tools.bench_loop")
    checkpointer.policy.interval_steps = SAVE_STEP
    steps = bench_loop.run_steps(bench_loop.Bench(trainer, checkpointer, batches),
                                 SAVE_STEP - 8, 40)
    checkpointer.policy.finish(stop)
    last = pipeline.last_committed
    train = {"steps": steps, "committed_step": last.step if last else None,
             "commit_latency_s": last.commit_latency_s if last else None}
    distributed.teardown()
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"mode": mode, "delay_s": delay_s, "save": save, "train": train}))
