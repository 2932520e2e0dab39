"""Token data: prepare_data writes token files and an index, TokenWindows reads them lazily.

Every document's tokens must come back exactly, followed by the separator, with the
bytes tokenizer and with a tokenizer trained here with ``tokenizers``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (
    ROOT,
    finish,
    forked_children,
    project_module,
    read_events,
    run_module,
    start,
    wait_until,
)

# Every test here touches an API that differs between torch releases (make test-torch).
pytestmark = pytest.mark.torch_api

CONFIG = str(ROOT / "configs" / "train.yaml")

TEXT_DOCUMENTS = [
    "The first document.\nIt has two lines.\n",
    "Second, after one blank line: caf\u00e9, \u00fcber, \u65e5\u672c\n",
    "Third, after three blank lines.\n",
    "Last, without a final newline",
]
JSONL_DOCUMENTS = ["a JSON document", "one with\n\nblank lines inside\n", "",
                   "\u00e9t\u00e9 " * 50]


def write_inputs(tmp_path: Path) -> tuple[list[Path], list[str]]:
    """A text file and a JSONL file; returns them and the documents expected, in order."""
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n" + TEXT_DOCUMENTS[0] + "\n" + TEXT_DOCUMENTS[1] + "\n"
                    + TEXT_DOCUMENTS[2] + "\n\n\n" + TEXT_DOCUMENTS[3], encoding="utf-8")
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n"
                             for i, d in enumerate(JSONL_DOCUMENTS)) + "\n", encoding="utf-8")
    expected = TEXT_DOCUMENTS[:3] + [TEXT_DOCUMENTS[3]] + [d for d in JSONL_DOCUMENTS if d]
    return [text, jsonl], expected


def prepare(*args: str) -> int:
    return project_module("tools.prepare_data").main([*args])


def read_stream(out: Path) -> tuple[dict, np.ndarray]:
    index = json.loads((out / "index.json").read_text())
    stream = np.concatenate([np.fromfile(out / f["name"], dtype=index["dtype"])
                             for f in index["files"]])
    return index, stream


def split_documents(stream: np.ndarray, separator: int) -> list[list[int]]:
    ends = np.flatnonzero(stream == separator)
    assert len(ends) and ends[-1] == len(stream) - 1, "every document ends with the separator"
    return [part.tolist() for part in np.split(stream, ends + 1)[:-1]]


def check_round_trip(out: Path, expected_ids: list[list[int]]) -> dict:
    index, stream = read_stream(out)
    documents = split_documents(stream, index["separator"])
    assert len(documents) == len(expected_ids) == index["documents"]
    for got, ids in zip(documents, expected_ids):
        assert got[-1] == index["separator"]
        got = got[:-1]
        assert (len(got), got[0], got[-1]) == (len(ids), ids[0], ids[-1])
        assert got == ids
    assert index["tokens"] == len(stream) == sum(f["tokens"] for f in index["files"])
    return index


def test_bytes_round_trip_with_workers_and_several_files(tmp_path, capsys, monkeypatch):
    # Small chunks and pieces: many chunks in flight across the workers, and documents
    # longer than a piece tokenized in several pieces.
    monkeypatch.setattr(project_module("tools.prepare_data"), "CHUNK_CHARS", 40)
    monkeypatch.setattr(project_module("tools.prepare_data"), "PIECE_CHARS", 30)
    inputs, documents = write_inputs(tmp_path)
    args = ["--input", *map(str, inputs), "--tokenizer", "bytes", "--text-key", "body",
            "--shard-tokens", "100"]
    assert prepare(*args, "--out", str(tmp_path / "two"), "--workers", "2") == 0
    out, err = capsys.readouterr()
    assert "100%" in err and "data.kind=tokens data.path=" in out  # progress, next step
    index = check_round_trip(tmp_path / "two", [list(d.encode()) for d in documents])
    assert (index["dtype"], index["vocab_size"], index["separator"]) == ("uint16", 257, 256)
    assert len(index["files"]) > 1 and all(f["tokens"] <= 100 for f in index["files"])
    # The same bytes whatever the number of workers.
    assert prepare(*args, "--out", str(tmp_path / "one")) == 0
    assert read_stream(tmp_path / "one")[1].tobytes() == read_stream(tmp_path / "two")[1].tobytes()


@pytest.fixture(scope="module")
def trained_tokenizer(tmp_path_factory) -> Path:
    """A small BPE tokenizer trained here, with </s> as its end-of-text token."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    corpus = project_module("datasets").generate_corpus(20_000, seed=3)
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([corpus, *TEXT_DOCUMENTS, *JSONL_DOCUMENTS], trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_trained_tokenizer_round_trip(tmp_path, trained_tokenizer):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(trained_tokenizer))
    inputs, documents = write_inputs(tmp_path)
    args = ["--input", *map(str, inputs), "--text-key", "body", "--workers", "2"]
    assert prepare(*args, "--tokenizer", str(trained_tokenizer), "--out", str(tmp_path / "a")) == 0
    expected = [tokenizer.encode(d, add_special_tokens=False).ids for d in documents]
    index = check_round_trip(tmp_path / "a", expected)
    assert index["separator"] == tokenizer.token_to_id("</s>")
    assert index["vocab_size"] == tokenizer.get_vocab_size() and index["dtype"] == "uint16"

    # The same tokenizer saved as a transformers tokenizer directory gives the same tokens.
    transformers = pytest.importorskip("transformers")
    saved = tmp_path / "hf-tokenizer"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(saved)
    assert prepare(*args, "--tokenizer", str(saved), "--out", str(tmp_path / "b")) == 0
    assert read_stream(tmp_path / "b")[1].tobytes() == read_stream(tmp_path / "a")[1].tobytes()


