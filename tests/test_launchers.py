"""The launch files are runnable as generated: valid for their schedulers, one GPU count.

Kubernetes files are checked against Kubernetes' own OpenAPI schemas (kubernetes-validate,
strict: an unknown field fails), the SkyPilot task against SkyPilot's schema and task
parser, and the Slurm script is submitted to a fake `sbatch` that checks what Slurm
would and then runs its body with fake `srun` and `scontrol` on PATH.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from conftest import free_port, render

KUBERNETES_VERSION = "1.30.0"  # the oldest release the Job's fields need (podFailurePolicy GA)
# Several nodes: an Indexed Job with backoffLimitPerIndex (GA in 1.33); the file says so.
MULTI_NODE_KUBERNETES_VERSION = "1.33.0"
ALL = {"launchers": ["slurm", "kubernetes", "skypilot"], "project_name": "Spot Trainer",
       "gpus_per_node": 4, "keep_last": 2, "checkpoint_size_gb": 20.0,
       "grace_period_seconds": 45.0}
MULTI_NODE = {**ALL, "nodes": 2}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("launchers") / "p", **ALL)


@pytest.fixture(scope="module")
def multi_node(tmp_path_factory) -> Path:
    """Every launcher for a job on two nodes."""
    return render(tmp_path_factory.mktemp("multi-node") / "p", **MULTI_NODE)


def kubernetes_docs(project: Path) -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((project / "launch/kubernetes.yaml").read_text()) if d]
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs)
    return by_kind


# -------------------------------------------------------------- GPU count ----

def test_gpus_per_node_reaches_every_launcher(project):
    sbatch = (project / "launch/slurm.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=4\n" in sbatch
    assert '--nproc-per-node "${SLURM_GPUS_ON_NODE:-4}"' in sbatch
    container = kubernetes_docs(project)["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["args"][:2] == ["--nproc-per-node", "4"]
    sky = yaml.safe_load((project / "launch/skypilot.yaml").read_text())
    assert sky["resources"]["accelerators"].endswith(":4")


@pytest.mark.parametrize("nodes", [1, 2])
def test_node_count_reaches_every_launcher(project, multi_node, nodes):
    """One `resume` per node everywhere; Kubernetes runs one pod per node."""
    path = multi_node if nodes == 2 else project
    directives = [line for line in (path / "launch/slurm.sbatch").read_text().splitlines()
                  if line.startswith("#SBATCH ")]
    assert f"#SBATCH --nodes={nodes}" in directives
    assert "#SBATCH --ntasks-per-node=1" in directives
    sky = yaml.safe_load((path / "launch/skypilot.yaml").read_text())
    assert sky["num_nodes"] == nodes and '--nnodes "$SKYPILOT_NUM_NODES"' in sky["run"]
    job = kubernetes_docs(path)["Job"]["spec"]
    args = job["template"]["spec"]["containers"][0]["args"]
    if nodes == 1:   # unchanged: one pod, no rendezvous flags
        assert "completionMode" not in job and "--nnodes" not in args
    else:
        assert job["completionMode"] == "Indexed"
        assert job["completions"] == job["parallelism"] == nodes
        assert args[args.index("--nnodes") + 1] == str(nodes)
    config = yaml.safe_load((path / "configs/train.yaml").read_text())
    assert config["plan"]["nodes"] == nodes


# ------------------------------------------------------------- Kubernetes ----

def test_training_never_runs_as_root(project):
    """The image's user and the pod's security context agree: uid 1000, no escalation."""
    dockerfile = (project / "Dockerfile").read_text()
    assert re.search(r"^USER 1000$", dockerfile, re.MULTILINE)
    assert dockerfile.index("USER 1000") > dockerfile.index("pip install")
    pod = kubernetes_docs(project)["Job"]["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000}
    container = pod["containers"][0]["securityContext"]
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}



CPU_NODES = {**ALL, "gpus_per_node": 0, "cpus_per_node": 16}


def test_cpu_nodes_get_one_process_per_node_and_no_gpu_request(tmp_path):
    project = render(tmp_path / "p", **CPU_NODES)
    sbatch = (project / "launch/slurm.sbatch").read_text()
    assert "--gpus-per-node" not in sbatch and "#SBATCH --cpus-per-task=16\n" in sbatch
    assert '--nproc-per-node "${SLURM_GPUS_ON_NODE:-1}"' in sbatch
    container = kubernetes_docs(project)["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert "resources" not in container and container["args"][:2] == ["--nproc-per-node", "1"]
    sky = yaml.safe_load((project / "launch/skypilot.yaml").read_text())
    assert "accelerators" not in sky["resources"] and '--nproc-per-node "1"' in sky["run"]


@pytest.mark.parametrize("answers", [ALL, {"launchers": ["kubernetes"], "project_name": "r" * 63,
                                           "image": "ghcr.io/me/run:v1", "cloud": "gcp"},
                                     CPU_NODES],
                         ids=["all-launchers", "long-name-registry-image", "cpu-nodes"])
def test_kubernetes_file_is_valid_for_kubernetes(tmp_path, answers):
    project = render(tmp_path / "p", **answers)
    docs = kubernetes_docs(project)
    assert set(docs) == {"PersistentVolumeClaim", "Job"}
    for doc in docs.values():
        # Raises ValidationError naming the field for anything Kubernetes would refuse.
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    pod = docs["Job"]["spec"]["template"]["spec"]
    claim = pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]  # defined, not assumed
    container = pod["containers"][0]
    assert container["image"] == answers.get("image", "spot-trainer:latest")
    assert container["imagePullPolicy"] == "IfNotPresent"
    dockerfile = (project / "Dockerfile").read_text()
    assert f"docker build -t {container['image']} ." in dockerfile


def test_multi_node_kubernetes_file_is_valid_and_meets_at_pod_0(project, multi_node):
    """nodes=2: an Indexed Job of two pods, one per node, meeting at pod 0 through a
    headless Service, on a volume several nodes can mount; valid for the release its
    header names and for the latest."""
    text = (multi_node / "launch/kubernetes.yaml").read_text()
    stated = re.search(r"^# Needs Kubernetes (\d+\.\d+) or later", text, re.MULTILINE)
    assert stated and f"{stated.group(1)}.0" == MULTI_NODE_KUBERNETES_VERSION
    docs = kubernetes_docs(multi_node)
    assert set(docs) == {"PersistentVolumeClaim", "Service", "Job"}
    for doc in docs.values():
        kubernetes_validate.validate(doc, MULTI_NODE_KUBERNETES_VERSION, strict=True)
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    job, service, claim = docs["Job"], docs["Service"], docs["PersistentVolumeClaim"]
    name, spec = job["metadata"]["name"], job["spec"]
    pod = spec["template"]["spec"]
    # Pod i is <job>-i.<subdomain>: the subdomain is the headless Service, which selects
    # the Job's pods and publishes pod 0's address before it is Ready.
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    assert [port["port"] for port in service["spec"]["ports"]] == [29500]
    container = pod["containers"][0]
    args = container["args"]
    assert args[args.index("--rdzv-endpoint") + 1] == f"{name}-0.{pod['subdomain']}:29500"
    assert args[args.index("--rdzv-id") + 1] == "$(JOB_ID)"
    (env,) = [e for e in container["env"] if e["name"] == "JOB_ID"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['batch.kubernetes.io/controller-uid']"
    assert args[-1] == "checkpoint.dir=/checkpoints"
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"] == {"matchLabels": {"batch.kubernetes.io/job-name": name}}
    # Retries per index; one index out of them ends the Job; a replacement only once the
    # old pod is terminal (the only value allowed with a podFailurePolicy).
    assert spec["backoffLimitPerIndex"] == 3 and spec["maxFailedIndexes"] == 0
    assert spec["podReplacementPolicy"] == "Failed" and "backoffLimit" not in spec
    # Pods on several nodes mount the claim: ReadWriteMany, and the file says where from.
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for kind in ("NFS", "Filestore", "EFS", "CephFS", "checkpoint.dir=s3://"):
        assert kind in text, kind
    # The rest as on one node: the same policy, grace budget, claim, image and user.
    single = kubernetes_docs(project)
    assert single["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    single_pod = single["Job"]["spec"]["template"]["spec"]
    assert spec["podFailurePolicy"] == single["Job"]["spec"]["podFailurePolicy"]
    for key in ("terminationGracePeriodSeconds", "securityContext", "volumes",
                "restartPolicy"):
        assert pod[key] == single_pod[key], key
    assert container["image"] == single_pod["containers"][0]["image"]


def pod_failure_action(policy: dict, exit_code: int, disrupted: bool = False) -> str:
    """What the Job controller does with a failed pod: the first matching rule decides
    (Kubernetes' podFailurePolicy); no match counts the failure against backoffLimit."""
    for rule in policy["rules"]:
        codes = rule.get("onExitCodes")
        if codes and codes["containerName"] == "trainer":
            inside = exit_code in codes["values"]
            if inside == (codes["operator"] == "In"):
                return rule["action"]
        for condition in rule.get("onPodConditions", []):
            if disrupted and condition["type"] == "DisruptionTarget":
                return rule["action"]
    return "Count"


@pytest.mark.parametrize("nodes", [1, 2])
def test_pod_failure_policy_retries_stops_and_counts(project, multi_node, nodes):
    """75, 74 (a node lost) and a disruption are retried for free; 79 fails the Job (never
    retried); 73, 2 (a lease not yet stale refuses too) and crashes count against
    backoffLimit, or with several nodes against the pod's index."""
    policy = kubernetes_docs(multi_node if nodes == 2 else project)["Job"]["spec"][
        "podFailurePolicy"]
    assert pod_failure_action(policy, 75) == "Ignore"
    assert pod_failure_action(policy, 74) == "Ignore"
    assert pod_failure_action(policy, 137, disrupted=True) == "Ignore"
    assert pod_failure_action(policy, 79) == "FailJob"
    assert pod_failure_action(policy, 79, disrupted=True) == "FailJob"
    assert pod_failure_action(policy, 73) == pod_failure_action(policy, 1) == "Count"
    assert pod_failure_action(policy, 2) == "Count"


def test_skypilot_recovers_only_what_a_retry_can_fix(project):
    recovery = yaml.safe_load((project / "launch/skypilot.yaml").read_text())["resources"][
        "job_recovery"]
    assert recovery["recover_on_exit_codes"] == [75, 73, 74]
    assert recovery["max_restarts_on_errors"] == 0   # so 79 ends the managed job


def test_volume_is_sized_from_the_checkpoint_estimate(project):
    pvc = kubernetes_docs(project)["PersistentVolumeClaim"]
    # keep_last 2 committed + 1 being written, 20 GB each = 60 GB = 55.9 GiB -> 56Gi.
    expected = math.ceil(20.0 * (2 + 1) * 1e9 / 2**30)
    assert pvc["spec"]["resources"]["requests"]["storage"] == f"{expected}Gi" == "56Gi"
    text = (project / "launch/kubernetes.yaml").read_text()
    assert "keep_last (2)" in text and "checkpoint_size_gb (20.0 GB)" in text


def test_an_invalid_kubernetes_object_is_caught():
    """The schema check is strict: a misspelt field fails."""
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
           "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [
               {"name": "t", "image": "x", "imagePullPolicy": "IfNotPresent",
                "resourcez": {}}]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


