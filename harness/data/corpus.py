"""Byte-level corpora read from files: the Python standard library (the default) and plain text.

Design decisions:
- The default corpus needs no download: the `.py` files of the running interpreter's standard
  library (`sysconfig.get_paths()["stdlib"]`). Left out, with the reason:
  * `site-packages`, `dist-packages`: third-party code that differs between machines;
  * `test`, `tests`, `idle_test`: test suites (about 17 MB, more than the library itself, and full
    of generated fixtures; they would dominate the corpus);
  * `encodings`, `pydoc_data`: generated tables (charmap codecs, a 750 KB dict of help text), highly
    repetitive; one of them landing in the validation split would make it unrepresentatively easy;
  * `config-*` folders and `_sysconfigdata*` files: build-time data that records paths of the
    machine Python was built on, so the same Python version would fingerprint differently;
  * `__pycache__` and hidden folders.
  On CPython 3.11.7 this leaves 608 files, 9.9 MB.
- Files are read in sorted order of their relative POSIX path (the same on every OS).
- Train/validation split by file (a file is never cut in two, so validation text is unseen code,
  not the second half of a function seen in training). A file is held out when its path's sha256
  ranks among the first round(n·val_fraction) of all paths' hashes: deterministic, independent of
  the order files were found in, and adding a file moves at most one other file between splits.
  A single file (or a folder holding one) is split by position instead: its last val_fraction of
  bytes are the validation split.
- max_bytes caps the train split at (1 - val_fraction)·max_bytes and the validation split at the
  rest, reading files of each split in order and cutting the last one; the split is decided on the
  whole corpus first, so a capped run validates on a prefix of the full run's validation files.
- Tokens are the bytes themselves (vocabulary 256), as a uint8 tensor.
- The fingerprint hashes, for every file in order, its split, relative path, length and the bytes
  actually used, so it identifies both the content and the split.
- The tokenised result is cached on disk (see cache.py), keyed by the directory listing.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from pathlib import Path
from typing import Optional

import torch

from . import cache
from .config import DataError

EXCLUDED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path) -> list[tuple[str, Path]]:
    """(relative POSIX path, absolute path) of the corpus's `.py` files, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending (site-packages alone is often 100× the
        # library).
        dirnames[:] = [
            d for d in dirnames
            if d not in EXCLUDED_STDLIB_DIRS and not d.startswith((".", "config-"))
        ]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def list_text_files(root: Path) -> list[tuple[str, Path]]:
    """Every non-hidden regular file under a folder, sorted; a file path gives itself."""
    if root.is_file():
        return [(root.name, root)]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(".") and path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def held_out(rels: list[str], val_fraction: float) -> set[str]:
    """The relative paths of the validation files (see the module docstring)."""
    n = len(rels)
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    ranked = sorted(rels, key=lambda r: hashlib.sha256(r.encode()).hexdigest())
    return set(ranked[:n_val])


def _caps(val_fraction: float, max_bytes: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    if max_bytes is None:
        return None, None
    train_cap = int(max_bytes * (1 - val_fraction))
    return train_cap, max_bytes - train_cap


def _to_tensor(buf: bytearray) -> torch.Tensor:
    if not buf:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def load_corpus(
    source: str,
    root: Path,
    files: list[tuple[str, Path]],
    val_fraction: float,
    max_bytes: Optional[int],
    require_utf8: bool,
) -> dict:
    """Read, split, hash and tokenise `files`; returns {"train", "val", "fingerprint", "spans"}.

    `spans[split]` lists [relative path, start, end] of each file's tokens in that split, so later
    checks can name the file a bad token came from.
    """
    if not files and root.is_file():  # os.walk of a file finds nothing: say what it is, not "empty"
        raise DataError(f"data.path={root}: is a file, and data.name={source} reads a folder; allowed: "
                        "a folder, or data.name=text for a single file")
    if not files:
        what = ".py files" if source == "stdlib" else "files"
        raise DataError(f"{root}: empty corpus, no {what} found (data.name={source})")
    stats = [(rel, p.stat()) for rel, p in files]
    by_position = sum(st.st_size > 0 for _, st in stats) == 1  # one file with text (empty ones aside)
    # Size and mtime alone miss a file replaced by one of the same size with its mtime kept
    # (cp -p, rsync -a, tar x); the inode and ctime change then.
    key = cache.cache_key({
        "source": source, "root": str(root), "val_fraction": val_fraction, "max_bytes": max_bytes,
        "utf8": require_utf8,
        "files": [[rel, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns] for rel, st in stats],
    })
    hit = cache.load(key)
    if hit is not None:
        return hit

    train_cap, val_cap = _caps(val_fraction, max_bytes)
    val_rels = set() if by_position else held_out([rel for rel, _ in files], val_fraction)
    bufs = {"train": bytearray(), "val": bytearray()}
    caps = {"train": train_cap, "val": val_cap}
    spans: dict[str, list] = {"train": [], "val": []}
    digest = hashlib.sha256()
    total = 0
    for rel, path in files:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
        total += len(data)
        if require_utf8:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                    "data.name=text reads UTF-8 files"
                ) from None
        if by_position:
            cut = len(data) - max(1, round(len(data) * val_fraction)) if data else 0
            pieces = [("train", data[:cut]), ("val", data[cut:])]
        else:
            pieces = [("val" if rel in val_rels else "train", data)]
        for split, piece in pieces:
            buf, cap = bufs[split], caps[split]
            if cap is not None:
                piece = piece[: max(0, cap - len(buf))]
            if not piece:
                continue
            digest.update(f"{split}\0{rel}\0{len(piece)}\0".encode())
            digest.update(piece)
            spans[split].append([rel, len(buf), len(buf) + len(piece)])
            buf += piece
    if total == 0:
        raise DataError(f"{root}: empty corpus, {len(files)} files but 0 bytes (data.name={source})")

    fingerprint = {
        "source": source,
        "root": str(root),
        "files": len(files),
        "train_files": len(spans["train"]),
        "val_files": len(spans["val"]),
        "bytes": len(bufs["train"]) + len(bufs["val"]),
        "train_tokens": len(bufs["train"]),
        "val_tokens": len(bufs["val"]),
        "sha256": digest.hexdigest(),
        "tokenizer": "bytes",
        "split": "by_position" if by_position else "by_file",
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
    }
    if source == "stdlib":
        fingerprint["python"] = platform.python_version()
    entry = {
        "train": _to_tensor(bufs["train"]),
        "val": _to_tensor(bufs["val"]),
        "fingerprint": fingerprint,
        "spans": spans,
    }
    cache.store(key, entry)
    return entry