def test_vocabulary_that_does_not_fit_the_dtype_is_refused(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(70_000)} | {"</s>": 70_000}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "big.json"))
    (tmp_path / "doc.txt").write_text("w1 w69999 w65536\n\nw7\n")
    args = ["--input", str(tmp_path / "doc.txt"), "--tokenizer", str(tmp_path / "big.json")]
    assert prepare(*args, "--out", str(tmp_path / "u16"), "--dtype", "uint16") == 2
    assert "70,001 tokens does not fit uint16" in capsys.readouterr().err
    assert not (tmp_path / "u16").exists()
    assert prepare(*args, "--out", str(tmp_path / "auto")) == 0
    index = check_round_trip(tmp_path / "auto", [[1, 69999, 65536], [7]])
    assert index["dtype"] == "uint32"


def test_unreadable_input_is_a_clear_error(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"fine\n\nnot \xff utf-8\n")
    proc = run_module("prepare_data", "--input", str(tmp_path / "bad.txt"), "--tokenizer",
                      "bytes", "--out", str(tmp_path / "out"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "bad.txt:3: not UTF-8 text" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written is left
    for missing in (tmp_path / "nope.txt", tmp_path):
        code = prepare("--input", str(missing), "--tokenizer", "bytes", "--out",
                       str(tmp_path / "out"))
        assert code == 2 and not (tmp_path / "out").exists()


def test_windows_read_across_files_and_survive_pickling(tmp_path):
    text = "".join(f"document {i} " * (i + 1) + "\n\n" for i in range(30))
    (tmp_path / "c.txt").write_text(text)
    assert prepare("--input", str(tmp_path / "c.txt"), "--tokenizer", "bytes", "--out",
                   str(tmp_path / "tok"), "--shard-tokens", "37") == 0
    _, stream = read_stream(tmp_path / "tok")
    windows = project_module("datasets").TokenWindows(tmp_path / "tok", seq_len=16)
    assert len(windows) == (len(stream) - 1) // 16 and len(windows.names) > 10
    for i in range(len(windows)):
        inputs, targets = windows[i]
        assert inputs.dtype == torch.int64
        assert inputs.tolist() == stream[i * 16:i * 16 + 16].tolist()
        assert targets.tolist() == stream[i * 16 + 1:i * 16 + 17].tolist()
    with pytest.raises(IndexError):
        windows[len(windows)]
    # What a spawned DataLoader worker gets: no tokens, it maps the files itself.
    assert windows._files is not None
    copy = pickle.loads(pickle.dumps(windows))
    assert copy._files is None and torch.equal(copy[5][0], windows[5][0])


def test_tiny_model_takes_the_datas_vocabulary(tmp_path):
    (tmp_path / "c.txt").write_text(project_module("datasets").generate_corpus(5000))
    assert prepare("--input", str(tmp_path / "c.txt"), "--tokenizer", "bytes", "--out",
                   str(tmp_path / "tok")) == 0
    cfg = project_module("config").load_config(CONFIG, [
        "data.kind=tokens", f"data.path={tmp_path / 'tok'}", "data.eval_fraction=0.1",
        f"checkpoint.dir={tmp_path / 'c'}"])
    task = project_module("loop.task_contract").load_task()   # the suite's task (conftest.py)
    assert task.build_model(cfg).embed.num_embeddings == 257
    windows = (5000 + 1 - 1) // 64          # 5000 bytes + one separator
    held = int(windows * 0.1)               # the default task holds these out
    assert held > 0 and len(task.build_eval_data(cfg)) == held
    assert len(task.build_data(cfg)) == windows - held
    bad = project_module("config").load_config(CONFIG, ["data.kind=tokens",
                                                        f"data.path={tmp_path}"])
    with pytest.raises(project_module("config").ConfigError, match="no index.json"):
        task.build_data(bad)


def test_a_read_that_fails_before_its_dead_worker_is_reaped_names_the_worker(monkeypatch):
    # The race the test below can meet: the worker is killed while handing over a batch,
    # and the read fails (the descriptor it passed is gone) before the worker is reaped.
    loader = project_module("loop.loader")
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.3,))
    worker.start()

    class FailingRead:
        def __init__(self, workers):
            self._workers = workers

        def __next__(self):
            raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid\(s\) {worker.pid}\) "
                                           "exited unexpectedly"):
        next(loader.naming_dead_workers(FailingRead([worker])))
    # A failed read while every worker lives is passed on as it is, after a bounded wait.
    monkeypatch.setattr(loader, "WORKER_EXIT_WAIT_S", 0.2)
    alive = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    alive.start()
    try:
        with pytest.raises(ConnectionResetError):
            next(loader.naming_dead_workers(FailingRead([alive])))
    finally:
        alive.kill()
        alive.join()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_dataloader_worker_that_dies_is_an_error_not_a_hang(tmp_path):
    logs, log_file = tmp_path / "logs", tmp_path / "job.log"
    proc = start("train", "loader.num_workers=2", "train.max_steps=100000",
                 "checkpoint.async_mode=sync", f"checkpoint.dir={tmp_path / 'ckpt'}",
                 f"log.dir={logs}", log_file=log_file)
    wait_until(lambda: read_events(logs, "step"), proc, "the first step", log_file=log_file)
    workers = forked_children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    assert finish(proc, 120) not in (0, 75)
    assert "DataLoader worker" in log_file.read_text(errors="replace")
