"""The text of ``bench``'s figures: the ratios to the bounds, the table, the throughput."""

from __future__ import annotations


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(med: dict[str, float | None]) -> dict[str, float | None]:
    """The ratios the targets are stated in (docs/PERFORMANCE.md)."""
    return {
        "baseline/blocking": ratio(med["baseline"], med["async_blocking"]),
        "blocking/copy_bound": ratio(med["async_blocking"], med["copy_bound"]),
        "commit/disk_bound": ratio(med["async_commit"], med["disk_bound"]),
        "load/read_bound": ratio(med["load"], med["read_bound"]),
        "stall/copy_bound": ratio(med["stall"], med["copy_bound"]),
        "stall/dcp_sync": ratio(med["stall"], med["dcp_sync"]),
        "memory_save/copy_bound": ratio(med.get("memory_save"), med["copy_bound"]),
        "load/memory_load": ratio(med["load"], med.get("memory_load")),
        "load/memory_load_sampled": ratio(med["load"], med.get("memory_load_sampled")),
        "load/memory_load_checked": ratio(med["load"], med.get("memory_load_checked")),
    }


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def report_text(r: dict) -> str:
    med, first, loop = r["median_s"], r["first_save"], r["loop"]
    rows = [
        ("copy bound (host copy of the state)", "copy_bound"),
        ("async: on the training path", "async_blocking"),
        ("async: until committed", "async_commit"),
        ("disk bound (raw parallel write)", "disk_bound"),
        ("rank-0 gather + torch.save", "baseline"),
        ("dcp.save (parallel shards)", "dcp_sync"),
        ("load through the resume path", "load"),
        ("  a checksum pass alone (rank 0)", "verify"),
        ("read bound (each rank its shard)", "read_bound"),
        ("rank-0 torch.load + broadcast", "baseline_load"),
        ("stall in the training loop", "stall"),
        ("memory tier: on the training path", "memory_save"),
        ("memory tier: a restart's load", "memory_load"),
        ("  the same, sampled checks", "memory_load_sampled"),
        ("  the same, checked during the build", "memory_load_checked"),
        ("  that check (off the load's path)", "memory_check"),
    ]
    lines = [(f"\ncheckpoint figures, median of {r['repeats']} ({r['world_size']} {r['device']} "
              f"rank(s), {r['mode']} mode, {r['state_bytes_rank0'] / 2**20:.1f} MiB per rank):")]
    lines += [f"  {label:<38} {fmt(med.get(key)):>8} s" for label, key in rows]
    lines.append("ratios:")
    lines += [f"  {name:<24} {fmt(value, '7.2f')}x" for name, value in r["ratios"].items()]
    steps = loop["step_s"]
    lines += [
        (f"training loop: save every {loop['interval']} steps; median step "
         f"{fmt(steps['clean'])} s with no save in flight ({loop['counts']['clean']}), "
         f"{fmt(steps['save'])} s starting a save ({loop['counts']['save']}), "
         f"{fmt(steps['in_flight'])} s while one is written ({loop['counts']['in_flight']})"),
        (f"warm-up: checkpoint process and staging buffers ready in {r['warm_up_s']:.2f} s; "
         f"the first save then blocked {fmt(first.get('blocking_s'))} s and committed after "
         f"{fmt(first.get('commit_s'))} s (later saves: {fmt(med['async_blocking'])} s, "
         f"{fmt(med['async_commit'])} s)"),
        (f"staging memory per rank {r['staging_bytes_per_rank'] / 2**20:.1f} MiB (held "
         f"while a save is in flight); {r['staged_fast']} of {r['staged_fast'] + r['staged_full']}"
         f" stagings reused the buffers' layout"),
        ("memory tier: not rendered (copier answer memory_tier)"
         if r["memory_held_bytes_rank0"] is None else
         f"memory tier: {r['memory_held_bytes_rank0'] / 2**20:.1f} MiB of copies held for rank 0 "
         f"on its node ({r['memory_nodes']} node(s): "
         f"{'no partner copies' if r['memory_nodes'] == 1 else 'with its partner copies'})"),
        (f"plan cache hits {r['plan_cache_hits']} of {r['plan_cache_possible']} timed "
         f"dcp.save calls"),
    ]
    return "\n".join(lines)


def throughput_text(r: dict) -> str:
    rate, tokens = r["samples_per_s"], r["tokens_per_s"]
    unit = (f"{tokens['without']:,.0f} -> {tokens['with']:,.0f} tokens/s" if tokens
            else f"{rate['without']:.2f} -> {rate['with']:.2f} samples/s")
    return (f"{r['train_steps']} steps without and with a save every {r['interval']} steps "
            f"({r['world_size']} rank(s), {r['mode']} mode, median of {r['repeats']}): "
            f"{unit}; throughput with checkpointing {r['throughput_ratio']:.3f}x of without")
