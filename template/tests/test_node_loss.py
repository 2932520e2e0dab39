"""The node-loss drill: ``drill --save-nodes 2 --kill node --resume-ranks 1``.

Two torchrun agents on this machine (each its own ``resume --nnodes 2``, node 0 hosting
the rendezvous); one node's whole process tree is SIGKILLed a few steps after a
checkpoint, with no signal to anyone; the other must notice, stop within
recovery.rendezvous_timeout_s and a margin, exit 74 and leave nothing behind; the run
then resumes on one node and is compared with an uninterrupted one.
"""

from __future__ import annotations

import json

import pytest

from conftest import project_module, run_module

NODE_LOST = 74
RENDEZVOUS_S = 10  # a short wait for a lost node keeps the suite quick


@pytest.mark.slow
@pytest.mark.parametrize("lost", ["0", "1", "rank0"],
                         ids=["rendezvous-host-lost", "other-node-lost", "rank0-node-lost"])
def test_node_loss_drill(tmp_path, lost):
    """``drill --save-nodes 2 --kill node --resume-ranks 1``: the other node notices,
    stops within the bound, exits 74 and leaves nothing running or torn, nor a lease
    (rank 0, which holds it, may be on either node: torchrun assigns the ranks); the
    run then resumes on one node and matches the uninterrupted one."""
    out = tmp_path / "drill"
    proc = run_module("drill", "--save-ranks", "2", "--save-nodes", "2", "--kill", "node",
                      "--lost-node", lost, "--resume-ranks", "1", "--out", str(out),
                      "--steps", "16", "--interrupt-at", "8",
                      f"recovery.rendezvous_timeout_s={RENDEZVOUS_S}", check=False,
                      timeout=600)
    report = json.loads((out / "report.json").read_text())
    assert proc.returncode == 0 and report["passed"], proc.stdout[-3000:]
    loss = report["node_loss"]
    if lost == "rank0":
        assert 0 in loss["lost_ranks"]
    else:
        assert loss["lost_node"] == int(lost) and loss["rendezvous_host"] == (lost == "0")
    assert loss["lost_ranks"] and not loss["left_running"] and not loss["problems"]
    (survivor, end), = loss["survivors"].items()
    assert int(survivor) == 1 - loss["lost_node"] and end["status"] == NODE_LOST
    assert end["seconds"] <= RENDEZVOUS_S + project_module("tools.drill_nodes").NOTICE_MARGIN_S
    assert loss["lease_after"] is None  # released: the next start is not kept waiting
    assert 0 <= report["steps_redone"] <= report["interval_steps"]  # at most one interval
    assert ("the rendezvous host" in (out / "report.md").read_text()) == loss["rendezvous_host"]
