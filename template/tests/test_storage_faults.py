"""A checkpoint.dir that cannot hold checkpoints is refused at start; a failed save says why.

The full and the read-only disks are real when the tests run as root: a size-limited or
read-only tmpfs mounted by the test (root ignores permission bits, not a read-only
mount). Without mount rights they fall back to a non-root permission check, a storage
writer that fails on purpose and a reported free space, or are skipped with the reason.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_integrity import save_and_commit
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from conftest import moto_s3, project_module, run_module

errors_mod = project_module("checkpoint.store.errors")

# Every test here touches an API that differs between torch releases (make test-torch).
pytestmark = pytest.mark.torch_api

TRAIN = ["model.d_model=32", "model.n_layers=1", "train.max_steps=2"]


@pytest.fixture
def tmpfs(tmp_path):
    """``make(name, size, read_only)`` mounts a tmpfs at tmp_path/name, or returns None.

    Every mount is undone at teardown.
    """
    mounted: list[Path] = []

    def make(name: str, size: str = "2m", read_only: bool = False) -> Path | None:
        path = tmp_path / name
        path.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            return None
        options = f"size={size},mode=0755" + (",ro" if read_only else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            return None
        mounted.append(path)
        return path

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def refused_at_start(checkpoint_dir: str, tmp_path: Path, *extra: str) -> str:
    """Run train; assert it exits 2 with one error line and no traceback; return that line."""
    proc = run_module("train", *TRAIN, f"checkpoint.dir={checkpoint_dir}",
                      f"log.dir={tmp_path / 'logs'}", *extra, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert "step 1/" not in proc.stdout   # refused before training
    return errors[0]


# ------------------------------------------------------------------ at start --

def test_a_file_as_checkpoint_dir_is_refused_at_start(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a directory\n")
    error = refused_at_start(str(path), tmp_path)
    assert error == f"error: checkpoint.dir={path} is not a directory (a file of that name exists)"


def test_a_read_only_checkpoint_dir_is_refused_at_start(tmp_path, tmpfs):
    mount = tmpfs("ro", read_only=True)
    if mount is not None:
        cause = "read-only file system (EROFS)"
    elif os.geteuid() != 0:
        mount = tmp_path / "ro"
        mount.chmod(0o555)   # honoured for a non-root user
        cause = "permission denied (EACCES)"
    else:
        pytest.skip("running as root without the right to mount: root writes through "
                    "permission bits, so no read-only directory can be made")
    try:
        error = refused_at_start(str(mount / "ckpt"), tmp_path)
    finally:
        if not os.path.ismount(mount):
            mount.chmod(0o755)   # let pytest remove tmp_path
    assert error == (f"error: checkpoint.dir={mount / 'ckpt'} is not usable: cannot create "
                     f"{mount / 'ckpt'}: {cause}")


def test_too_little_space_for_the_checkpoints_to_keep_is_refused(tmp_path, tmpfs, ckpt,
                                                                   monkeypatch):
    layout, storage_mod = ckpt
    mount = tmpfs("small", size="2m")
    root = (mount or tmp_path / "small") / "ckpt"
    storage = storage_mod.LocalStorage(root)
    save_and_commit(storage, layout, 2, numel=150_000)         # about 600 kB
    one = sum(p.stat().st_size for p in (root / layout.step_name(2)).iterdir()
              if p.name != "commit.json")
    if mount is None:  # no tmpfs: report the free space a 2 MiB disk would have left
        monkeypatch.setattr(storage_mod.LocalStorage, "free_bytes",
                            lambda self: (2 << 20) - one - 8192)
    free = storage.free_bytes()
    assert one * 3 > free > one                               # room for one more, not three
    # keep_last=3: three kept plus one being written; one is there already.
    with pytest.raises(errors_mod.StorageError) as refused:
        layout.check_storage(storage, keep_last=3)
    needed = errors_mod.human_bytes(one * 3)
    assert str(refused.value) == (
        f"checkpoint.dir={root} has not enough free space: {needed} needed (checkpoint.keep_last"
        f"=3 + 1 checkpoints of {errors_mod.human_bytes(one)} each, less "
        f"{errors_mod.human_bytes(one)} held already), {errors_mod.human_bytes(free)} free")
    layout.check_storage(storage, keep_last=1)   # fits: no error
    if mount is not None:  # and train itself exits 2 with that sentence
        error = refused_at_start(str(root), tmp_path, "checkpoint.keep_last=3")
        assert error.startswith(f"error: checkpoint.dir={root} has not enough free space: ")


def test_no_checkpoint_yet_skips_the_space_check(tmp_path, ckpt, monkeypatch):
    layout, storage_mod = ckpt
    storage = storage_mod.LocalStorage(tmp_path / "fresh")
    monkeypatch.setattr(storage_mod.LocalStorage, "free_bytes", lambda self: 0)
    layout.check_storage(storage, keep_last=3)
    # Made by the check, with nothing in it but the file that keeps it out of git.
    assert [p.name for p in (tmp_path / "fresh").iterdir()] == [".gitignore"]


# ----------------------------------------------------------- during a save --

class FailingWriter(FileSystemWriter):
    """A storage writer whose data write fails with ``code``, as a full or locked disk's."""

    def __init__(self, path: str, code: int) -> None:
        super().__init__(path)
        self.code = code

    def write_data(self, plan, planner):
        raise OSError(self.code, os.strerror(self.code), f"{self.path}/__0_0.distcp")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_a_failed_save_is_one_sentence_with_path_and_errno(tmp_path, code):
    path = str(tmp_path / "step_000000004.tmp")
    with pytest.raises(CheckpointException) as failed:
        dcp.save({"w": torch.ones(8)}, storage_writer=FailingWriter(path, code), no_dist=True)
    text = errors_mod.describe_save_error(failed.value, path)
    name = errno.errorcode[code]
    assert text == (f"checkpoint save to {path} failed (rank 0): "
                    f"{os.strerror(code).lower()} ({name})")


