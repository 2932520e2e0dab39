"""The tokenizers ``prepare_data`` encodes with: ``bytes`` (byte b is token b, 256 the
separator), a ``tokenizer.json`` (the ``tokenizers`` library; also a directory's, unless it
has a tokenizer_config.json and transformers is installed) or a saved or locally cached
``transformers`` tokenizer, each with the token that separates documents. Nothing is
downloaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BYTES = "bytes"
BYTES_SEPARATOR = 256
END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")


class PrepareError(Exception):
    """Bad input; the message says which and why (exit status 2, no traceback)."""


@dataclass
class Tokenizer:
    spec: str                   # "bytes" or the path it was loaded from
    vocab_size: int             # ids are < vocab_size (the separator included)
    separator: int
    backend: Any = field(default=None, repr=False)
    kind: str = BYTES           # bytes | tokenizers | transformers

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        if self.kind == BYTES:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        if self.kind == "tokenizers":
            return [np.asarray(e.ids, dtype=np.int64)
                    for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        ids = self.backend(texts, add_special_tokens=False)["input_ids"]
        return [np.asarray(i, dtype=np.int64) for i in ids]


def load_tokenizer(spec: str, separator: str | None = None) -> Tokenizer:
    """``bytes``, a tokenizer directory or a tokenizer.json file; PrepareError otherwise."""
    if spec == BYTES:
        if separator is not None:
            raise PrepareError("--separator does not apply to --tokenizer bytes (the separator "
                               f"is {BYTES_SEPARATOR})")
        return Tokenizer(BYTES, BYTES_SEPARATOR + 1, BYTES_SEPARATOR)
    path = Path(spec).expanduser()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
    try:
        if path.is_file():
            return _from_tokenizers(path, separator)
        if path.is_dir() and not ((path / "tokenizer_config.json").is_file()
                                  and _has_transformers()):
            return _from_tokenizers(path / "tokenizer.json", separator)
        return _from_transformers(spec, separator)  # a saved tokenizer, or a cached hub name
    except PrepareError:
        raise
    except ImportError:
        raise PrepareError(f"--tokenizer {spec}: loading a tokenizer needs the hf extra: "
                           "pip install -e '.[hf]'") from None
    except Exception as exc:  # noqa: BLE001 - each library fails in its own way
        raise PrepareError(f"--tokenizer {spec}: cannot load a tokenizer from it "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                           ) from None


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _from_tokenizers(path: Path, separator: str | None) -> Tokenizer:
    from tokenizers import Tokenizer as RustTokenizer

    if not path.is_file():
        raise PrepareError(f"--tokenizer: {path} not found (a tokenizer directory needs a "
                           "tokenizer.json, or transformers installed)")
    backend = RustTokenizer.from_file(str(path))
    names = [separator] if separator is not None else END_OF_TEXT
    found = next((i for i in map(backend.token_to_id, names) if i is not None), None)
    if found is None:
        raise PrepareError(_no_separator(path, separator))
    vocab = max(backend.get_vocab_size(with_added_tokens=True), found + 1)
    return Tokenizer(str(path.resolve()), vocab, found, backend, "tokenizers")


def _from_transformers(spec: str, separator: str | None) -> Tokenizer:
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    found = (backend.eos_token_id if separator is None
             else backend.convert_tokens_to_ids(separator))
    if found is None or (separator is not None and found == backend.unk_token_id):
        raise PrepareError(_no_separator(spec, separator))
    vocab = max(len(backend), found + 1)
    name = str(Path(spec).resolve()) if Path(spec).exists() else spec
    return Tokenizer(name, vocab, int(found), backend, "transformers")


def _no_separator(where: object, separator: str | None) -> str:
    if separator is not None:
        return f"--separator {separator!r} is not a token of the tokenizer {where}"
    return (f"the tokenizer {where} has no end-of-text token ({', '.join(END_OF_TEXT)}); "
            "name the token that separates documents with --separator")
