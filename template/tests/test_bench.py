"""The save-time benchmark runs end to end and reports figures that make sense."""

import json

from conftest import torchrun


def test_bench_reports_every_method_and_plan_cache_hits():
    proc = torchrun(2, "bench", "--repeats", "2", "--json", "model.d_model=32",
                    "model.n_layers=1")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2
    for name in ("baseline", "dcp_sync", "disk_bound", "async_blocking", "async_commit"):
        assert report["median_s"][name] > 0
    assert report["median_s"]["async_commit"] >= report["median_s"]["async_blocking"]
    assert report["plan_cache_hits"] == 2          # every timed save after the warm-up
    assert report["staging_bytes_per_rank"] > 0
