"""docs/PREEMPTION.md: the numbers it states are the ones the generated code uses."""

from __future__ import annotations

import re

import pytest
import yaml

from conftest import package_of, render, run_in


@pytest.mark.parametrize("answers", [
    {"grace_period_seconds": 45.5, "cloud": "gcp", "launchers": ["slurm", "kubernetes"]},
    {"grace_period_seconds": 30.0, "cloud": "none", "launchers": []},
], ids=["gcp-slurm-k8s", "defaults"])
def test_preemption_doc_states_the_generated_timeouts(tmp_path, answers):
    project = render(tmp_path / "p", **answers)
    doc = (project / "docs/PREEMPTION.md").read_text(encoding="utf-8")
    package = package_of(project)
    # The shutdown timeout torchrun really gets, from the generated launch builder.
    proc = run_in(project, "-c", f"from {package}.config import PreemptionConfig\n"
                  f"from {package}.launch.torchrun import shutdown_timeout_s\n"
                  f"print(shutdown_timeout_s(PreemptionConfig("
                  f"grace_period_s={answers['grace_period_seconds']})))")
    timeout = int(proc.stdout.strip())
    assert f"--shutdown-timeout={timeout}`" in doc
    assert f"`terminationGracePeriodSeconds` ≥ {timeout}" in doc
    config = yaml.safe_load((project / "configs/train.yaml").read_text())["preemption"]
    assert f"| `grace_period_s` | `{config['grace_period_s']}` |" in doc
    assert f"| `notice_source` | `{config['notice_source']}` |" in doc
    assert f"| `exit_code` | `{config['exit_code']}` |" in doc
    for launcher, path in [("slurm", "launch/slurm.sbatch"),
                           ("kubernetes", "launch/kubernetes.yaml"),
                           ("skypilot", "launch/skypilot.yaml")]:
        named = f"`{path}` does this" in doc
        assert named == (launcher in answers["launchers"]) == (project / path).is_file()
    assert f"python -m {package}.resume" in doc
    assert not re.search(r"{{|}}|{%|%}", doc)