def test_a_failed_save_that_is_not_an_os_error_names_the_exception():
    """A KeyError's text alone is a bare key (torch 2.11's stager: ``<class 'type'>``)."""
    relayed = CheckpointException("write", {0: (KeyError(type), None)})
    assert errors_mod.describe_save_error(relayed, "s3://b/x") == \
        "checkpoint save to s3://b/x failed (rank 0): KeyError: <class 'type'>"


def test_a_full_disk_during_a_save_is_named(tmp_path, tmpfs, monkeypatch):
    mount = tmpfs("full", size="1m")
    if mount is None:
        pytest.skip("needs a tmpfs (root with mount rights); "
                    "test_a_failed_save_is_one_sentence_with_path_and_errno covers ENOSPC")
    path = str(mount / "step_000000004.tmp")
    with pytest.raises(CheckpointException) as failed:    # 2 MiB into 1 MiB
        dcp.save({"w": torch.ones(1 << 19)}, storage_writer=FileSystemWriter(path),
                 no_dist=True)
    assert "unexpected pos" in str(failed.value)          # what DCP itself says
    text = errors_mod.describe_save_error(failed.value, path)
    assert text == f"checkpoint save to {path} failed (rank 0): no space left on device (ENOSPC)"
    # From another rank or the checkpoint process the OSError behind it is lost in
    # transit; the free space left on the disk still tells.
    relayed = CheckpointException("write", {1: (RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), None)})
    text = errors_mod.describe_save_error(relayed, path)
    assert text.startswith(f"checkpoint save to {path} failed (rank 1): [enforce fail at "
                           "inline_container.cc:672] . unexpected pos 704 vs 598 (a write "
                           "came up short); the filesystem has ")
    assert text.endswith("probably out of space (ENOSPC)")


# ------------------------------------------------------------- object stores --

@pytest.fixture
def s3_server(monkeypatch):
    """A local moto S3 server with one bucket; the environment points clients at it."""
    server = moto_s3(monkeypatch, "probe-bucket")
    yield
    server.stop()


def test_object_store_probe_writes_and_names_a_missing_bucket(s3_server, ckpt):
    _, storage_mod = ckpt
    import fsspec

    good = storage_mod.FsspecStorage("s3://probe-bucket/run")
    good.fs.invalidate_cache()
    storage_mod.probe(good)
    assert fsspec.filesystem("s3", skip_instance_cache=True).ls(
        "probe-bucket", refresh=True) == []                      # the probe object is gone
    with pytest.raises(errors_mod.StorageError) as refused:
        storage_mod.probe(storage_mod.FsspecStorage("s3://no-such-bucket/run"))
    assert str(refused.value).startswith(
        "checkpoint.dir=s3://no-such-bucket/run is not usable: cannot write an object to it: "
        "the bucket or container does not exist")


def test_object_store_without_credentials_is_refused_at_start(tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                       "AWS_CONFIG_FILE": str(tmp_path / "none"),
                       "AWS_EC2_METADATA_DISABLED": "true",       # no instance role either
                       "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}.items():
        monkeypatch.setenv(key, value)
    error = refused_at_start("s3://some-bucket/run", tmp_path)
    assert error.startswith("error: checkpoint.dir=s3://some-bucket/run is not usable: cannot "
                            "list it: no credentials found (NoCredentialsError): set them")
