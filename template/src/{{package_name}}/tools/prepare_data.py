"""Tokenize text or JSONL files into the token directory that ``data.kind: tokens`` reads.

    python -m <package>.prepare_data --input FILE [FILE ...] --tokenizer PATH|bytes --out DIR
        [--workers N] [--text-key KEY] [--separator TOKEN] [--dtype auto|uint16|uint32]
        [--shard-tokens N]

Documents, separators, ``--tokenizer bytes`` and the exit status (0 done; 2 bad input,
nothing left in DIR): docs/EXTENDING.md, "Train a Hugging Face model on your corpus".
Empty documents are skipped; order is kept whatever ``--workers``. Tokenizers: tokenizer.py.
Output: DIR/tokens_00000.bin, ... (every ``--shard-tokens`` tokens), then DIR/index.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import PACKAGE
from ..datasets.tokens import DTYPES, FORMAT, INDEX_FILE, VERSION, dtype_fits, dtype_for
from ..launch.torchrun import positive_int
from ..runtime.exit_codes import Refused, refusals
from .tokenizer import BYTES, PrepareError, Tokenizer, load_tokenizer

CHUNK_CHARS = 1 << 20          # text handed to a worker at a time
PIECE_CHARS = 1 << 22          # a longer document is tokenized in pieces of about this size


_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str, separator: str | None) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(spec, separator)


def _encode_in_worker(chunk: list[tuple[str, bool]]) -> list[np.ndarray]:
    assert _worker_tokenizer is not None
    return _encode(_worker_tokenizer, chunk)


def _encode(tokenizer: Tokenizer, chunk: list[tuple[str, bool]]) -> list[np.ndarray]:
    """Token arrays of a chunk's pieces, the separator after each piece that ends a document."""
    encoded = tokenizer.encode([text for text, _ in chunk])
    return [np.append(ids, tokenizer.separator) if ends else ids
            for ids, (_, ends) in zip(encoded, chunk)]


def _lines(path: Path) -> Iterator[tuple[int, str, int]]:
    """(line number, text, bytes) of each line; PrepareError for bytes that are not UTF-8."""
    try:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                try:
                    yield number, raw.decode("utf-8"), len(raw)
                except UnicodeDecodeError as exc:
                    raise PrepareError(f"{path}:{number}: not UTF-8 text ({exc.reason} at byte "
                                       f"{exc.start} of the line)") from None
    except OSError as exc:
        raise PrepareError(f"cannot read {path}: {exc.strerror or exc}") from None


def pieces(path: Path, text_key: str) -> Iterator[tuple[str, bool, int]]:
    """(text, ends a document, input bytes consumed) of one file, in order."""
    if path.suffix == ".jsonl":
        for number, line, size in _lines(path):
            text = ""
            if line.strip():
                try:
                    text = json.loads(line)[text_key]
                except ValueError as exc:
                    raise PrepareError(f"{path}:{number}: not a JSON line ({exc})") from None
                except (KeyError, TypeError):
                    raise PrepareError(f"{path}:{number}: no {text_key!r} key (choose the key "
                                       "with --text-key)") from None
                if not isinstance(text, str):
                    raise PrepareError(f"{path}:{number}: {text_key!r} is not a string")
            if not text:   # a blank line or an empty document: its bytes only
                yield "", False, size
            for start in range(0, len(text), PIECE_CHARS):
                last = start + PIECE_CHARS >= len(text)
                yield text[start:start + PIECE_CHARS], last, size if last else 0
        return
    lines: list[str] = []
    held = pending = 0
    in_document = False
    for _, line, size in _lines(path):
        pending += size
        if line.strip():
            in_document = True
            lines.append(line)
            held += len(line)
            if held >= PIECE_CHARS:  # a long document: hand it over in pieces
                yield "".join(lines), False, pending
                lines, held, pending = [], 0, 0
        elif in_document:
            yield "".join(lines), True, pending
            lines, held, pending, in_document = [], 0, 0, False
    if in_document:
        yield "".join(lines), True, pending
    elif pending:
        yield "", False, pending


