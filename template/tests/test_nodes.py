"""Two nodes on one machine: two torchrun agents, each started by ``resume --nnodes 2``,
meeting through torchrun's c10d rendezvous on the loopback address (node 0 hosts it).

A preemption notice that reaches one node stops both at the same step with one final
checkpoint; a node lost without a word (its whole process tree SIGKILLed) makes the
other stop by itself within recovery.rendezvous_timeout_s and exit 74, and the run
resumes on one node (the drill: tests/test_node_loss.py, rendered with multi_node_drill).
The quick tests check how ``resume`` reads a node loss.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from conftest import (
    finish,
    overrides_for,
    project_module,
    read_events,
    run_module,
    start,
    torchrun,
    wait_until,
)

CONFIG = "configs/train.yaml"
SMALL = ("model.d_model=32", "model.n_layers=1", "log.every_steps=1")
overrides = overrides_for(*SMALL)


def start_nodes(tmp_path: Path, dirs: dict[str, str], *extra: str) -> list:
    nodes = project_module("tools.local_nodes").Nodes.plan(2, 2)
    return [start("resume", *nodes.command(node, [], overrides(dirs, *extra))[3:],
                  log_file=tmp_path / f"node{node}.log") for node in range(2)]


@pytest.mark.slow
def test_a_notice_to_one_node_stops_both_together_then_one_node_resumes(tmp_path):
    """SIGTERM reaches node 1's launcher only (a cloud notice seen by one VM): both nodes
    stop at the same step with one preemption checkpoint and exit 75; one node with one
    rank resumes from it and continues the uninterrupted run within the drill's
    tolerance (another world size)."""
    reference = {"ckpt": str(tmp_path / "ref-ckpt"), "logs": str(tmp_path / "ref-logs")}
    torchrun(2, "train", *overrides(reference, "train.max_steps=30"))
    dirs = {"ckpt": str(tmp_path / "ckpt"), "logs": str(tmp_path / "logs")}
    nodes = start_nodes(tmp_path, dirs, "train.max_steps=30", "checkpoint.interval_steps=1000")
    try:
        wait_until(lambda: any(e["step"] >= 8 for e in read_events(Path(dirs["logs"]), "step")),
                   nodes[0], "step 8 on two nodes", log_file=tmp_path / "node0.log")
        nodes[1].send_signal(signal.SIGTERM)
        codes = [finish(node, 180) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert codes == [75, 75], (tmp_path / "node0.log").read_text()[-3000:]
    saves = read_events(Path(dirs["logs"]), "save")
    assert [e.get("reason") for e in saves] == ["preemption"]
    stopped = saves[0]["step"]
    steps = [e["step"] for e in read_events(Path(dirs["logs"]), "step")]
    assert max(steps) == stopped  # no rank ran past the step the stop was agreed at

    run_module("resume", "--nproc-per-node", "1", *overrides(dirs, "train.max_steps=30"),
               timeout=300)
    drill_report = project_module("tools.drill_report")
    resumed = drill_report.split_runs(Path(dirs["logs"]))[-1]
    assert resumed.start["step"] == stopped and resumed.start["world_size"] == 1
    ref = drill_report.split_runs(Path(reference["logs"]))[0]
    diffs = drill_report.compare(ref.steps, resumed.steps)
    assert diffs["compared_steps"] == list(range(stopped + 1, 31))
    assert diffs["max_rel_loss_diff"] < drill_report.RESHARD_REL_TOL


@pytest.mark.slow
def test_a_replacement_node_rejoins_and_training_continues_in_place(tmp_path):
    """What Kubernetes does for a lost pod: a new node 1 (the same ``resume`` command)
    starts while node 0 waits in its rendezvous; torchrun restarts the workers in place
    on both, training resumes from the newest checkpoint and both nodes finish with 0."""
    dirs = {"ckpt": str(tmp_path / "ckpt"), "logs": str(tmp_path / "logs")}
    args = overrides(dirs, "train.max_steps=40", "checkpoint.interval_steps=10",
                     "recovery.rendezvous_timeout_s=60")
    nodes = project_module("tools.local_nodes").Nodes.plan(2, 2)

    def node(index: int, log: str):
        return start("resume", *nodes.command(index, [], args)[3:], log_file=tmp_path / log)

    procs = [node(0, "node0.log"), node(1, "node1.log")]
    try:
        logs = Path(dirs["logs"])
        wait_until(lambda: any(e["step"] == 10 for e in read_events(logs, "save"))
                   and any(e["step"] >= 12 for e in read_events(logs, "step")),
                   procs[0], "checkpoint 10 and step 12 on two nodes",
                   log_file=tmp_path / "node0.log")
        project_module("runtime.process_tree").kill_tree(procs[1].pid)
        procs[1].wait()
        time.sleep(2)
        procs[1] = node(1, "node1-replacement.log")
        codes = [finish(proc, 300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                project_module("runtime.process_tree").kill_tree(proc.pid)
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:]
    starts = read_events(Path(dirs["logs"]), "start")
    assert [(e["step"], e["restart"], e["world_size"]) for e in starts] == [(0, 0, 2),
                                                                         (10, 1, 2)]
    assert read_events(Path(dirs["logs"]), "recovered")[0]["step"] == 11
    assert max(e["step"] for e in read_events(Path(dirs["logs"]), "step")) == 40


def test_the_start_counts_the_jobs_restart_when_rank_0_is_on_a_replacement_node(tmp_path):
    """The rendezvous orders the nodes by address and pid, so after a replacement node
    joins, global rank 0 may be on it: its torchrun counts restart 0 while its peer's
    counts 1. The start event (which the ledger reads to tell an in-place restart from a
    new job) carries the job's count, the highest. Two ranks started by hand, each the
    only rank of its "node", with the environment torchrun gives them."""
    dirs = {"ckpt": str(tmp_path / "ckpt"), "logs": str(tmp_path / "logs")}
    port = str(project_module("tools.local_nodes").free_port())
    procs = []
    try:
        for rank, restart in ((0, 0), (1, 1)):   # rank 0: the replacement's new worker
            env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                   "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                   "TORCHELASTIC_RESTART_COUNT": str(restart),
                   "TORCHELASTIC_MAX_RESTARTS": "3"}
            procs.append(start("train", *overrides(dirs, "train.max_steps=2"),
                               log_file=tmp_path / f"rank{rank}.log", env=env))
        codes = [finish(proc, 300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    starts = read_events(Path(dirs["logs"]), "start")
    assert [(e["restart"], e["world_size"]) for e in starts] == [(1, 2)]


# --------------------------------------------- how resume reads a node loss --
def _record(exits: Path, rank: int, state: str, restart: int, started: float) -> None:
    exits.mkdir(parents=True, exist_ok=True)
    (exits / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "host": "h", "pid": 1, "run_id": "j", "restart": restart,
         "started": started, "state": state, "step": 5, "reason": "DistBackendError: x",
         "time": started + 1}))


@pytest.mark.parametrize("states, restart, lost", [
    (["crashed"], 0, True),         # a peer's death broke a collective; no restart followed
    (["hung"], 1, True),            # a silent peer met the watchdog; restart 2 never began
    (["running"], 0, True),         # this node's rank died without a word, restarts left
    (["crashed"], 3, False),        # the in-place restarts were used up: a crash
    (["ended"], 0, False),          # training decided its status
    ([], 0, False),                 # no start in this launch: the first meeting failed
])
def test_resume_reads_a_node_loss_from_the_exit_records(tmp_path, states, restart, lost):
    supervisor = project_module("launch.supervisor")
    recovery = project_module("config").RecoveryConfig(max_restarts=3)
    since = time.time()
    _record(tmp_path / "exits", 7, "running", 0, since - 100)   # an earlier launch's rank
    for rank, state in enumerate(states):
        _record(tmp_path / "exits", rank, state, restart, since + 1)
    why = supervisor.node_lost_since(tmp_path, since, recovery)
    assert (why is not None) == lost
    if lost:
        assert "recovery.rendezvous_timeout_s" in why and "rank 0" in why


def test_resume_asks_torchrun_to_bound_the_wait_for_nodes(tmp_path, capsys):
    supervisor = project_module("launch.supervisor")
    code = supervisor.main(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
                            "h0:29500", "--rdzv-conf", "is_host=1", "--dry-run", "--config",
                            CONFIG, f"checkpoint.dir={tmp_path}",
                            "recovery.rendezvous_timeout_s=42.5"])
    assert code == 0
    assert "--rdzv-conf=is_host=1,join_timeout=43" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        supervisor.main(["--rdzv-conf", "join_timeout=5", "--dry-run"])
    assert info.value.code == 2 and "recovery.rendezvous_timeout_s" in capsys.readouterr().err


def test_a_lease_of_an_earlier_run_of_the_same_job_is_taken_over(tmp_path, monkeypatch):
    """A Slurm job requeued (or a Kubernetes pod replaced) on another machine finds the
    lease its earlier run left when its node vanished: same scheduler job id, taken over
    at once; another job's fresh lease is waited for."""
    lease_mod = project_module("checkpoint.store.lease")
    storage = project_module("checkpoint.store.storage").open_storage(str(tmp_path))
    now = time.time()
    for variable in lease_mod.JOB_ID_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    earlier = {"host": "lost-vm", "pid": 1, "job_id": "4242", "acquired": now, "heartbeat": now}
    storage.write_text_durable(lease_mod.LEASE_FILE, json.dumps(earlier))
    notice = lease_mod.Lease(storage, stale_s=120, wait_s=0).acquire()
    assert notice is not None and "an earlier run of this job (4242)" in notice
    other = {**earlier, "job_id": "777", "heartbeat": time.time()}
    storage.write_text_durable(lease_mod.LEASE_FILE, json.dumps(other))
    with pytest.raises(lease_mod.LeaseHeld):
        lease_mod.Lease(storage, stale_s=120, wait_s=0).acquire()
    assert lease_mod.Lease(storage, stale_s=1, wait_s=0).release_for_ended_job("4242") is None
    assert lease_mod.Lease(storage, stale_s=1, wait_s=0).release_for_ended_job("777")
    assert lease_mod.Lease(storage, stale_s=1, wait_s=0).owner() is None
