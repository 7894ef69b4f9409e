"""Training batches are deterministic and resumable; validation batches are fixed windows."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from harness.data import DataError, batch_iterator, val_batches, write_shard, read_shard


def _take(it, n):
    return list(itertools.islice(it, n))


@pytest.fixture
def tokens():
    return torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)


def test_batches_are_windows_of_the_data(tokens):
    x, y = next(batch_iterator(tokens, 8, 32, seed=1))
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    text = tokens.long()
    for row_x, row_y in zip(x, y):
        starts = [s for s in range(len(text) - 32) if torch.equal(text[s : s + 32], row_x)]
        assert starts and torch.equal(text[starts[0] + 1 : starts[0] + 33], row_y)


def test_batches_deterministic_for_a_seed(tokens):
    a = _take(batch_iterator(tokens, 4, 16, seed=7), 5)
    b = _take(batch_iterator(tokens, 4, 16, seed=7), 5)
    c = _take(batch_iterator(tokens, 4, 16, seed=8), 5)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))
    assert not torch.equal(a[0][0], a[1][0])  # consecutive batches differ


def test_start_batch_resumes_the_same_sequence(tokens):
    full = _take(batch_iterator(tokens, 4, 16, seed=3), 12)
    resumed = _take(batch_iterator(tokens, 4, 16, seed=3, start_batch=7), 5)
    for (x1, y1), (x2, y2) in zip(full[7:], resumed):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_windows_reach_the_end_but_not_beyond():
    tokens = torch.arange(11, dtype=torch.uint8)  # exactly one window of 10+1
    for x, y in _take(batch_iterator(tokens, 3, 10, seed=0), 3):
        assert torch.equal(x, torch.arange(10).expand(3, 10)) and torch.equal(y, torch.arange(1, 11).expand(3, 10))


def test_memory_mapped_uint16_tokens(tmp_path):
    write_shard(tmp_path / "s_train_000001.bin", np.arange(3000) % 50000)
    shard = read_shard(tmp_path / "s_train_000001.bin")
    x, y = next(batch_iterator(shard, 2, 64, seed=0))
    assert x.dtype == torch.int64 and torch.equal(y[:, 0], x[:, 1])
    vb = val_batches(shard, 2, 64, max_batches=3)
    assert len(vb) == 3 and vb[0][0].dtype == torch.int64


def test_sequence_longer_than_the_data():
    with pytest.raises(DataError, match="sequence longer than the data"):
        next(batch_iterator(torch.zeros(10, dtype=torch.uint8), 2, 10, seed=0))
    with pytest.raises(DataError, match="seq_len\\+1 = 11"):
        val_batches(torch.zeros(10, dtype=torch.uint8), 2, 10, max_batches=1)


def test_val_batches_fixed_contiguous_non_overlapping(tokens):
    T = 32
    batches = val_batches(tokens, 8, T, max_batches=4)
    assert len(batches) == 4 and all(x.shape == (8, T) for x, _ in batches)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, val_batches(tokens, 8, T, max_batches=4)))
    text = tokens.long()
    starts = []
    for x, y in batches:
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row in x:
            s = next(s for s in range(0, len(text) - T, T) if torch.equal(text[s : s + T], row))
            starts.append(s)
    assert len(set(starts)) == len(starts) == 32  # distinct windows on the seq_len grid
    assert max(starts) > len(text) // 2  # spread over the split, not only its start


def test_val_batches_all_and_small():
    tokens = torch.arange(1001) % 256
    everything = val_batches(tokens, 4, 10)  # 100 windows, 25 full batches
    assert len(everything) == 25
    windows = torch.cat([x for x, _ in everything])
    assert torch.equal(windows[:, 0], torch.arange(0, 1000, 10) % 256)
    rest = val_batches(tokens, 3, 10)  # the whole split: 33 batches of 3 and one of 1
    assert [len(x) for x, _ in rest] == [3] * 33 + [1]
    assert torch.equal(torch.cat([x for x, _ in rest]), windows)  # the same 100 windows at any batch size
    assert sum(len(x) for x, _ in val_batches(tokens, 3, 10, max_batches=40)) == 99  # full batches only
    small = val_batches(torch.arange(25), 8, 10)  # two windows: one smaller batch
    assert len(small) == 1 and small[0][0].shape == (2, 10)
    assert val_batches(tokens, 4, 10, max_batches=0) == []


def test_aligned_windows_start_at_multiples_of_the_sequence_length(tokens):
    """aligned=True draws only starts j·seq_len with the target window inside the data, and reaches
    the last one (5000 tokens, seq_len 32: starts 0 … 155·32)."""
    starts = set()
    for x, y in _take(batch_iterator(tokens, 64, 32, seed=4, aligned=True), 40):
        for row in x:
            s = next(s for s in range(0, 5000 - 32, 32) if torch.equal(tokens[s : s + 32].long(), row))
            starts.add(s)
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert starts <= set(range(0, 156 * 32, 32)) and 155 * 32 in starts and 0 in starts