def chunks(paths: list[Path], text_key: str) -> Iterator[tuple[list[tuple[str, bool]], int]]:
    """Pieces grouped into chunks of about CHUNK_CHARS characters, with their input bytes."""
    chunk: list[tuple[str, bool]] = []
    chars = consumed = 0
    for path in paths:
        for text, ends, size in pieces(path, text_key):
            consumed += size
            if text or ends:
                chunk.append((text, ends))
                chars += len(text)
            if chars >= CHUNK_CHARS:
                yield chunk, consumed
                chunk, chars, consumed = [], 0, 0
    if chunk or consumed:
        yield chunk, consumed


class ShardWriter:
    """Appends tokens to DIR/tokens_NNNNN.bin, starting a new file every ``shard_tokens``."""

    def __init__(self, out: Path, dtype: str, shard_tokens: int) -> None:
        self.out, self.dtype, self.shard_tokens = out, np.dtype(DTYPES[dtype]), shard_tokens
        self.files: list[dict[str, Any]] = []
        self._handle = None

    def write(self, ids: np.ndarray, ends_document: bool) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while True:
            if self._handle is None or self.files[-1]["tokens"] >= self.shard_tokens:
                self._next_file()
            room = self.shard_tokens - self.files[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            part.tofile(self._handle)
            self.files[-1]["tokens"] += len(part)
            if not len(ids):
                break
        if ends_document:
            self.files[-1]["documents"] += 1

    def _next_file(self) -> None:
        self.close()
        name = f"tokens_{len(self.files):05d}.bin"
        self._handle = open(self.out / name, "wb")  # noqa: SIM115 - closed by close()
        self.files.append({"name": name, "tokens": 0, "documents": 0})

    def close(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None


class Progress:
    """A progress line on stderr: redrawn in place on a terminal, every 10 % otherwise."""

    def __init__(self, total_bytes: int) -> None:
        self.total = max(1, total_bytes)
        self.done = self.tokens = 0
        self.began = time.monotonic()
        self.shown = -1.0
        self.tty = sys.stderr.isatty()

    def update(self, consumed: int, tokens: int, final: bool = False) -> None:
        self.done += consumed
        self.tokens += tokens
        now = time.monotonic()
        fraction = min(1.0, self.done / self.total)
        due = (now - self.shown >= 0.2) if self.tty else (fraction >= self.shown + 0.1)
        if not (due or final) or (final and not self.tty and self.shown >= 1.0):
            return
        self.shown = now if self.tty else fraction
        line = (f"[{'#' * int(fraction * 30):<30}] {fraction * 100:3.0f}% "
                f"{self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
                f"{self.done / 1e6 / max(now - self.began, 1e-9):,.1f} MB/s {self.tokens:,} tokens")
        print(("\r" if self.tty else "") + line, end="\n" if final or not self.tty else "",
              file=sys.stderr, flush=True)


def prepare(paths: list[Path], tokenizer: Tokenizer, out: Path, *, dtype: str,
            workers: int, text_key: str, shard_tokens: int) -> dict[str, Any]:
    """Tokenize ``paths`` into ``out`` (which must exist and be empty); returns the index."""
    writer = ShardWriter(out, dtype, shard_tokens)
    progress = Progress(sum(p.stat().st_size for p in paths))

    def write(encoded: list[np.ndarray], chunk: list[tuple[str, bool]], consumed: int) -> None:
        for ids, (_, ends) in zip(encoded, chunk):
            writer.write(ids, ends)
        progress.update(consumed, sum(len(ids) for ids in encoded))

    try:
        if workers <= 1:
            for chunk, consumed in chunks(paths, text_key):
                write(_encode(tokenizer, chunk), chunk, consumed)
        else:
            import multiprocessing

            # At most two chunks per worker in flight: memory stays bounded on any corpus.
            with multiprocessing.Pool(workers, _init_worker,
                                      (tokenizer.spec, _separator_name(tokenizer))) as pool:
                pending: deque = deque()
                for chunk, consumed in chunks(paths, text_key):
                    pending.append((pool.apply_async(_encode_in_worker, (chunk,)), chunk, consumed))
                    if len(pending) >= 2 * workers:
                        result, done, size = pending.popleft()
                        write(result.get(), done, size)
                while pending:
                    result, done, size = pending.popleft()
                    write(result.get(), done, size)
    finally:
        writer.close()
    progress.update(0, 0, final=True)
    index = {"format": FORMAT, "version": VERSION, "dtype": dtype,
             "vocab_size": tokenizer.vocab_size, "separator": tokenizer.separator,
             "tokenizer": tokenizer.spec, "tokens": sum(f["tokens"] for f in writer.files),
             "documents": sum(f["documents"] for f in writer.files),
             "inputs": [str(p.resolve()) for p in paths], "files": writer.files}
    tmp = out / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out / INDEX_FILE)  # the index last: a directory without it is unfinished
    return index


def _separator_name(tokenizer: Tokenizer) -> str | None:
    """How a worker finds the same separator: by its token string (None for the default)."""
    if tokenizer.kind == "tokenizers":
        return tokenizer.backend.id_to_token(tokenizer.separator)
    if tokenizer.kind == "transformers":
        return tokenizer.backend.convert_ids_to_tokens(tokenizer.separator)
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.prepare_data",
        description="Tokenize text or JSONL files into token files and an index for "
                    "data.kind=tokens.",
        epilog="Then train with data.kind=tokens data.path=DIR. Exit status: 0 done, 2 bad input.")
    parser.add_argument("--input", nargs="+", required=True, type=Path, metavar="FILE",
                        help="text files (documents separated by blank lines) or .jsonl files")
    parser.add_argument("--tokenizer", required=True, metavar="PATH|bytes",
                        help="a tokenizer directory or tokenizer.json, or 'bytes'")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="a new or empty directory for the token files and index.json")
    parser.add_argument("--workers", type=positive_int, default=1, metavar="N",
                        help="tokenizing processes (default 1)")
    parser.add_argument("--text-key", default="text", metavar="KEY",
                        help="the text's key in each JSONL record (default 'text')")
    parser.add_argument("--separator", default=None, metavar="TOKEN",
                        help="the token that ends each document (default: the tokenizer's "
                             "end-of-text token)")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="token file dtype (default: uint16 when the vocabulary fits)")
    parser.add_argument("--shard-tokens", type=positive_int, default=1 << 30, metavar="N",
                        help="tokens per file (default 2^30)")
    return parser.parse_args(argv)


