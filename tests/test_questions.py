"""Every question refuses its bad answers with a message naming it, leaving nothing behind."""

from __future__ import annotations

import pytest

from conftest import render

BAD = [
    ("project_name", "9lives"), ("project_name", "my/run"), ("project_name", ""),
    ("package_name", "My-Pkg"), ("package_name", "1abc"), ("package_name", "class"),
    ("package_name", "torch"),
    ("description", "   "),
    ("mtbi_hours", 0), ("mtbi_hours", -3),
    ("step_time_seconds", 0), ("checkpoint_save_seconds", -1), ("restart_seconds", -0.5),
    ("badput_target_percent", 0), ("badput_target_percent", 100),
    ("badput_target_percent", 150),
    ("checkpoint_dir", ""), ("checkpoint_dir", " ckpt"), ("checkpoint_dir", "ftp://host/x"),
    ("keep_last", 0), ("grace_period_seconds", 0),
    ("async_mode", "fast"), ("cloud", "ibm"), ("parallelism", "tp"),
    ("launchers", ["pbs"]), ("docs_language", "fr"),
]


@pytest.mark.parametrize("question, value", BAD, ids=[f"{q}={v!r}" for q, v in BAD])
def test_bad_answer_is_refused_naming_the_question(tmp_path, question, value):
    dst = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        render(dst, **{question: value})
    assert question in str(info.value)
    assert not dst.exists() or not any(dst.iterdir())


GOOD = [("restart_seconds", 0), ("badput_target_percent", 99.9), ("keep_last", 1),
        ("checkpoint_dir", "gs://bucket/path"), ("package_name", "_private")]


@pytest.mark.parametrize("question, value", GOOD, ids=[f"{q}={v!r}" for q, v in GOOD])
def test_edge_answers_are_accepted(tmp_path, question, value):
    render(tmp_path / "out", **{question: value})
    assert (tmp_path / "out" / "configs" / "train.yaml").is_file()
