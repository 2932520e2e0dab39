"""Checksums in commit.json: same-size damage is found before a load, and `verify` reports it."""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import project_module, read_events, run_module


def save_and_commit(storage, layout, step: int, numel: int = 4096) -> Path:
    """A real one-process DCP save (a shard and .metadata), committed."""
    work = layout.staging_name(step, storage)
    state = {"w": torch.arange(float(numel)) * step, "step": step}
    dcp.save(state, storage_writer=storage.writer(work), no_dist=True)
    return Path(layout.commit(storage, step, {"world_size": 1}).path)


def damage_in_place(path: Path, offset: int = 0, length: int = 64) -> None:
    """Overwrite ``length`` bytes with different ones; the size stays the same."""
    data = bytearray(path.read_bytes())
    size = path.stat().st_size
    offset = min(offset, max(0, size - length))
    for i in range(offset, min(size, offset + length)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size


@pytest.mark.torch_api
def test_commit_records_size_and_crc32_of_every_file(tmp_path, ckpt):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    directory = save_and_commit(storage, layout, 3)
    record = json.loads((directory / "commit.json").read_text())
    assert record["checksum"] == {"algorithm": "crc32", "block_bytes": 8 << 20}
    listed = sorted(p.name for p in directory.iterdir() if p.name != "commit.json")
    assert sorted(record["files"]) == listed
    for name, entry in record["files"].items():
        data = (directory / name).read_bytes()
        assert entry == {"size": len(data), "crc32": [f"{zlib.crc32(data):08x}"]}


@pytest.mark.torch_api
@pytest.mark.parametrize("damaged", [".metadata", "__0_0.distcp"])
@pytest.mark.parametrize("mode", ["all", "sample"])
def test_same_size_damage_is_skipped_for_the_previous_checkpoint(tmp_path, ckpt, caplog,
                                                                damaged, mode):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    save_and_commit(storage, layout, 10)
    newest = save_and_commit(storage, layout, 20)
    damage_in_place(newest / damaged, offset=(newest / damaged).stat().st_size // 2)
    assert [c.step for c in layout.list_committed(storage)] == [10, 20]   # sizes still fit
    with caplog.at_level(logging.WARNING):
        found = layout.newest_complete_checkpoint(storage, verify=mode)
    assert found.step == 10
    assert f"skipping checkpoint {newest}: {damaged} does not match its checksum" in caplog.text
    # checkpoint.verify=none trusts the sizes: the damage goes through unseen.
    assert layout.newest_complete_checkpoint(storage, verify="none").step == 20


def test_sample_reads_part_of_a_large_file_and_all_of_a_small_one(tmp_path, ckpt, monkeypatch):
    layout, storage_mod = ckpt
    integrity = project_module("checkpoint.store.integrity")
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 1024)      # many blocks from a small save
    storage = storage_mod.LocalStorage(tmp_path)
    directory = save_and_commit(storage, layout, 1, numel=64 * 1024)   # a 256 KiB shard
    record = json.loads((directory / "commit.json").read_text())
    blocks = len(record["files"]["__0_0.distcp"]["crc32"])
    assert blocks > 200 and record["checksum"]["block_bytes"] == 1024
    full = integrity.check_contents(storage, directory.name, record, "all")
    sample = integrity.check_contents(storage, directory.name, record, "sample")
    assert full.problem == sample.problem == "" and full.checked_bytes == full.bytes
    metadata = record["files"][".metadata"]["size"]
    assert metadata < sample.checked_bytes < full.bytes // 4
    # The first and the last block are always in the sample.
    damage_in_place(directory / "__0_0.distcp", offset=10 ** 9)      # clamped to the end
    found = integrity.check_contents(storage, directory.name, record, "sample")
    assert "__0_0.distcp does not match its checksum" in found.problem


def test_a_skipped_newer_checkpoint_does_not_retire_the_new_saves(tmp_path, ckpt):
    """Resumed from step 10 because step 20 is damaged: with keep_last=1 the save of step
    12 must stay (it is the newest good one), and step 20 is left for someone to look at."""
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    save_and_commit(storage, layout, 10)
    damaged = save_and_commit(storage, layout, 20)
    damage_in_place(damaged / "__0_0.distcp")
    assert layout.newest_complete_checkpoint(storage).step == 10
    save_and_commit(storage, layout, 12)
    assert layout.retire_old(storage, keep_last=1, up_to=12) == [layout.step_name(10)]
    assert [c.step for c in layout.list_committed(storage)] == [12, 20]


def test_commit_without_checksums_is_accepted_with_a_note(tmp_path, ckpt, caplog):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    directory = save_and_commit(storage, layout, 7)
    commit = directory / "commit.json"
    record = json.loads(commit.read_text())
    record["files"] = {name: entry["size"] for name, entry in record["files"].items()}
    del record["checksum"]
    record["format_version"] = 1
    commit.write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING):
        assert layout.newest_complete_checkpoint(storage).step == 7
    assert f"note: checkpoint {directory} has no checksums" in caplog.text


