"""Whether a corpus can be read into memory, checked before a byte of it is read.

The text loader (corpus.py) reads each file whole, checks its UTF-8 by decoding it, slices it into
the splits and copies the kept bytes into one tensor. Its peak, measured on this loader: the
largest file S once for the read and once more for the decoded text (up to 4 S: Python keeps a
string at 1, 2 or 4 bytes a character, by its widest character), or twice S (the read and its
slices) plus the kept bytes K, or 2 K while the tensors are made. A 2 GB file with no
`data.max_bytes` would otherwise go to the OOM killer, which ends a run without a line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from .datatypes import DataError

GIB = 1 << 30
SLACK = 1.1  # the estimate below is up to 10% under the peak measured (allocator rounding, slices)
SCAN_CHUNK = 1 << 24


def available_bytes() -> Optional[int]:
    """The machine's memory left to this process (harness.memory_budget's figure; None: unknown)."""
    from harness.memory_budget import available_bytes as machine  # torch and the run config: loaded by now

    return machine()


def corpus_need(largest: int, kept: int, decoding: int) -> int:
    """Peak bytes for reading a corpus whose largest file is `largest` bytes, keeping `kept`, where
    decoding the worst file takes `decoding` bytes with its read (0: not decoded)."""
    return int(SLACK * max(decoding, 2 * largest + kept, 2 * kept))


def _char_width(path: Path) -> int:
    """Bytes a character of `path`'s decoded string takes (1, 2 or 4), from its lead bytes: 0xF0
    and above start characters beyond U+FFFF, 0xC4 and above beyond U+00FF."""
    top = 0
    with open(path, "rb") as handle:
        while top < 0xF0:
            chunk = handle.read(SCAN_CHUNK)
            if not chunk:
                break
            top = max(top, int(np.frombuffer(chunk, dtype=np.uint8).max()))
    return 4 if top >= 0xF0 else 2 if top >= 0xC4 else 1


def check_corpus_fits(files: list[tuple[str, Path]], max_bytes: Optional[int], decoded: bool,
                      available: Optional[int]) -> None:
    """Raise DataError (one line, naming data.max_bytes with a value that fits where one does) if
    reading `files` would take more than `available` bytes (None: unknown, not checked)."""
    if available is None or not files:
        return
    sizes = [(p.stat().st_size, p) for _, p in files]
    largest, total = max(s for s, _ in sizes), sum(s for s, _ in sizes)
    kept = total if max_bytes is None else min(total, max_bytes)
    room = int(available / SLACK)
    # A file's decoded text is taken at its widest (4 bytes a byte) unless that does not fit; then
    # its lead bytes are read (no decoding) for its real width. Only when the rest fits anyway.
    decoding = 0
    if decoded and 2 * largest + kept <= room:
        decoding = max(s * (1 + (4 if 5 * s <= room else _char_width(p))) for s, p in sizes)
    elif decoded:
        decoding = 2 * largest
    need = corpus_need(largest, kept, decoding)
    if need <= available:
        return
    fits = min(room - 2 * largest, room // 2) if decoding <= room else 0
    allowed = (f"data.max_bytes={fits // (1 << 20) << 20} (or less), or more memory" if fits >= 1 << 20 else
               "the text split into smaller files (each file is read whole, one at a time), or more memory")
    where = sizes[0][1] if len(sizes) == 1 else sizes[0][1].parent
    count = f"{len(files)} files, the largest {_size(largest)}" if len(files) > 1 else "one file"
    raise DataError(
        f"data.path={where}: reading {_size(total)} of text ({count}) and keeping {_size(kept)} needs about "
        f"{_size(need)}, more than the {_size(available)} this machine has available (data.max_bytes={max_bytes}); "
        f"allowed: {allowed}")


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.0f} MiB"


def check_tokens_fit(count: int, available: Optional[int]) -> None:
    """Several token files are concatenated into one tensor of `count` uint16 tokens (one file stays
    memory-mapped): DataError if that copy cannot fit in `available` bytes."""
    need = 2 * count
    if available is None or need <= available / SLACK:
        return
    fits = int(available / SLACK) // (1 << 20) << 20
    raise DataError(f"data.max_bytes: joining the token files into one split needs {_size(need)}, more than the "
                    f"{_size(available)} this machine has available; allowed: data.max_bytes={fits} (or less)")
