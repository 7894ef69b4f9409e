"""Token files that people already have: llm.c / modded-nanogpt shards and nanoGPT train.bin/val.bin.

llm.c shard: 256 little-endian int32 of header (magic 20240520, version 1, token count), then the
uint16 tokens; `*_val_*.bin` and `*_train_*.bin` read in name order. nanoGPT: headerless uint16
`train.bin` and `val.bin`. Every file is checked from its size and header before a token is used.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np
import torch

from . import cache
from .datatypes import DataError
from .memory import available_bytes, check_tokens_fit

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS
TOKEN_DTYPE = np.dtype("<u2")

TokensLike = Union[torch.Tensor, np.ndarray, Iterable[int]]


# --- writing ---------------------------------------------------------------------------------------
def _as_uint16(tokens: TokensLike) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().long().numpy()
    arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
    if arr.size and (arr.min() < 0 or arr.max() >= 2**16):
        raise ValueError(f"tokens must lie in [0, 65535] to be stored as uint16, got [{arr.min()}, {arr.max()}]")
    return arr.astype(TOKEN_DTYPE).ravel()


def write_atomic(path: Path, chunks: list[bytes]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        # mkstemp creates 0600; a prepared dataset is as readable as the umask lets new files be
        # (a cluster's other users train on it).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_shard(path: Union[str, Path], tokens: TokensLike) -> Path:
    """Write one llm.c shard (header + uint16 tokens)."""
    arr = _as_uint16(tokens)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, arr.size)
    write_atomic(Path(path), [header.tobytes(), arr.tobytes()])
    return Path(path)


def write_nanogpt_bin(path: Union[str, Path], tokens: TokensLike) -> Path:
    """Write one headerless nanoGPT uint16 file."""
    write_atomic(Path(path), [_as_uint16(tokens).tobytes()])
    return Path(path)


# --- reading ---------------------------------------------------------------------------------------
def _memmap(path: Path, offset: int, count: int) -> torch.Tensor:
    if count == 0:  # numpy cannot map zero bytes
        return torch.empty(0, dtype=torch.uint16)
    # Copy-on-write: the tensor is writable, the file can never be modified through it.
    arr = np.memmap(path, dtype=TOKEN_DTYPE, mode="c", offset=offset, shape=(count,))
    return torch.from_numpy(arr)


def shard_token_count(path: Union[str, Path]) -> int:
    """Validate an llm.c shard's header against its size; return its token count."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such shard file")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path}: truncated shard, {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    magic, version, count = (int(v) for v in header[:3])
    if magic != SHARD_MAGIC:
        raise DataError(
            f"{path}: wrong shard magic {magic} (expected {SHARD_MAGIC}); not an llm.c token shard "
            "(a headerless nanoGPT file needs data.name=nanogpt)"
        )
    if version != SHARD_VERSION:
        raise DataError(f"{path}: unsupported shard version {version} (expected {SHARD_VERSION}, uint16 tokens)")
    expected = HEADER_BYTES + 2 * count
    if count < 0 or size < expected:
        raise DataError(
            f"{path}: truncated shard, header declares {count} tokens ({expected} bytes) but the file has {size} bytes"
        )
    if size > expected:
        raise DataError(
            f"{path}: corrupt shard, {size - expected} bytes beyond the {count} tokens its header declares"
        )
    return count


def read_shard(path: Union[str, Path]) -> torch.Tensor:
    """An llm.c shard's tokens as a memory-mapped uint16 tensor (validated first)."""
    count = shard_token_count(path)
    return _memmap(Path(path), HEADER_BYTES, count)


def nanogpt_token_count(path: Union[str, Path]) -> int:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file (data.name=nanogpt needs train.bin and val.bin)")
    size = path.stat().st_size
    if size % 2:
        raise DataError(f"{path}: odd size of {size} bytes, not a file of uint16 tokens")
    return size // 2


def read_nanogpt_bin(path: Union[str, Path]) -> torch.Tensor:
    count = nanogpt_token_count(path)
    return _memmap(Path(path), 0, count)


def find_shards(folder: Union[str, Path]) -> tuple[list[Path], list[Path]]:
    """(train shards, val shards) of a folder, each sorted by name."""
    folder = Path(folder)
    if not folder.exists():
        raise DataError(f"{folder}: no such folder (data.path for data.name=shards)")
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder; data.name=shards reads a folder of *_train_*.bin and *_val_*.bin")
    train, val = sorted(folder.glob("*_train_*.bin")), sorted(folder.glob("*_val_*.bin"))
    for split, found in (("train", train), ("val", val)):
        if not found:
            raise DataError(f"{folder}: empty corpus, no *_{split}_*.bin shards found")
    return train, val


