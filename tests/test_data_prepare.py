"""The prepare command: its shard writer round-trips, and missing pieces fail with one line."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from harness.data import DataConfig, load_data, read_shard
from harness.data.prepare import byte_tokenizer, main, write_shards


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))


DOCS = [f"document number {i}: " + "lorem ipsum " * (i + 3) for i in range(40)]


def test_write_shards_round_trip(tmp_path):
    encode, eot, vocab = byte_tokenizer()
    summary = write_shards(DOCS, tmp_path, "toy", encode, eot, shard_tokens=1000, val_tokens=300)
    names = sorted(p.name for p in tmp_path.glob("*.bin"))
    assert names[0] == "toy_train_000001.bin" and "toy_val_000000.bin" in names
    assert summary["val_tokens"] == 300
    stream = np.concatenate([read_shard(tmp_path / n).numpy() for n in summary["shards"]])
    expected = np.concatenate([[eot] + list(d.encode()) for d in DOCS])
    assert np.array_equal(stream, expected)
    assert all(read_shard(tmp_path / n).numel() == 1000 for n in summary["shards"][1:-1])
    data = load_data(DataConfig(name="shards", path=str(tmp_path), vocab_size=vocab), seq_len=64)
    assert data.val.numel() == 300 and data.train.numel() == len(expected) - 300


def test_shards_are_as_readable_as_the_umask_allows(tmp_path):
    """Others on a cluster train on prepared data: not mkstemp's 0600."""
    import os
    import stat

    encode, eot, _ = byte_tokenizer()
    old = os.umask(0o027)
    try:
        summary = write_shards(DOCS, tmp_path, "toy", encode, eot, shard_tokens=1000, val_tokens=300)
    finally:
        os.umask(old)
    modes = {stat.S_IMODE((tmp_path / n).stat().st_mode) for n in summary["shards"]}
    assert modes == {0o640}


def test_write_shards_max_tokens(tmp_path):
    encode, eot, _ = byte_tokenizer()
    summary = write_shards(iter(DOCS), tmp_path, "toy", encode, eot, shard_tokens=500, val_tokens=100, max_tokens=777)
    assert summary["train_tokens"] + summary["val_tokens"] == 777


def _run(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def test_missing_datasets_package_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    code, err = _run(["--out", str(tmp_path / "out")], capsys)
    assert code == 1 and err.count("\n") == 0
    assert err.startswith("prepare:") and "datasets" in err and "pip install datasets" in err


def test_missing_tiktoken_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    code, err = _run(["--out", str(tmp_path / "out"), "--tokenizer", "gpt2"], capsys)
    assert code == 1 and err.count("\n") == 0 and "tiktoken" in err


def test_existing_shards_are_not_mixed(tmp_path, capsys):
    (tmp_path / "old_train_000001.bin").write_bytes(b"")
    code, err = _run(["--out", str(tmp_path)], capsys)
    assert code == 1 and "already holds shards" in err and "--overwrite" in err


def test_main_with_a_fake_datasets_module(tmp_path, monkeypatch, capsys):
    class FakeDatasets:  # stands in for the `datasets` package: a stream of records
        @staticmethod
        def load_dataset(path, name=None, split=None, streaming=False):
            assert streaming
            return iter({"text": d, "id": i} for i, d in enumerate(DOCS))

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets())
    out = tmp_path / "out"
    code = main(["--dataset", "someone/toy-corpus", "--out", str(out), "--val-tokens", "200", "--shard-tokens", "1000"])
    assert code == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 256 and meta["dataset"] == "someone/toy-corpus"
    assert (out / "toy_corpus_val_000000.bin").exists()
    data = load_data(DataConfig(name="shards", path=str(out)), seq_len=32)
    assert data.fingerprint["dataset"] == "someone/toy-corpus" and data.val.numel() == 200
    capsys.readouterr()
    # a wrong field name is one line too
    code, err = _run(["--out", str(tmp_path / "o2"), "--text-field", "content"], capsys)
    assert code == 1 and "no field 'content'" in err and err.count("\n") == 0
