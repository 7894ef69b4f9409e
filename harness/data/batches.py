"""Turning a 1-D token tensor into (input, target) batches for training and for validation.

Batch i of training is a pure function of (tokens, seed, i), so a resumed run, or one spread over
any number of ranks, sees exactly the sequences of one uninterrupted process; validation is a
fixed set of non-overlapping windows spread over the split. Batches are int64 on the CPU.
"""
from __future__ import annotations

from typing import Iterator, Optional

import numpy as np
import torch

from .datatypes import DataError

Batch = tuple[torch.Tensor, torch.Tensor]


def _windows(tokens: torch.Tensor, starts: np.ndarray, seq_len: int) -> Batch:
    index = starts[:, None] + np.arange(seq_len + 1)[None, :]
    # The gather runs in numpy: it reads only the rows needed (a memory-mapped shard is not read
    # whole), handles uint16, and stays single-threaded, so the data path never competes with the
    # model for torch's intra-op threads.
    if tokens.device.type != "cpu":  # tokens already on an accelerator: gather there
        w = tokens[torch.from_numpy(index).to(tokens.device)].long()
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()
    w = tokens.numpy()[index].astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(w[:, :-1])), torch.from_numpy(np.ascontiguousarray(w[:, 1:]))


def _check(tokens: torch.Tensor, batch_size: int, seq_len: int) -> int:
    if tokens.dim() != 1:
        raise DataError(f"token tensor must be 1-D, got shape {tuple(tokens.shape)}")
    if batch_size < 1 or seq_len < 1:
        raise DataError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    n = tokens.numel()
    if n < seq_len + 1:
        raise DataError(f"sequence longer than the data: {n} tokens, but seq_len+1 = {seq_len + 1} are needed")
    return n


def batch_iterator(
    tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, start_batch: int = 0, aligned: bool = False
) -> Iterator[Batch]:
    """Endless deterministic (x, y) int64 batches of shape (batch_size, seq_len), from batch
    `start_batch` on; `aligned`: windows start at multiples of seq_len only."""
    n = _check(tokens, batch_size, seq_len)
    if start_batch < 0:
        raise DataError(f"start_batch={start_batch}: must be >= 0")
    i = start_batch
    while True:
        yield _windows(tokens, _batch_starts(n, batch_size, seq_len, seed, i, aligned), seq_len)
        i += 1


def _batch_starts(n: int, batch_size: int, seq_len: int, seed: int, i: int, aligned: bool = False) -> np.ndarray:
    """Window starts of batch i: the one definition of the training stream."""
    # Seeded by the pair, not seed·K + i, so different seeds never share a batch.
    rng = np.random.default_rng([seed % 2**64, i])
    if aligned:  # the j-th window of seq_len, j < (n - 1) // seq_len so that its target fits
        return rng.integers(0, (n - 1) // seq_len, size=batch_size) * seq_len
    return rng.integers(0, n - seq_len, size=batch_size)  # last start: n - seq_len - 1


def rank_batch_iterator(
    tokens: torch.Tensor, batch_size: int, stream_batch_size: int, micro_batch_size: int, seq_len: int,
    seed: int, rank: int, world_size: int, start_step: int = 0, aligned: bool = False,
) -> Iterator[Batch]:
    """Rank `rank`'s micro-batches of every optimizer step from `start_step` on.

    A step's global batch is `batch_size` sequences: batches step·k .. step·k + k-1 of
    `batch_iterator(tokens, stream_batch_size, ...)` (k = batch_size / stream_batch_size), which
    is what one process trains on. Rank r takes sequences [r·P, (r+1)·P) of it (P = batch_size /
    world_size), in micro-batches of `micro_batch_size`: P / micro_batch_size of them per step.
    Only the windows of the slice are gathered; the starts of the batches it spans are drawn
    (a few integers each)."""
    n = _check(tokens, micro_batch_size, seq_len)
    per_rank = batch_size // world_size
    if batch_size % world_size or batch_size % stream_batch_size or per_rank % micro_batch_size:
        raise DataError(f"rank batch: batch_size={batch_size} must divide over {world_size} ranks and into "
                        f"batches of {stream_batch_size}, its share ({per_rank}) into micro-batches of "
                        f"{micro_batch_size}")
    if not 0 <= rank < world_size or start_step < 0:
        raise DataError(f"rank batch: rank={rank} of {world_size}, start_step={start_step}")
    per_step = batch_size // stream_batch_size
    lo, hi = rank * per_rank, (rank + 1) * per_rank  # this rank's sequences in the global batch
    first, last = lo // stream_batch_size, (hi - 1) // stream_batch_size  # the stream batches they lie in
    offset = lo - first * stream_batch_size
    step = start_step
    while True:
        starts = np.concatenate([_batch_starts(n, stream_batch_size, seq_len, seed, step * per_step + k, aligned)
                                 for k in range(first, last + 1)])[offset : offset + per_rank]
        for j in range(0, per_rank, micro_batch_size):
            yield _windows(tokens, starts[j : j + micro_batch_size], seq_len)
        step += 1


def val_batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, max_batches: Optional[int] = None
) -> list[Batch]:
    """The fixed held-out set: non-overlapping windows, at most max_batches full batches (evenly
    spread over the split), or with max_batches None every window of the split, the last batch
    smaller if they do not fill it (the whole split: its loss does not depend on batch_size)."""
    n = _check(tokens, batch_size, seq_len)
    available = (n - 1) // seq_len
    wanted = available if max_batches is None else min(available, max_batches * batch_size)
    if wanted >= batch_size and max_batches is not None:
        wanted -= wanted % batch_size
    if wanted <= 0:  # max_batches=0: evaluation switched off
        return []
    # Evenly spread window indices (distinct because available >= wanted), so a capped evaluation
    # still sees every part of the held-out text.
    chosen = (np.arange(wanted, dtype=np.int64) * available) // wanted
    starts = chosen * seq_len
    return [
        _windows(tokens, starts[i : i + batch_size], seq_len) for i in range(0, wanted, batch_size)
    ]
