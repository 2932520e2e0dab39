"""A real one-node Slurm on this machine, for the launch-file tests.

Debian's ``slurm-wlm`` and ``munge`` (installed here with apt-get when missing and this
is root): ``munged``, then ``slurmctld`` and ``slurmd`` with a configuration of their own
in a temporary directory (free ports, no cgroups, no accounting daemon), started for the
tests and stopped after them. ``reason_unavailable()`` says why it cannot run, if so.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from conftest import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
SBIN = ("/usr/sbin", "/usr/bin")
INSTALL_TIMEOUT_S = 900
READY_TIMEOUT_S = 60


def which(name: str) -> str | None:
    return shutil.which(name) or next(
        (f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def reason_unavailable() -> str | None:
    """None when the daemons are (or could now be) installed; otherwise why not."""
    if all(which(name) for name in DAEMONS):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed and cannot be here (needs root and apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for attempt in (["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"],
                    ["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]):
        proc = subprocess.run(attempt, env=env, capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S, check=False)
        if attempt[1] == "install" and proc.returncode == 0:
            return None
    return f"apt-get could not install slurm-wlm and munge: {proc.stderr.strip()[-300:]}"


class Cluster:
    """``slurmctld`` and ``slurmd`` for one node (this machine), root as SlurmUser."""

    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root, self.host = root, socket.gethostname()
        for name in ("state", "spool", "log"):
            (root / name).mkdir(parents=True, exist_ok=True)
        self.conf = root / "slurm.conf"
        self.conf.write_text("\n".join([
            "ClusterName=tests", f"SlurmctldHost={self.host}", "SlurmUser=root",
            "AuthType=auth/munge", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "ReturnToService=2", "KillWait=30", "MinJobAge=3600",
            "SchedulerParameters=sched_interval=2",
            f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log/slurmctld.log'}",
            f"SlurmdLogFile={root / 'log/slurmd.log'}",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={root / 'jobcomp.txt'}",
            f"NodeName={self.host} CPUs={cpus} RealMemory=4000 State=UNKNOWN",
            f"PartitionName=tests Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            ""]))
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> None:
        start_munge()
        for command in ([which("slurmctld"), "-f", str(self.conf)],
                        [which("slurmd"), "-f", str(self.conf), "-N", self.host]):
            subprocess.run(command, env=self.env, check=True, timeout=60)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.run("sinfo", "-h", "-o", "%T").stdout.strip() != "idle":
            if time.monotonic() > deadline:
                raise RuntimeError("Slurm's node never became idle:\n" + self.logs())
            time.sleep(0.5)

    def stop(self) -> None:
        self.run("scancel", "--full", "--quiet", "--partition=tests")
        for name in ("slurmd", "slurmctld"):
            pid_file = self.root / f"{name}.pid"
            try:
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGTERM)
            except (FileNotFoundError, ValueError, ProcessLookupError):
                continue
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.2)

    def run(self, *command: str, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([which(command[0]) or command[0], *command[1:]], cwd=cwd,
                              env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=60, check=False)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of one job (empty once Slurm forgot it)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_for(self, job_id: str, condition, what: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if condition(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: {what} not within {timeout:g} s; now "
                                     f"{fields.get('JobState')} {fields.get('Reason')}")
            time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:]
                         for p in sorted((self.root / "log").glob("*.log")))


def start_munge() -> None:
    """munged with a key, unless one is running already."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True, check=False).returncode == 0:
        return
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(os.urandom(1024))
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    for directory in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
        Path(directory).mkdir(parents=True, exist_ok=True)
        shutil.chown(directory, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", which("munged")], check=True, timeout=30)
