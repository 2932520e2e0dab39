"""Cloud presets: answer files for `copier copy --data-file`, as an image builder uses them.

Each renders with no question asked, and its checklist has no failed item except those
the preset lists on `# expected-failure: <item>` lines.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO

PRESETS = sorted((REPO / "presets").glob("*.yml"))
NOTICE = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}


def test_the_presets_the_readme_promises_exist():
    names = {path.name for path in PRESETS}
    assert names == {"aws-spot.yml", "gcp-spot.yml", "azure-spot.yml", "slurm.yml",
                     "kubernetes.yml"}
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "## For image builders" in readme
    for name in names:
        assert f"presets/{name}" in readme


def failed_items(checklist: str) -> set[str]:
    """The checklist items (their bold titles) with a ❌ in them or in their sub-items."""
    failed, item = set(), None
    for line in checklist.split("## 2.", 1)[1].splitlines():
        title = re.match(r"^- \[[ x]\] \*\*(.+?)\*\*", line)
        if title:
            item = title.group(1)
        elif not line.startswith(" "):
            item = None
        if "❌" in line:
            assert item is not None, line
            failed.add(item)
    return failed


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_renders_with_no_unexpected_checklist_failure(tmp_path, preset):
    copier = Path(sys.executable).with_name("copier")
    dst = tmp_path / "run"
    # As the README's first-boot command: --defaults, the preset, one --data on top.
    proc = subprocess.run([str(copier), "copy", "--defaults", "--vcs-ref", "HEAD", "--quiet",
                           "--data-file", str(preset), "--data", "project_name=llm-pretrain",
                           str(REPO), str(dst)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]

    answers = yaml.safe_load(preset.read_text(encoding="utf-8"))
    recorded = yaml.safe_load((dst / ".copier-answers.yml").read_text(encoding="utf-8"))
    assert recorded["project_name"] == "llm-pretrain"
    for name, value in answers.items():
        # The numeric questions are text (copier.yml): 120.0 is recorded as '120.0'.
        assert recorded[name] == (str(value) if isinstance(value, (int, float)) else value), name
    # The platform's real notice window: the grace period is exactly the notice.
    if answers["cloud"] in NOTICE:
        assert answers["grace_period_seconds"] == NOTICE[answers["cloud"]]
        assert answers["launchers"] == ["skypilot"]
    for launcher in answers["launchers"]:
        assert any((dst / "launch").glob(f"{launcher}.*")), launcher

    text = preset.read_text(encoding="utf-8")
    assert re.search(r"^# .*mtbi_hours \d+", text, re.MULTILINE), "MTBI stated as an assumption"
    expected = set(re.findall(r"^# expected-failure: (.+)$", text, re.MULTILINE))
    if not expected:
        assert "# Expected failures in docs/CHECKLIST.md: none." in text
    checklist = (dst / "docs" / "CHECKLIST.md").read_text(encoding="utf-8")
    assert failed_items(checklist) == expected
