"""Loading a checkpoint runs no code from it: .metadata and non-tensor values are data only."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_integrity import forge_metadata, malicious_pickle, save_and_commit
from torch.distributed.checkpoint import FileSystemReader

from conftest import project_module, read_events, run_module


class Payload:
    """A value that creates a file when unpickled by anything that runs what pickles name."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.torch_api
def test_real_metadata_is_read_and_a_crafted_one_refused(tmp_path, ckpt):
    layout, storage_mod = ckpt
    safe_load = project_module("checkpoint.load.safe_load")
    storage = storage_mod.LocalStorage(tmp_path)
    directory = save_and_commit(storage, layout, 1)
    open_reader = project_module("checkpoint.load.reader").open_reader
    reader = open_reader(storage, directory.name)
    assert isinstance(reader, safe_load.SafeFileSystemReader)
    assert "w" in reader.read_metadata().state_dict_metadata

    marker = tmp_path / "ran"
    forge_metadata(directory, malicious_pickle(marker))
    with pytest.raises(safe_load.UnsafeCheckpointError,
                       match=r"refusing to load .*step_000000001/\.metadata: it names posix\.system"):
        open_reader(storage, directory.name).read_metadata()
    assert not marker.exists()
    # The same file through DCP's own reader runs the payload: the test means something.
    with pytest.raises(AttributeError):   # os.system's return value is no Metadata
        FileSystemReader(str(directory)).read_metadata()
    assert marker.exists()


@pytest.mark.torch_api
def test_the_load_refuses_a_value_that_would_run_code(tmp_path, ckpt):
    layout, storage_mod = ckpt
    safe_load = project_module("checkpoint.load.safe_load")
    storage = storage_mod.LocalStorage(tmp_path)
    marker = tmp_path / "ran"
    work = layout.staging_name(3, storage)
    dcp.save({"w": torch.ones(4), "extra": Payload(marker)}, storage_writer=storage.writer(work),
             no_dist=True)
    committed = layout.commit(storage, 3, {"world_size": 1})
    assert not marker.exists()
    state = {"w": torch.zeros(4), "extra": None}
    with pytest.raises(safe_load.UnsafeCheckpointError,
                       match=r"checkpoint .*step_000000003: refusing to load the value 'extra'"):
        project_module("checkpoint.load.restore").load_checkpoint(storage, state, committed)
    assert not marker.exists()
    # DCP's default planner would have run it.
    dcp.load({"w": torch.zeros(4), "extra": None},
             storage_reader=FileSystemReader(committed.path), no_dist=True)
    assert marker.exists()


@pytest.mark.torch_api
def test_plain_values_still_load(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    progress = {"step": 7, "lr": [0.1, 0.01], "name": "x", "flags": (True, None)}
    saved = {"w": torch.arange(6.0), "progress": progress}
    dcp.save(saved, storage_writer=storage.writer(layout.staging_name(7, storage)),
             no_dist=True)
    committed = layout.commit(storage, 7, {"world_size": 1})
    blank = {"step": 0, "lr": [0, 0], "name": "", "flags": (False, 0)}
    state = {"w": torch.zeros(6), "progress": blank}
    project_module("checkpoint.load.restore").load_checkpoint(storage, state, committed)
    assert torch.equal(state["w"], saved["w"]) and state["progress"] == saved["progress"]


@pytest.mark.slow
def test_train_refuses_a_checkpoint_whose_metadata_would_run_code(run_dirs, tmp_path):
    """A .metadata replaced by a pickle that creates a file (commit.json updated to match,
    as an attacker with write access would): refused at start, nothing run; training goes
    on from the checkpoint before it, and exits 2 when no checkpoint is left."""
    args = ["model.d_model=32", "model.n_layers=1", "checkpoint.interval_steps=2",
            "checkpoint.async_mode=sync", f"checkpoint.dir={run_dirs['ckpt']}",
            f"log.dir={run_dirs['logs']}"]
    run_module("train", "train.max_steps=4", *args)
    layout = project_module("checkpoint.store.layout")
    root = Path(run_dirs["ckpt"])
    marker = tmp_path / "ran"
    forge_metadata(root / layout.step_name(4), malicious_pickle(marker))
    proc = run_module("train", "train.max_steps=6", *args)
    output = proc.stdout + proc.stderr
    assert not marker.exists()
    assert (f"cannot load checkpoint {root / layout.step_name(4)}: refusing to load "
            f"{root / layout.step_name(4) / '.metadata'}: it names posix.system") in output, output
    starts = read_events(Path(run_dirs["logs"]), "start")
    assert starts[-1]["resumed_from"] == str(root / layout.step_name(2))

    for directory in root.glob("step_*"):     # every checkpoint forged: nothing to fall back to
        forge_metadata(directory, malicious_pickle(marker))
    proc = run_module("train", "train.max_steps=8", *args, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not marker.exists()
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert error and f"no checkpoint in {root} could be loaded" in error[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(read_events(Path(run_dirs["logs"]), "start")) == len(starts)   # never started


@pytest.mark.torch_api
def test_restricted_unpickler_allows_exactly_dcp_metadata():
    safe_load = project_module("checkpoint.load.safe_load")
    for module, name in [("builtins", "eval"), ("os", "system"), ("subprocess", "Popen"),
                         ("torch", "load"), ("torch._utils", "_rebuild_tensor_v2"),
                         ("pathlib", "Path.write_text"), ("collections", "namedtuple")]:
        data = pickle.dumps(0)[:2] + f"c{module}\n{name}\n".encode() + b")R."
        with pytest.raises(safe_load.UnsafeCheckpointError, match=f"{module}.{name}"):
            safe_load.load_metadata(data, "x/.metadata")
    with pytest.raises(safe_load.UnsafeCheckpointError, match="not DCP's Metadata"):
        safe_load.load_metadata(pickle.dumps({"a": 1}), "x/.metadata")
    with pytest.raises(safe_load.UnsafeCheckpointError, match="not a valid DCP metadata file"):
        safe_load.load_metadata(b"\x80\x04garbage", "x/.metadata")