def nanogpt_files(path: Union[str, Path]) -> tuple[Path, Path]:
    """train.bin and val.bin from a folder (or from the path of either file)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or folder (data.path for data.name=nanogpt)")
    folder = path if path.is_dir() else path.parent
    return folder / "train.bin", folder / "val.bin"


# --- splits ----------------------------------------------------------------------------------------
def _digest(path: Path, offset: int, count: int) -> str:
    """sha256 of `count` tokens at byte `offset`, memoised by the file's identity (hashing gigabytes
    on every start is slow)."""
    st = path.stat()
    # the inode and ctime too: a file replaced by one of the same size with its mtime kept (cp -p,
    # rsync -a) kept its old digest, and a run resumed on other tokens without a word
    key = cache.cache_key({"digest": str(path.resolve()), "size": st.st_size, "mtime": st.st_mtime_ns,
                           "inode": st.st_ino, "ctime": st.st_ctime_ns, "offset": offset, "count": count})
    hit = cache.load(key)
    if hit is not None and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    h = hashlib.sha256()
    remaining = 2 * count
    with open(path, "rb") as f:
        f.seek(offset)
        while remaining > 0:
            chunk = f.read(min(remaining, 1 << 24))
            if not chunk:
                break
            h.update(chunk)
            remaining -= len(chunk)
    cache.store(key, {"sha256": h.hexdigest()})
    return h.hexdigest()


def load_split(
    files: list[tuple[Path, int, int]], cap_bytes: Optional[int], digest: "hashlib._Hash", split: str
) -> tuple[torch.Tensor, list]:
    """Concatenate (path, byte offset, token count) files into one split, respecting the cap.

    Returns the tokens and the spans [file name, start, end] used to name a file in later errors.
    """
    parts, spans, used = [], [], 0
    budget = None if cap_bytes is None else cap_bytes // 2
    for path, offset, count in files:
        take = count if budget is None else min(count, budget - used)
        if take <= 0:
            break
        parts.append(_memmap(path, offset, take))
        digest.update(f"{split}\0{path.name}\0{take}\0{_digest(path, offset, take)}\0".encode())
        spans.append([str(path), used, used + take])
        used += take
    if not parts:
        return torch.empty(0, dtype=torch.uint16), spans
    if len(parts) == 1:  # one file stays memory-mapped; several are concatenated (one tensor a split)
        return parts[0], spans
    check_tokens_fit(used, available_bytes())
    return torch.from_numpy(np.concatenate([p.numpy() for p in parts])), spans


def load_token_files(
    source: str,
    root: Path,
    train: list[tuple[Path, int, int]],
    val: list[tuple[Path, int, int]],
    val_fraction: float,
    max_bytes: Optional[int],
) -> dict:
    """Both splits of a shard or nanoGPT source: {"train", "val", "fingerprint", "spans"}."""
    if max_bytes is None:
        caps = (None, None)
    else:
        train_cap = int(max_bytes * (1 - val_fraction))
        caps = (train_cap, max_bytes - train_cap)
    digest = hashlib.sha256()
    train_t, train_spans = load_split(train, caps[0], digest, "train")
    val_t, val_spans = load_split(val, caps[1], digest, "val")
    fingerprint = {
        "source": source,
        "root": str(root),
        "files": len(train) + len(val),
        "train_files": len(train_spans),
        "val_files": len(val_spans),
        "bytes": 2 * (len(train_t) + len(val_t)),
        "train_tokens": len(train_t),
        "val_tokens": len(val_t),
        "sha256": digest.hexdigest(),
        "tokenizer": "uint16 token ids",
        "max_bytes": max_bytes,
    }
    return {"train": train_t, "val": val_t, "fingerprint": fingerprint,
            "spans": {"train": train_spans, "val": val_spans}}


def load_shard_folder(folder: Path, val_fraction: float, max_bytes: Optional[int]) -> dict:
    train, val = find_shards(folder)
    entries = [[(p, HEADER_BYTES, shard_token_count(p)) for p in files] for files in (train, val)]
    out = load_token_files("shards", folder, entries[0], entries[1], val_fraction, max_bytes)
    meta = read_meta(folder)
    if meta:  # written by `python -m harness.data.prepare`: say which tokenizer made the ids
        fp = out["fingerprint"]
        for key, value in meta.items():
            if key in ("tokenizer", "dataset", "dataset_config", "text_field"):
                fp[key] = value
        if "vocab_size" in meta:
            fp["tokenizer_vocab_size"] = meta["vocab_size"]
    return out


META_FILE = "meta.json"


def read_meta(folder: Path) -> dict:
    """The optional meta.json that `prepare` writes beside its shards ({} when absent)."""
    path = Path(folder) / META_FILE
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable shard metadata ({e})") from None
    return meta if isinstance(meta, dict) else {}


def load_nanogpt(path: Path, val_fraction: float, max_bytes: Optional[int]) -> dict:
    train, val = nanogpt_files(path)
    entries = [[(p, 0, nanogpt_token_count(p))] for p in (train, val)]
    return load_token_files("nanogpt", train.parent, entries[0], entries[1], val_fraction, max_bytes)
