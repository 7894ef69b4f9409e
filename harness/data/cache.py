"""On-disk cache of tokenised corpora, so that a second run with the same data starts at once.

The key hashes what a corpus is built from (source, root, settings, each file's path, size, mtime
and inode), so it costs a directory listing. Entries are renamed into place, so parallel jobs never
read half of one; the cache never fails a run: a bad entry is rebuilt, an unwritable folder warns.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

FORMAT_VERSION = 1  # bump when what a cache entry holds, or how a corpus is built, changes


def cache_dir() -> Optional[Path]:
    env = os.environ.get("ATTNRES_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("off", "0", "none", "") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "attnres"


def cache_key(inputs: Any) -> str:
    blob = json.dumps({"v": FORMAT_VERSION, "inputs": inputs}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def load(key: str) -> Optional[dict]:
    root = cache_dir()
    if root is None:
        return None
    path = root / f"corpus-{key}.pt"
    if not path.is_file():
        return None
    try:
        # weights_only: the entry holds tensors and plain containers only, and nothing in a cache
        # folder should be able to run code.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a truncated or foreign file: rebuild rather than fail the run
        return None


def store(key: str, entry: dict) -> None:
    root = cache_dir()
    if root is None:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".corpus-", suffix=".tmp", dir=root)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(entry, f)
            os.replace(tmp, root / f"corpus-{key}.pt")
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        warnings.warn(f"attnres data cache not written ({root}): {e}", RuntimeWarning, stacklevel=2)