def verify(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m <package>.verify args`` in this process: (exit status, stdout, stderr)."""
    code = project_module("tools.verify").main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.torch_api
def test_verify_prints_a_table_and_fails_on_damage(tmp_path, ckpt, capsys):
    layout, storage_mod = ckpt
    root = tmp_path / "ckpt"
    storage = storage_mod.LocalStorage(root)
    dirs = {step: save_and_commit(storage, layout, step) for step in (1, 2, 3)}
    (root / layout.step_name(4)).mkdir()               # an unfinished save: not a failure
    proc = run_module("verify", str(root), check=False)  # once as a command
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert ["step", "files", "bytes", "status", "reason"] in rows
    assert [(r[0], r[3]) for r in rows if r and r[0].isdigit()] == [
        ("4", "uncommitted"), ("3", "ok"), ("2", "ok"), ("1", "ok")]

    damage_in_place(dirs[2] / "__0_0.distcp", offset=100)
    code, out, _ = verify(capsys, str(root))
    assert code == 1, out
    failed = [line for line in out.splitlines() if "FAILED" in line.split()[:4]]
    assert len(failed) == 1 and failed[0].split()[0] == "2"
    assert "__0_0.distcp does not match its checksum" in failed[0]
    assert "1 FAILED" in out.splitlines()[-1]

    # One checkpoint; the configured directory; sampling; bad input.
    assert verify(capsys, str(dirs[3]))[0] == 0
    assert verify(capsys, str(dirs[2]))[0] == 1
    code, out, _ = verify(capsys, f"checkpoint.dir={root}", "checkpoint.verify=sample")
    assert code == 1 and "(checksums: sample)" in out
    for bad in ([str(tmp_path / "missing")], [str(root / layout.step_name(9))],
                [str(root), "checkpoint.verify=maybe"], [str(root), str(root)]):
        code, _, err = verify(capsys, *bad)
        assert code == 2 and err.startswith("error: "), (bad, err)


def test_verify_reports_a_metadata_that_would_run_code(tmp_path, ckpt, capsys):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path)
    directory = save_and_commit(storage, layout, 5)
    marker = tmp_path / "ran"
    forge_metadata(directory, malicious_pickle(marker))
    code, out, _ = verify(capsys, str(tmp_path))
    assert code == 1
    assert "it names posix.system, which is not part of DCP's metadata" in out
    assert not marker.exists()


# ----------------------------------------------------------- shared helpers --

def malicious_pickle(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when loaded with pickle.load."""
    import os
    import pickle

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    return pickle.dumps(Payload())


def forge_metadata(directory: Path, data: bytes) -> None:
    """Replace .metadata and update commit.json to match, as someone with write access could."""
    (directory / ".metadata").write_bytes(data)
    commit = directory / "commit.json"
    record = json.loads(commit.read_text())
    record["files"][".metadata"] = {"size": len(data), "crc32": [f"{zlib.crc32(data):08x}"]}
    commit.write_text(json.dumps(record))


# ------------------------------------------------------------- end to end --

@pytest.mark.slow
def test_train_resumes_from_the_previous_checkpoint_when_a_shard_is_damaged(run_dirs):
    args = ["model.d_model=32", "model.n_layers=1", "checkpoint.interval_steps=2",
            "checkpoint.async_mode=sync", f"checkpoint.dir={run_dirs['ckpt']}",
            f"log.dir={run_dirs['logs']}"]
    run_module("train", "train.max_steps=4", *args)
    layout = project_module("checkpoint.store.layout")
    shard = Path(run_dirs["ckpt"]) / layout.step_name(4) / "__0_0.distcp"
    damage_in_place(shard, offset=shard.stat().st_size // 2, length=4096)
    proc = run_module("train", "train.max_steps=6", *args)
    assert (f"skipping checkpoint {shard.parent}: __0_0.distcp does not match its checksum"
            in proc.stderr)
    starts = read_events(Path(run_dirs["logs"]), "start")
    assert [s["step"] for s in starts] == [0, 2]
    assert starts[-1]["resumed_from"].endswith(layout.step_name(2))
