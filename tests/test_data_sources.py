"""Each data source round-trips and loads through load_data; the stdlib default is stable."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.data import DataConfig, load_data, read_nanogpt_bin, read_shard, write_nanogpt_bin, write_shard
from harness.data.corpus import held_out, list_stdlib_files, stdlib_root
from harness.data.shards import HEADER_BYTES, SHARD_MAGIC


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))


def test_shard_writer_reader_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, size=1000)
    path = write_shard(tmp_path / "x_train_000001.bin", tokens)
    assert path.stat().st_size == HEADER_BYTES + 2 * 1000
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [SHARD_MAGIC, 1, 1000]
    back = read_shard(path)
    assert back.dtype == torch.uint16
    assert np.array_equal(back.numpy(), tokens)


def test_nanogpt_bin_round_trip(tmp_path):
    tokens = torch.randint(0, 65535, (777,))
    write_nanogpt_bin(tmp_path / "train.bin", tokens)
    assert (tmp_path / "train.bin").stat().st_size == 2 * 777
    assert torch.equal(read_nanogpt_bin(tmp_path / "train.bin").long(), tokens)


def test_shard_folder_loads_in_order_and_caps(tmp_path):
    parts = [np.arange(i * 100, i * 100 + 100) % 300 for i in range(3)]
    write_shard(tmp_path / "d_val_000000.bin", parts[0])
    write_shard(tmp_path / "d_train_000001.bin", parts[1])
    write_shard(tmp_path / "d_train_000002.bin", parts[2])
    data = load_data(DataConfig(name="shards", path=str(tmp_path), vocab_size=300), seq_len=16)
    assert np.array_equal(data.val.numpy(), parts[0])
    assert np.array_equal(data.train.numpy(), np.concatenate(parts[1:]))
    fp = data.fingerprint
    assert (fp["source"], fp["files"], fp["train_tokens"], fp["val_tokens"]) == ("shards", 3, 200, 100)
    assert fp == load_data(DataConfig(name="shards", path=str(tmp_path), vocab_size=300), seq_len=16).fingerprint
    # max_bytes=300 with val_fraction 0.2: 240 bytes (120 tokens) train, 60 bytes (30 tokens) val.
    capped = load_data(DataConfig(name="shards", path=str(tmp_path), vocab_size=300, max_bytes=300,
                                  val_fraction=0.2), seq_len=16)
    assert np.array_equal(capped.train.numpy(), np.concatenate(parts[1:])[:120])
    assert np.array_equal(capped.val.numpy(), parts[0][:30])
    assert capped.fingerprint["sha256"] != fp["sha256"]


def test_single_shard_split_is_memory_mapped(tmp_path):
    write_shard(tmp_path / "d_val_000000.bin", np.arange(64))
    write_shard(tmp_path / "d_train_000001.bin", np.arange(64))
    data = load_data(DataConfig(name="shards", path=str(tmp_path)), seq_len=8)
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs Linux /proc to see memory mappings")
    address = data.train.data_ptr()
    mapped = []
    for line in maps.read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(v, 16) for v in span.split("-"))
        if lo <= address < hi:
            mapped.append(rest[-1] if len(rest) >= 5 else "")
    assert mapped and mapped[0].endswith("d_train_000001.bin")
    data.train[0] = 7  # copy-on-write: the tensor is writable, the file is not changed
    assert read_shard(tmp_path / "d_train_000001.bin")[0] == 0


def test_nanogpt_folder_loads(tmp_path):
    write_nanogpt_bin(tmp_path / "train.bin", np.arange(500) % 256)
    write_nanogpt_bin(tmp_path / "val.bin", np.arange(100) % 256)
    for path in (tmp_path, tmp_path / "train.bin"):  # the folder or either file
        data = load_data(DataConfig(name="nanogpt", path=str(path)), seq_len=32)
        assert torch.equal(data.train.long(), torch.arange(500) % 256)
        assert torch.equal(data.val.long(), torch.arange(100))
        assert data.fingerprint["source"] == "nanogpt"


def _text_folder(root: Path, n: int = 20) -> dict[str, bytes]:
    files = {}
    for i in range(n):
        rel = f"sub{i % 3}/doc{i:02d}.txt"
        content = (f"document {i} " * (50 + i) + "é\n").encode()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
        files[rel] = content
    (root / ".hidden").write_text("never read")
    return files


def test_text_folder_splits_by_file(tmp_path):
    files = _text_folder(tmp_path / "corpus")
    cfg = DataConfig(name="text", path=str(tmp_path / "corpus"), val_fraction=0.1)
    data = load_data(cfg, seq_len=64)
    val_rels = held_out(sorted(files), 0.1)
    assert len(val_rels) == 2
    expect_train = b"".join(files[r] for r in sorted(files) if r not in val_rels)
    expect_val = b"".join(files[r] for r in sorted(files) if r in val_rels)
    assert bytes(data.train.tolist()) == expect_train
    assert bytes(data.val.tolist()) == expect_val
    assert data.train.dtype == torch.uint8 and data.vocab_size == 256
    fp = data.fingerprint
    assert (fp["files"], fp["train_files"], fp["val_files"]) == (20, 18, 2)
    assert fp["bytes"] == sum(map(len, files.values()))
    assert fp == load_data(cfg, seq_len=64).fingerprint  # second load comes from the cache


def test_text_single_file_splits_by_position_and_caps(tmp_path):
    path = tmp_path / "book.txt"
    content = bytes(range(32, 127)) * 20
    path.write_bytes(content)
    data = load_data(DataConfig(name="text", path=str(path), val_fraction=0.1), seq_len=16)
    cut = len(content) - round(len(content) * 0.1)
    assert bytes(data.train.tolist()) == content[:cut]
    assert bytes(data.val.tolist()) == content[cut:]
    capped = load_data(DataConfig(name="text", path=str(path), val_fraction=0.1, max_bytes=1000), seq_len=16)
    assert bytes(capped.train.tolist()) == content[:900]
    assert bytes(capped.val.tolist()) == content[cut:cut + 100]


def test_stdlib_default_loads_with_stable_fingerprint(monkeypatch, tmp_path):
    first = load_data(DataConfig(), seq_len=256)  # builds and caches
    second = load_data(DataConfig(), seq_len=256)  # from the cache
    monkeypatch.setenv("ATTNRES_CACHE", "off")
    third = load_data(DataConfig(), seq_len=256)  # rebuilt without a cache
    assert first.fingerprint == second.fingerprint == third.fingerprint
    assert torch.equal(first.train, third.train) and torch.equal(first.val, third.val)
    fp = first.fingerprint
    assert fp["source"] == "stdlib" and fp["files"] > 100 and fp["bytes"] > 1_000_000
    assert fp["bytes"] == first.train.numel() + first.val.numel()
    assert len(fp["sha256"]) == 64
    assert 0.01 < first.val.numel() / fp["bytes"] < 0.2
    rels = [rel for rel, _ in list_stdlib_files(stdlib_root())]
    assert rels == sorted(rels)
    assert not any(part in ("site-packages", "test", "tests") for rel in rels for part in rel.split("/"))
    assert "argparse.py" in rels


def test_stdlib_max_bytes_caps_both_splits(tmp_path):
    data = load_data(DataConfig(max_bytes=200_000), seq_len=128)
    assert data.train.numel() == 190_000 and data.val.numel() == 10_000
    assert data.fingerprint["max_bytes"] == 200_000


def test_a_folder_with_one_nonempty_file_splits_it_by_position(tmp_path):
    """An empty file beside one text file does not make the folder a split by file (which held
    the only real file out and left 0 training tokens)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    content = bytes(range(32, 127)) * 20
    (folder / "a.txt").write_bytes(content)
    (folder / "empty.txt").write_bytes(b"")
    data = load_data(DataConfig(name="text", path=str(folder), val_fraction=0.1), seq_len=16)
    cut = len(content) - round(len(content) * 0.1)
    assert bytes(data.train.tolist()) == content[:cut] and bytes(data.val.tolist()) == content[cut:]


