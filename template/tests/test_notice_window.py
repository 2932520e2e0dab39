"""The grace period a stop plans against never exceeds the cloud's notice window."""

from __future__ import annotations

import pytest

from conftest import project_module

config = project_module("config")
preemption = project_module("preemption.watch")


@pytest.mark.parametrize("source, grace, expected", [
    ("gcp", 45.5, 30.0),     # GCP gives 30 s: 45.5 s would plan a save the VM never sees
    ("azure", 60.0, 30.0),
    ("aws", 150.0, 120.0),
    ("aws", 90.0, 90.0),     # shorter than the notice: the grace period itself
    ("gcp", 25.0, 25.0),
    ("none", 300.0, 300.0),  # no cloud notice: nothing to cap against
])
def test_effective_grace_is_capped_at_the_notice_window(source, grace, expected):
    cfg = config.PreemptionConfig(grace_period_s=grace, notice_source=config.NoticeSource(source))
    assert preemption.effective_grace_s(cfg) == expected


def test_every_notice_source_has_a_window():
    sources = set(config.NoticeSource) - {config.NoticeSource.none}
    assert set(preemption.NOTICE_WINDOW_S) == sources
    assert preemption.NOTICE_WINDOW_S[config.NoticeSource.aws] == 120.0
