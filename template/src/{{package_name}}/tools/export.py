"""Export a checkpoint's model weights: a Hugging Face model directory or one torch.save file.

    python -m <package>.export [CHECKPOINT] [--best] --format hf|torch --out DIR
        [--dtype fp32|bf16|fp16] [--max-shard-size 5GB] [--config PATH] [key=value ...]

On CPU in one process (DCP reassembles each tensor from the shards), reading only the
model's weights, one output file at a time. ``--format hf`` (``model.kind: hf`` runs) uses
the model section the checkpoint was trained with (commit.json; ``model.*`` overrides
change it). What each format writes: docs/EXTENDING.md, "Train a Hugging Face model on
your corpus". Exit status: 0 written, 1 failed, 73 the storage could not be reached, 2 bad
input (refused credentials, no checkpoint, bad arguments, a model that does not match).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .. import PACKAGE
from ..checkpoint import Committed, list_committed, newest_complete_checkpoint, open_storage
from ..checkpoint.load.reader import open_reader
from ..checkpoint.load.safe_load import SafeLoadPlanner, UnsafeCheckpointError, unsafe_failure
from ..checkpoint.store.layout import BestRule
from ..checkpoint.store.outage import ends_storage_errors
from ..checkpoint.store.storage import Storage
from ..config import ConfigError, load_config, task_section
from ..models.hf import HFConfig, hf_config, transformers_module
from ..runtime import exit_codes
from ..runtime.exit_codes import Refused, refusals

MODEL_PREFIX = "app.model."  # where checkpoint/state.py keeps the model's weights
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "chat_template.jinja")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


class ExportError(Exception):
    """Bad input; the message says what (exit status 2)."""


def find_checkpoint(argument: str | None, checkpoint_dir: str,
                    best: BestRule | None = None) -> tuple[Storage, Committed]:
    """The checkpoint named (it must be complete), the best by ``best`` (--best), or the newest."""
    if argument is None:
        storage = open_storage(checkpoint_dir)
        found = (newest_complete_checkpoint(storage) if best is None
                 else next(iter(best.best(list_committed(storage))), None))
        if found is None and best is None:
            raise ExportError(f"no complete checkpoint in {checkpoint_dir} (checkpoint.dir); "
                              "name one, or set checkpoint.dir=...")
        if found is None:
            raise ExportError(f"no checkpoint in {checkpoint_dir} was evaluated at its own "
                              f"step with {best.metric} (set eval.every_steps to a multiple "
                              "of checkpoint.interval_steps)")
        return storage, found
    if best is not None:
        raise ExportError("give either CHECKPOINT or --best, not both")
    root, _, name = argument.rstrip("/").rpartition("/")
    storage = open_storage(root or ".")
    for committed in list_committed(storage):
        if committed.name == name:
            return storage, committed
    raise ExportError(f"{argument} is not a complete checkpoint (a step_* directory with a "
                      "valid commit.json and every file it lists)")


def model_tensors(storage: Storage, checkpoint: Committed) -> dict[str, TensorStorageMetadata]:
    """Name -> stored shape and dtype of every model weight in the checkpoint."""
    metadata = open_reader(storage, checkpoint.name).read_metadata()
    return {key[len(MODEL_PREFIX):]: value
            for key, value in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(value, TensorStorageMetadata)}


def load_weights(storage: Storage, checkpoint: Committed,
                 wanted: dict[str, TensorStorageMetadata],
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``wanted``'s full tensors as ``dtype``, from every rank's shard (no process group), read
    as training reads them: nothing in the checkpoint run as code (checkpoint/load/safe_load.py)."""
    state = {MODEL_PREFIX + name: torch.empty(meta.size, dtype=meta.properties.dtype)
             for name, meta in wanted.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, storage_reader=open_reader(storage, checkpoint.name),
                     planner=SafeLoadPlanner(), no_dist=True)
        except BaseException as exc:  # DCP wraps errors in CheckpointException (a BaseException)
            if (unsafe := unsafe_failure(exc)) is not None:
                raise unsafe from None
            raise
    return {key[len(MODEL_PREFIX):]: tensor.to(dtype) for key, tensor in state.items()}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '100KB', '4GiB' or a number of bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size such as 5GB, 500MB or 1000000 (got {text!r})")
    number, unit = float(match.group(1)), match.group(2).upper().rstrip("B").rstrip("I")
    size = int(number * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte (got {text!r})")
    return size


def shard_plan(tensors: dict[str, TensorStorageMetadata], dtype: torch.dtype,
               max_bytes: int) -> dict[str, int]:
    """Name -> output file index (1..N), filled in order up to ``max_bytes`` a file."""
    plan, index, used = {}, 1, 0
    itemsize = torch.empty(0, dtype=dtype).element_size()
    for name, meta in tensors.items():
        size = meta.size.numel() * itemsize
        if used and used + size > max_bytes:
            index, used = index + 1, 0
        plan[name] = index
        used += size
    return plan


def write_safetensors(storage: Storage, checkpoint: Committed,
                      tensors: dict[str, TensorStorageMetadata], out: Path,
                      dtype: torch.dtype, max_bytes: int) -> list[str]:
    """Write the weights with DCP's Hugging Face writer, one output file at a time."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    plan = shard_plan(tensors, dtype, max_bytes)
    files = max(plan.values())
    index_file = out / "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(1, files + 1):
        wanted = {name: meta for name, meta in tensors.items() if plan[name] == index}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(load_weights(storage, checkpoint, wanted, dtype),
                     storage_writer=HuggingFaceStorageWriter(
                         str(out), fqn_to_index_mapping=plan if files > 1 else None),
                     no_dist=True)
        written = json.loads(index_file.read_text())
        weight_map.update(written["weight_map"])
        total += written["metadata"]["total_size"]
    if files == 1:  # the usual single-file layout: model.safetensors, no index
        (out / next(iter(weight_map.values()))).rename(out / "model.safetensors")
        index_file.unlink()
        return ["model.safetensors"]
    index_file.write_text(json.dumps({"metadata": {"total_size": total},
                                      "weight_map": weight_map}, indent=2) + "\n")
    return [*sorted(set(weight_map.values())), index_file.name]


def check_matches(config: Any, tensors: dict[str, TensorStorageMetadata]) -> str:
    """The configured model's class, once its weights match the checkpoint's names and shapes
    (built on the meta device: no memory, no time)."""
    transformers = transformers_module()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    saved = {name: tuple(meta.size) for name, meta in tensors.items()}
    tied = ((getattr(model, "_tied_weights_keys", None) or ())
            if getattr(model.config, "tie_word_embeddings", False) else ())
    problems = [f"{name} missing from the checkpoint" for name in expected
                if name not in saved and name not in tied]
    problems += [f"{name} not in {type(model).__name__}" for name in saved if name not in expected]
    problems += [f"{name}: checkpoint {saved[name]}, model {shape}"
                 for name, shape in expected.items() if name in saved and saved[name] != shape]
    if problems:
        raise ExportError("the model configuration does not match the checkpoint's weights: "
                          + "; ".join(problems[:5])
                          + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
    return type(model).__name__


def copy_tokenizer(run_config: dict[str, Any], out: Path) -> str | None:
    """Copy the token data's local tokenizer (directory or tokenizer.json); returns its path."""
    data = run_config.get("data") or {}
    if data.get("kind") != "tokens" or not data.get("path"):
        return None
    try:
        spec = json.loads((Path(data["path"]) / "index.json").read_text())["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    source = Path(spec)
    if source.is_file():
        shutil.copyfile(source, out / "tokenizer.json")
        return str(source)
    if source.is_dir():
        copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
        for name in copied:
            shutil.copyfile(source / name, out / name)
        return str(source) if copied else None
    return None


def run_model_section(record: dict[str, Any], fallback: dict[str, Any],
                      overrides: list[str]) -> dict[str, Any]:
    """The checkpoint's own model section (commit.json), model.* overrides applied."""
    section = (record.get("config") or {}).get("model") or fallback
    mine = [item for item in overrides if item.startswith("model.")]
    try:
        merged = OmegaConf.merge({"model": section}, OmegaConf.from_dotlist(mine))
    except OmegaConfBaseException as exc:
        raise ConfigError(str(exc).split("\n")[0]) from None
    return OmegaConf.to_container(merged, resolve=True)["model"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.export",
        description="Export a checkpoint's model weights as a Hugging Face model directory "
                    "(--format hf) or one torch.save file (--format torch). CPU only.",
        epilog="Exit status: 0 written, 1 failed, 2 bad input, 73 storage unreachable.")
    parser.add_argument("checkpoint", nargs="?", default=None, metavar="CHECKPOINT",
                        help="a checkpoint directory (default: the newest complete one in "
                             "checkpoint.dir)")
    parser.add_argument("--best", action="store_true",
                        help="the best checkpoint by checkpoint.best_metric and best_mode "
                             "(instead of the newest)")
    parser.add_argument("--format", required=True, choices=("hf", "torch"))
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="a new or empty directory")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                        help="weights' dtype in the export (default fp32, as trained)")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                        metavar="SIZE", help="hf: largest safetensors file (default 5GB)")
    parser.add_argument("--config", default=None, help="YAML config (default configs/train.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    # A key=value given where CHECKPOINT goes is an override.
    if args.checkpoint is not None and "=" in args.checkpoint:
        args.overrides.insert(0, args.checkpoint)
        args.checkpoint = None
    return args


def export(args: argparse.Namespace) -> str:
    cfg = load_config(args.config, args.overrides)
    rule = (BestRule(1, cfg.checkpoint.best_metric, cfg.checkpoint.best_mode)
            if args.best else None)
    storage, checkpoint = find_checkpoint(args.checkpoint, cfg.checkpoint.dir, rule)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise ExportError(f"--out {args.out} exists and is not an empty directory")
    tensors = model_tensors(storage, checkpoint)
    if not tensors:
        raise ExportError(f"{checkpoint.path} holds no model weights under {MODEL_PREFIX!r}")
    dtype = DTYPES[args.dtype]
    if args.format == "torch":
        weights = load_weights(storage, checkpoint, tensors, dtype)
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(weights, args.out / "model.pt")
        return (f"wrote {args.out / 'model.pt'}: {len(weights)} tensors from {checkpoint.path} "
                f"(step {checkpoint.step}); load with torch.load(path, weights_only=True)")

    section = run_model_section(checkpoint.record, cfg.model, args.overrides)
    if (kind := section.get("kind", "tiny")) != "hf":
        raise ExportError(f"--format hf exports runs of model.kind=hf; {checkpoint.path} was "
                          f"trained with model.kind={kind} (use --format torch)")
    own = {f.name for f in dataclasses.fields(HFConfig)}
    config = hf_config(task_section(section, HFConfig, "model",
                                    ignore=tuple(key for key in section if key not in own)))
    architecture = check_matches(config, tensors)
    args.out.mkdir(parents=True, exist_ok=True)
    files = write_safetensors(storage, checkpoint, tensors, args.out, dtype, args.max_shard_size)
    config.architectures = [architecture]
    config.dtype = dtype
    config.save_pretrained(args.out)
    tokenizer = copy_tokenizer(checkpoint.record.get("config") or {}, args.out)
    return (f"wrote {args.out}: config.json, {', '.join(files)}"
            f"{f', tokenizer from {tokenizer}' if tokenizer else ''} from {checkpoint.path} "
            f"(step {checkpoint.step}, saved on {checkpoint.world_size} rank(s)); load with "
            f"transformers.AutoModelForCausalLM.from_pretrained({str(args.out)!r})")


@refusals
@ends_storage_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(export(args))
    except (ConfigError, ExportError, UnsafeCheckpointError) as exc:
        raise Refused(exc) from exc
    return exit_codes.OK
