"""Replace a file all at once: readers see the old file or the new one, never half of one.

A run's record, its checkpoint, the tracker's pending files and the evaluation's outputs are all
written this way: a kill -9 or a full disk in the middle of a write leaves the previous version
in place and no temporary file behind. No torch here, so the tracker (used by the sweeper's
process) and the evaluation's output writers can import it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows cannot open folders; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call write(tmp_path), fsync it, rename it onto `path`; on any error remove the temp file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