@refusals
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    created = False
    try:
        for path in args.input:
            if not path.is_file() or not os.access(path, os.R_OK):
                raise PrepareError(f"cannot read {path}: "
                                   f"{'not a readable file' if path.exists() else 'no such file'}")
        if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
            raise PrepareError(f"--out {args.out} exists and is not an empty directory")
        tokenizer = load_tokenizer(args.tokenizer, args.separator)
        dtype = dtype_for(tokenizer.vocab_size) if args.dtype == "auto" else args.dtype
        if not dtype_fits(dtype, tokenizer.vocab_size):
            raise PrepareError(f"the vocabulary of {tokenizer.vocab_size:,} tokens does not fit "
                               f"{dtype} (ids up to {np.iinfo(DTYPES[dtype]).max:,}); use "
                               "--dtype uint32 or --dtype auto")
        if tokenizer.kind != BYTES and args.workers > 1:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker
        created = not args.out.exists()
        args.out.mkdir(parents=True, exist_ok=True)
        index = prepare(args.input, tokenizer, args.out, dtype=dtype, workers=args.workers,
                        text_key=args.text_key, shard_tokens=args.shard_tokens)
    except PrepareError as exc:
        if created:
            shutil.rmtree(args.out, ignore_errors=True)
        elif args.out.is_dir() and not (args.out / INDEX_FILE).exists():
            for leftover in args.out.glob("tokens_*.bin"):
                leftover.unlink()
        raise Refused(exc) from exc
    print(f"wrote {index['tokens']:,} tokens ({index['documents']:,} documents) in "
          f"{len(index['files'])} file(s) to {args.out} ({index['dtype']}, vocabulary "
          f"{index['vocab_size']:,}, separator {index['separator']})")
    print(f"train on it with: data.kind=tokens data.path={args.out}")
    return 0
