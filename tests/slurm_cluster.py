"""A real one-node Slurm on this machine, for the launch-file tests.

Debian's ``slurm-wlm`` and ``munge`` (installed here with apt-get when missing and this
is root): a ``munged`` of the cluster's own (key, socket and pid file in a directory of
its own: a munged already running here is left alone), then ``slurmctld`` and ``slurmd``
with a configuration of their own in a temporary directory (free ports, no cgroups, no
accounting daemon). All three run in the foreground as the test's children, so that
``stop()`` ends them by their handles, in bounded waits; ``kill_leftovers()`` then
kills and names whatever still carries the cluster's ``SLURM_CONF`` (a daemon, a job
step): the tests fail on it. ``reason_unavailable()`` says why it cannot run, if so.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from conftest import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
SBIN = ("/usr/sbin", "/usr/bin")
INSTALL_TIMEOUT_S = 900
READY_TIMEOUT_S = 60
JOBS_END_TIMEOUT_S = 60   # KillWait (30 s) and a margin
STOP_TIMEOUT_S = 30       # a daemon's SIGTERM, before its SIGKILL


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
    """``munged``, ``slurmctld`` and ``slurmd`` for one node (this machine), root as
    SlurmUser."""

    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root, self.host = root, socket.gethostname()
        for name in ("state", "spool", "log"):
            (root / name).mkdir(parents=True, exist_ok=True)
        # Not under root: munged (user munge) must reach its socket from / on.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="resumable-munge-", dir="/tmp"))
        self.conf = root / "slurm.conf"
        self.conf.write_text("\n".join([
            "ClusterName=tests", f"SlurmctldHost={self.host}", "SlurmUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={self.munge_dir / 'munge.socket'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
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
        # Every process of the cluster (daemons, job steps) carries it: leftovers() finds them.
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.daemons: list[subprocess.Popen] = []

    def start(self) -> None:
        """The three daemons, the node idle; on a failure, what started is stopped."""
        try:
            self._start_munge()
            for name, *args in (("slurmctld",), ("slurmd", "-N", self.host)):
                self._spawn([which(name), "-D", "-f", str(self.conf), *args], name)
            deadline = time.monotonic() + READY_TIMEOUT_S
            while self.run("sinfo", "-h", "-o", "%T").stdout.strip() != "idle":
                if time.monotonic() > deadline or self._one_exited():
                    raise RuntimeError("Slurm's node never became idle:\n" + self.logs())
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, command: list[str], name: str, **popen) -> None:
        with open(self.root / "log" / f"{name}.stderr", "ab") as out:
            self.daemons.append(subprocess.Popen(
                command, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, **popen))

    def _start_munge(self) -> None:
        """munged in the foreground (its handle is the daemon), as user munge, with a key
        of its own; its directory is munge's and open to all, as munged requires."""
        d = self.munge_dir
        (d / "munge.key").write_bytes(os.urandom(1024))
        (d / "munge.key").chmod(0o400)
        for path in (d, d / "munge.key"):
            shutil.chown(path, "munge", "munge")
        d.chmod(0o755)
        self._spawn([which("munged"), "--foreground", f"--socket={d / 'munge.socket'}",
                     f"--key-file={d / 'munge.key'}", f"--pid-file={d / 'munged.pid'}",
                     f"--seed-file={d / 'munged.seed'}", f"--log-file={d / 'munged.log'}"],
                    "munged", user="munge", group="munge", extra_groups=[])
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (d / "munge.socket").exists():
            if time.monotonic() > deadline or self._one_exited():
                raise RuntimeError("munged did not start:\n" + self.logs())
            time.sleep(0.1)

    def _one_exited(self) -> bool:
        return any(proc.poll() is not None for proc in self.daemons)

    def stop(self) -> None:
        """Every job cancelled and ended, then slurmd, slurmctld and munged (SIGTERM, and
        SIGKILL after ``STOP_TIMEOUT_S``)."""
        if self.daemons and not self._one_exited():
            try:
                self.run("scancel", "--full", "--quiet", "--partition=tests")
                deadline = time.monotonic() + JOBS_END_TIMEOUT_S
                while (self.run("squeue", "-h", "-o", "%i").stdout.strip()
                       and time.monotonic() < deadline):
                    time.sleep(0.5)
            except subprocess.TimeoutExpired:
                pass   # slurmctld does not answer: kill_leftovers() names its jobs' steps
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass   # kill_leftovers() names it
        self.daemons.clear()
        shutil.rmtree(self.munge_dir, ignore_errors=True)

    def kill_leftovers(self, grace: float = 5) -> list[str]:
        """After ``stop()``: what still runs of the cluster (its ``leftovers()``) once
        ``grace`` seconds have passed, SIGKILLed now; nothing when the stop did its work."""
        deadline = time.monotonic() + grace   # a job step's last moments
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return [f"{pid} {command}" for pid, command in left]

    def leftovers(self) -> list[tuple[int, str]]:
        """The live processes (zombies aside) whose environment holds this cluster's
        ``SLURM_CONF``: its daemons, its jobs' steps, what they started."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if marker not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                    continue
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace").strip()
            except (OSError, IndexError):
                continue   # gone, or not ours to read
            found.append((int(entry.name), command))
        return found

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
        paths = [*sorted((self.root / "log").iterdir()), self.munge_dir / "munged.log"]
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                         for p in paths if p.is_file())
