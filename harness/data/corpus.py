"""Byte-level corpora read from files: the Python standard library (the default) and plain text.

The default needs no download: the running interpreter's stdlib `.py` files, less third-party code,
tests and generated tables. Files split by a hash of their path (validation is unseen files, not
halves of seen ones); tokens are the bytes (vocabulary 256). Rules and reasons: docs/DATA.md.
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
from .datatypes import DataError

# Third-party code (differs per machine), test suites (larger than the library, full of fixtures)
# and generated tables (repetitive, an unrepresentatively easy validation split).
EXCLUDED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path) -> list[tuple[str, Path]]:
    """(relative POSIX path, absolute path) of the corpus's `.py` files, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into site-packages and the like; config-*
        # folders and _sysconfigdata record the build machine's paths.
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
    """The relative paths of the validation files: those whose path's sha256 ranks among the first
    round(n·val_fraction), independent of listing order; adding a file moves at most one other."""
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
    _refuse_no_files(source, root, files)
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
    bufs, spans, digest = _split(files, val_fraction, max_bytes, require_utf8, by_position, source, root)
    fingerprint = {
        "source": source,
        "root": str(root),
        "files": len(files),
        "train_files": len(spans["train"]),
        "val_files": len(spans["val"]),
        "bytes": len(bufs["train"]) + len(bufs["val"]),
        "train_tokens": len(bufs["train"]),
        "val_tokens": len(bufs["val"]),
        "sha256": digest,
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


def _refuse_no_files(source: str, root: Path, files: list[tuple[str, Path]]) -> None:
    if not files and root.is_file():  # os.walk of a file finds nothing: say what it is, not "empty"
        raise DataError(f"data.path={root}: is a file, and data.name={source} reads a folder; allowed: "
                        "a folder, or data.name=text for a single file")
    if not files:
        what = ".py files" if source == "stdlib" else "files"
        raise DataError(f"{root}: empty corpus, no {what} found (data.name={source})")


def _read(path: Path, require_utf8: bool) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
    if require_utf8:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                "data.name=text reads UTF-8 files"
            ) from None
    return data


def _split(files: list[tuple[str, Path]], val_fraction: float, max_bytes: Optional[int], require_utf8: bool,
           by_position: bool, source: str, root: Path) -> tuple[dict[str, bytearray], dict[str, list], str]:
    """(bytes by split, spans by split, sha256 of both): whole files to one split, or one file cut
    at its end (by_position), each split capped at its share of max_bytes."""
    train_cap, val_cap = _caps(val_fraction, max_bytes)
    val_rels = set() if by_position else held_out([rel for rel, _ in files], val_fraction)
    bufs = {"train": bytearray(), "val": bytearray()}
    caps = {"train": train_cap, "val": val_cap}
    spans: dict[str, list] = {"train": [], "val": []}
    digest = hashlib.sha256()
    total = 0
    for rel, path in files:
        data = _read(path, require_utf8)
        total += len(data)
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
    return bufs, spans, digest.hexdigest()
