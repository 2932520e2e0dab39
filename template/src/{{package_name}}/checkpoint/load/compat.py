"""Does a checkpoint fit this run? Its model's names and shapes against this model's.

Checked before loading, from DCP's metadata (read safely): a checkpoint of another model is
refused with a short list of what differs, not a crash inside the load at every restart.
"""

from __future__ import annotations

from typing import Any

from ..store.integrity import Expected
from ..store.storage import Storage
from .reader import open_reader

MODEL_PREFIX = "app.model."  # where checkpoint.state puts the model's tensors
SHOWN = 4                    # differences listed per kind


def saved_model_shapes(storage: Storage, name: str, checksums: Expected | None = None
                       ) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every model tensor a checkpoint holds (``.metadata`` checked
    against ``checksums`` first when they are given: ChecksumMismatch)."""
    metadata = open_reader(storage, name, checksums).read_metadata()
    return {key[len(MODEL_PREFIX):]: tuple(item.size)
            for key, item in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and hasattr(item, "size")}


def differences(saved: dict[str, tuple[int, ...]], current: dict[str, tuple[int, ...]],
                saved_config: dict[str, Any] | None = None,
                current_config: dict[str, Any] | None = None) -> list[str]:
    """What differs, in a few short lines; empty when the checkpoint fits."""
    lines = []
    reshaped = [f"{k} {list(saved[k])} saved, {list(current[k])} now"
                for k in sorted(set(saved) & set(current)) if saved[k] != current[k]]
    for label, items in (("not in the checkpoint", sorted(set(current) - set(saved))),
                         ("only in the checkpoint", sorted(set(saved) - set(current))),
                         ("other shape", reshaped)):
        if items:
            more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
            lines.append(f"{label}: {', '.join(items[:SHOWN])}{more}")
    if lines and saved_config is not None and current_config is not None:
        changed = [f"model.{k}: {saved_config.get(k)!r} saved, {current_config.get(k)!r} now"
                   for k in sorted(set(saved_config) | set(current_config))
                   if saved_config.get(k) != current_config.get(k)]
        if changed:
            lines.append("configuration: " + "; ".join(changed[:SHOWN]))
    return lines
