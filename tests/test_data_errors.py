"""Every kind of bad data stops load_data with a DataError naming the file and the problem."""
from __future__ import annotations

import numpy as np
import pytest

from harness.data import DataConfig, DataError, load_data, write_nanogpt_bin, write_shard
from harness.data.shards import HEADER_BYTES


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))


def _fails(cfg: DataConfig, seq_len: int, *fragments: str) -> str:
    with pytest.raises(DataError) as info:
        load_data(cfg, seq_len)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "\n" not in message  # one line
    return message


def _good_shards(folder, n=200):
    write_shard(folder / "d_val_000000.bin", np.arange(n) % 256)
    write_shard(folder / "d_train_000001.bin", np.arange(n) % 256)


@pytest.mark.parametrize("name", ["text", "shards", "nanogpt", "stdlib"])
def test_missing_path(tmp_path, name):
    missing = tmp_path / "nowhere"
    _fails(DataConfig(name=name, path=str(missing)), 8, str(missing), "no such file or folder")


def test_path_required():
    _fails(DataConfig(name="text"), 8, "data.path is required", "text")


def test_unknown_source():
    _fails(DataConfig(name="wikipedia"), 8, "data.name='wikipedia'", "allowed: stdlib, text, shards")


def test_wrong_shard_magic(tmp_path):
    _good_shards(tmp_path)
    bad = tmp_path / "d_train_000002.bin"
    write_nanogpt_bin(bad, np.arange(600))  # headerless: its first int32 is not the magic
    _fails(DataConfig(name="shards", path=str(tmp_path)), 8, str(bad), "wrong shard magic", "20240520")


def test_wrong_shard_version(tmp_path):
    _good_shards(tmp_path)
    bad = tmp_path / "d_train_000002.bin"
    write_shard(bad, np.arange(100))
    raw = bytearray(bad.read_bytes())
    raw[4:8] = np.array([2], dtype="<i4").tobytes()
    bad.write_bytes(bytes(raw))
    _fails(DataConfig(name="shards", path=str(tmp_path)), 8, str(bad), "unsupported shard version 2")


def test_truncated_shard(tmp_path):
    _good_shards(tmp_path)
    bad = tmp_path / "d_train_000002.bin"
    write_shard(bad, np.arange(100))
    bad.write_bytes(bad.read_bytes()[:-10])  # an interrupted download
    _fails(DataConfig(name="shards", path=str(tmp_path)), 8, str(bad), "truncated shard", "declares 100 tokens")


def test_shard_shorter_than_header(tmp_path):
    _good_shards(tmp_path)
    bad = tmp_path / "d_val_000001.bin"
    bad.write_bytes(b"\0" * 100)
    _fails(DataConfig(name="shards", path=str(tmp_path)), 8, str(bad), "truncated shard", f"{HEADER_BYTES}-byte header")


def test_shard_with_trailing_bytes(tmp_path):
    _good_shards(tmp_path)
    bad = tmp_path / "d_train_000002.bin"
    write_shard(bad, np.arange(100))
    bad.write_bytes(bad.read_bytes() + b"\1\2\3\4")
    _fails(DataConfig(name="shards", path=str(tmp_path)), 8, str(bad), "corrupt shard", "4 bytes beyond")


def test_shard_folder_without_val(tmp_path):
    write_shard(tmp_path / "d_train_000001.bin", np.arange(100))
    _fails(DataConfig(name="shards", path=str(tmp_path)), 8, str(tmp_path), "empty corpus", "*_val_*.bin")


def test_shards_path_is_a_file(tmp_path):
    path = write_shard(tmp_path / "d_train_000001.bin", np.arange(100))
    _fails(DataConfig(name="shards", path=str(path)), 8, str(path), "not a folder")


def test_empty_text_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    _fails(DataConfig(name="text", path=str(tmp_path / "empty")), 8, str(tmp_path / "empty"), "empty corpus")


def test_text_folder_of_empty_files(tmp_path):
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_bytes(b"")
    _fails(DataConfig(name="text", path=str(tmp_path)), 8, str(tmp_path), "empty corpus", "0 bytes")


def test_text_not_utf8(tmp_path):
    (tmp_path / "good.txt").write_text("hello " * 100)
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    _fails(DataConfig(name="text", path=str(tmp_path)), 8, "image.png", "not UTF-8", "0x89")


def test_sequence_longer_than_the_data(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("x" * 1000)
    _fails(DataConfig(name="text", path=str(path), val_fraction=0.1), 256, str(path),
           "sequence longer than the data", "val split has 100 tokens", "small.txt", "seq_len+1 = 257")


def test_sequence_longer_than_shards(tmp_path):
    _good_shards(tmp_path, n=50)
    _fails(DataConfig(name="shards", path=str(tmp_path)), 64, "sequence longer than the data",
           "train split has 50 tokens", "d_train_000001.bin")


def test_token_outside_vocab(tmp_path):
    write_shard(tmp_path / "d_val_000000.bin", np.arange(100))
    write_shard(tmp_path / "d_train_000001.bin", np.arange(100))
    write_shard(tmp_path / "d_train_000002.bin", np.full(100, 300))
    _fails(DataConfig(name="shards", path=str(tmp_path)), 8, "d_train_000002.bin", "token 300 >= data.vocab_size=256")


def test_byte_outside_small_vocab(tmp_path):
    (tmp_path / "a.txt").write_text("abc" * 100)
    (tmp_path / "b.txt").write_text("é" * 100)
    _fails(DataConfig(name="text", path=str(tmp_path), vocab_size=128, val_fraction=0.5), 8,
           "b.txt", ">= data.vocab_size=128")


def test_meta_vocab_mismatch(tmp_path):
    _good_shards(tmp_path)
    (tmp_path / "meta.json").write_text('{"tokenizer": "gpt2", "vocab_size": 50257}')
    _fails(DataConfig(name="shards", path=str(tmp_path)), 8, "meta.json", "gpt2", "data.vocab_size=50257")


def test_nanogpt_missing_val(tmp_path):
    write_nanogpt_bin(tmp_path / "train.bin", np.arange(100))
    _fails(DataConfig(name="nanogpt", path=str(tmp_path)), 8, str(tmp_path / "val.bin"), "no such file")


def test_nanogpt_odd_size(tmp_path):
    write_nanogpt_bin(tmp_path / "train.bin", np.arange(100))
    (tmp_path / "val.bin").write_bytes(b"\0" * 101)
    _fails(DataConfig(name="nanogpt", path=str(tmp_path)), 8, "val.bin", "odd size of 101 bytes")


@pytest.mark.parametrize("override, fragment", [
    ({"val_fraction": 0.0}, "data.val_fraction=0.0"),
    ({"val_fraction": 1.5}, "data.val_fraction=1.5"),
    ({"max_bytes": 0}, "data.max_bytes=0"),
    ({"vocab_size": 0}, "data.vocab_size=0"),
])
def test_bad_settings(override, fragment):
    _fails(DataConfig(**override), 8, fragment)


def test_multihop_sequence_too_short():
    _fails(DataConfig(name="multihop", n_vars=12), 32, "multihop", "seq_len=32", "53 tokens")


@pytest.mark.parametrize("override, fragment", [
    ({"hops": []}, "data.hops=[]"),
    ({"hops": [0, 1]}, "data.hops=[0, 1]"),
    ({"hops": [5], "n_vars": 4}, "data.n_vars=4"),
    ({"n_vars": 27}, "data.n_vars=27"),
    ({"val_examples": 2}, "data.val_examples=2"),
])
def test_multihop_bad_settings(override, fragment):
    _fails(DataConfig(name="multihop", **override), 256, fragment)
