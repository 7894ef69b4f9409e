"""Keep freed memory in the process (glibc malloc), so that a CPU training step does not fault
its pages in again every step.

Why: a training step allocates and frees the same tensors every step. By default glibc serves a
block above its mmap threshold with fresh pages from the kernel, and hands the top of its heap
back once more than its trim threshold lies free there; either way the next step touches new
pages, one page fault per 4 KiB. The thresholds adapt to the largest block freed so far, which
keeps a plain Transformer's steps fault-free after warm-up, but Block AttnRes's many small reads
kept faulting pages in every CPU step. Raising both thresholds keeps freed blocks for reuse, as
jemalloc and tcmalloc do; the cost is that the process keeps its peak heap, which a training loop
reaches every step anyway.

Only glibc has these settings; elsewhere (macOS, musl) this does nothing and says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (malloc.h). glibc caps the mmap threshold at 32 MiB on 64-bit machines
# (DEFAULT_MMAP_THRESHOLD_MAX): larger blocks still come from mmap, as they should.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def _glibc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds so that freed tensors stay in the process for the next
    step (see the module docstring). Returns whether it took effect. Process-wide and one-way:
    glibc has no call that gives back its adaptive thresholds, so in a multirun that runs its jobs
    in one process, a later job with train.keep_freed_memory=false keeps the setting."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