def test_a_file_replaced_with_its_size_and_mtime_kept_is_read_again(tmp_path):
    """The data cache's key: a same-size file put in place with the old mtime (cp -p, rsync -a)
    must not return the old bytes under the old fingerprint."""
    import os

    path = tmp_path / "book.txt"
    path.write_bytes(b"x" * 2000)
    first = load_data(DataConfig(name="text", path=str(path)), seq_len=16)
    st = path.stat()
    replacement = tmp_path / "new.txt"
    replacement.write_bytes(b"y" * 2000)
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(replacement, path)
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size
    again = load_data(DataConfig(name="text", path=str(path)), seq_len=16)
    assert set(again.train.tolist()) == {ord("y")}
    assert again.fingerprint["sha256"] != first.fingerprint["sha256"]


@pytest.mark.parametrize("source", ["shards", "nanogpt"])
def test_token_files_replaced_with_their_size_and_mtime_kept_get_a_new_fingerprint(source, tmp_path):
    """The same for token files: their digest was memoised by path, size and mtime alone, so the
    fingerprint (what a resumed run compares its data with) stayed the old one."""
    import os

    def write(folder, value):
        folder.mkdir()
        if source == "shards":
            for split in ("train", "val"):
                write_shard(folder / f"d_{split}_000000.bin", [value] * 500)
        else:
            for split in ("train", "val"):
                write_nanogpt_bin(folder / f"{split}.bin", [value] * 500)
        return sorted(folder.iterdir())

    data = tmp_path / "data"
    old = write(data, 1)
    first = load_data(DataConfig(name=source, path=str(data), vocab_size=256), seq_len=16)
    new = write(tmp_path / "new", 2)
    for before, after in zip(old, new):
        st = before.stat()
        os.utime(after, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(after, before)
    again = load_data(DataConfig(name=source, path=str(data), vocab_size=256), seq_len=16)
    assert set(again.train.tolist()) == {2} and again.fingerprint["sha256"] != first.fingerprint["sha256"]


def test_corrupt_cache_entry_is_rebuilt(tmp_path):
    cfg = DataConfig(max_bytes=50_000)
    good = load_data(cfg, seq_len=64)
    entries = list((tmp_path / "cache").glob("corpus-*.pt"))
    assert entries
    for entry in entries:
        entry.write_bytes(b"not a torch file")
    again = load_data(cfg, seq_len=64)
    assert again.fingerprint == good.fingerprint and torch.equal(again.train, good.train)


def test_prepare_meta_names_the_vocab(tmp_path):
    write_shard(tmp_path / "d_val_000000.bin", np.arange(64))
    write_shard(tmp_path / "d_train_000001.bin", np.arange(64))
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": "gpt2", "vocab_size": 50257}))
    data = load_data(DataConfig(name="shards", path=str(tmp_path), vocab_size=50257), seq_len=8)
    assert data.fingerprint["tokenizer"] == "gpt2"


def test_config_works_as_a_structured_config(tmp_path):
    from omegaconf import OmegaConf

    node = OmegaConf.structured(DataConfig)
    node.merge_with_dotlist(["name=multihop", "hops=[1,3]", "n_vars=5", "train_examples=50", "val_examples=10"])
    data = load_data(node, seq_len=32)  # a DictConfig is accepted as well as the dataclass
    assert data.fingerprint["hops"] == [1, 3]
    assert isinstance(OmegaConf.to_object(node), DataConfig)
    with pytest.raises(Exception):
        OmegaConf.merge(OmegaConf.structured(DataConfig), {"max_byte": 3})  # a misspelt key fails