# --------------------------------------------------------------- SkyPilot ----

SKY_CHECK = """
import json, sys, yaml
import sky
from sky.utils import common_utils, schemas
parsed = []
for path in sys.argv[1:]:
    config = yaml.safe_load(open(path))
    common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
    task = sky.Task.from_yaml_config(config)
    (resources,) = task.resources
    parsed.append({"accelerators": resources.accelerators, "use_spot": resources.use_spot,
                   "num_nodes": task.num_nodes})
print(json.dumps(parsed))
"""


def test_skypilot_task_is_valid_for_skypilot(project, multi_node, tmp_path):
    # In one child (importing sky is slow) with its own HOME: importing sky writes ~/.sky.
    proc = subprocess.run([sys.executable, "-c", SKY_CHECK, str(project / "launch/skypilot.yaml"),
                           str(multi_node / "launch/skypilot.yaml")],
                          env=dict(os.environ, HOME=str(tmp_path)), capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed == [{"accelerators": {"A100": 4}, "use_spot": True, "num_nodes": nodes}
                      for nodes in (1, 2)]


# ------------------------------------------------------------------ Slurm ----

FAKE_SBATCH = """#!{python}
# A fake sbatch: checks the directives the way Slurm reads them, then runs the body
# at once (in the foreground), its output in the --output file as Slurm would.
import json, os, sys
script, *args = sys.argv[1:]
directives = {{}}
for line in open(script).read().splitlines()[1:]:
    if line.startswith("#SBATCH "):
        key, _, value = line[len("#SBATCH "):].strip().partition("=")
        directives[key] = value
    elif line.strip() and not line.startswith("#"):
        break  # Slurm stops reading directives at the first command
job_id = os.environ.get("FAKE_JOB_ID", "4242")
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    print("sbatch " + json.dumps(directives), file=log)
output = directives.get("--output", "slurm-%j.out").replace("%j", job_id)
# Slurm opens the output file before the script runs and creates no directory.
if not os.path.isdir(os.path.dirname(os.path.abspath(output))):
    print(f"slurmstepd: error: cannot open {{output}}: No such file or directory", file=sys.stderr)
    sys.exit(1)
os.environ.update(SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="node001",
                  SLURM_NNODES=directives.get("--nodes", "1"), SLURM_SUBMIT_DIR=os.getcwd(),
                  SLURM_GPUS_ON_NODE=os.environ.get("FAKE_GPUS_ON_NODE",
                                                    directives.get("--gpus-per-node", "1")))
fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
os.dup2(fd, 1)
os.dup2(fd, 2)
os.execvp("bash", ["bash", script, *args])
"""
FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$FAKE_SLURM_LOG"
if [ -n "${FAKE_SRUN_STUB:-}" ]; then exec "$FAKE_SRUN_STUB" "$@"; fi
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_SLURM_LOG"
if [ "$1 $2" = "show hostnames" ]; then echo localhost; fi
if [ "$1 $2" = "show job" ]; then echo "JobId=$3 JobState=RUNNING Reason=None Restarts=0"; fi
"""
# Stands in for `python -m <pkg>.resume ...`: ready, then exits on USR1 as a preempted
# run does (75), or FAKE_STUB_STATUS (74: as when a node of the job was lost meanwhile).
STUB = """#!{python}
import os, signal, sys
signal.signal(signal.SIGUSR1, lambda *_: (open(os.environ["FAKE_STUB_LOG"], "a")
                                          .write("USR1\\n"),
                                          sys.exit(int(os.environ.get("FAKE_STUB_STATUS",
                                                                      "75")))))
open(os.environ["FAKE_STUB_LOG"], "a").write(" ".join(sys.argv[1:]) + "\\n")
open(os.environ["FAKE_STUB_READY"], "w").close()
signal.pause()
"""


def fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH.format(python=sys.executable)),
                       ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("resume-stub", STUB.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # A wrapper, not a symlink: a symlink to the venv's python would lose the venv.
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)


def slurm_env(project: Path, bin_dir: Path, log: Path, **extra: str) -> dict[str, str]:
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                PYTHONPATH=str(project / "src"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                FAKE_SLURM_LOG=str(log), RDZV_PORT=str(free_port()), **extra)


def test_slurm_script_directives(project):
    sbatch = (project / "launch/slurm.sbatch").read_text()
    directives = [line for line in sbatch.splitlines() if line.startswith("#SBATCH ")]
    assert "#SBATCH --signal=B:USR1@75" in directives          # grace 45 s + 30 s margin
    assert "#SBATCH --requeue" in directives
    output = next(d for d in directives if d.startswith("#SBATCH --output="))
    # A file in the submit directory, which exists: Slurm creates no directory for it.
    assert "/" not in output.partition("=")[2]


def test_slurm_script_runs_training_under_fake_slurm(project, tmp_path):
    """sbatch from the project directory, as the README says: the body runs the real
    resume -> torchrun -> train on one CPU rank for two steps and exits 0."""
    bin_dir, log = tmp_path / "bin", tmp_path / "slurm.log"
    fake_slurm(bin_dir)
    env = slurm_env(project, bin_dir, log, FAKE_GPUS_ON_NODE="1")
    ckpt = tmp_path / "ck"
    proc = subprocess.run(
        ["sbatch", "launch/slurm.sbatch", "train.max_steps=2", "checkpoint.interval_steps=1",
         "checkpoint.async_mode=sync", f"checkpoint.dir={ckpt}", f"log.dir={tmp_path / 'logs'}",
         "model.d_model=32", "log.every_steps=1"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600, check=False)
    output = project / "slurm-4242.out"
    body = output.read_text() if output.exists() else ""
    assert proc.returncode == 0, proc.stderr + body[-5000:]
    calls = log.read_text().splitlines()
    directives = json.loads(calls[0].removeprefix("sbatch "))
    assert directives["--gpus-per-node"] == "4" and directives["--requeue"] == ""
    srun = next(c for c in calls if c.startswith("srun "))
    assert "python -m spot_trainer.resume --nproc-per-node 1 --nnodes 1" in srun
    assert directives["--cpus-per-task"] == "32"   # the default: 8 per GPU
    assert "--rdzv-id 4242" in srun
    assert not any(c.startswith("scontrol requeue") for c in calls)
    assert (ckpt / "step_000000002" / "commit.json").is_file()


@pytest.mark.parametrize(("status", "why"), [(75, "preempted with the state saved"),
                                             (74, "a node of the job was lost (exit 74)")])
def test_slurm_script_forwards_usr1_and_requeues_on_75(project, tmp_path, status, why):
    """Slurm's USR1 to the batch shell reaches the job step; exit 75 (or 74: a node lost)
    requeues the job."""
    bin_dir, log = tmp_path / "bin", tmp_path / "slurm.log"
    fake_slurm(bin_dir)
    stub_log, ready = tmp_path / "stub.log", tmp_path / "ready"
    env = slurm_env(project, bin_dir, log, FAKE_SRUN_STUB=str(bin_dir / "resume-stub"),
                    FAKE_STUB_LOG=str(stub_log), FAKE_STUB_READY=str(ready),
                    FAKE_JOB_ID="777", FAKE_STUB_STATUS=str(status))
    batch = subprocess.Popen(["sbatch", "launch/slurm.sbatch", "train.max_steps=9"],
                             cwd=project, env=env)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert batch.poll() is None and time.monotonic() < deadline, "the job step never started"
        time.sleep(0.05)
    batch.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@N does: to the batch shell
    assert batch.wait(timeout=60) == 0
    stub_calls = stub_log.read_text().splitlines()
    assert stub_calls[0].startswith("python -m spot_trainer.resume --nproc-per-node 4 --nnodes 1")
    assert stub_calls[0].endswith("train.max_steps=9") and stub_calls[1] == "USR1"
    assert "scontrol requeue 777" in log.read_text().splitlines()
    output = project / "slurm-777.out"
    assert f"{why}: requeueing job 777" in output.read_text()
    output.unlink()   # the module's project is shared: the next case starts a new file
