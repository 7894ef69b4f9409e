"""The data API's types: what a run asks for (DataConfig), what it gets (TokenData), how it fails.

DataConfig is a plain dataclass whose fields are all types OmegaConf accepts, so the harness can use
it unchanged as the Hydra structured-config node `data` (a misspelt key then fails at startup).
Every source reads the fields it needs and ignores the rest; the multihop fields are flat rather
than a nested node so that `data.hops=[1,2]` works on the command line like any other override.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

SOURCES: tuple[str, ...] = ("stdlib", "text", "shards", "nanogpt", "multihop")
LOSS_ON: tuple[str, ...] = ("all", "answers")  # data.loss_on: which targets the loss is taken on
FORMATS: tuple[str, ...] = ("assign", "compact")  # data.format: "x=3;" and "?x=", or "x3" and "?x" (multihop)


class DataError(ValueError):
    """Bad data or a data setting that cannot work. The message names the file (or the setting)
    and the problem, so a run stops with one readable line before any training starts."""


@dataclass
class DataConfig:
    name: str = "stdlib"  # one of SOURCES
    path: Optional[str] = None  # text: file or folder; shards / nanogpt: folder; stdlib: override of the stdlib root
    val_fraction: float = 0.05  # stdlib / text: share of files held out (a single file: the last bytes)
    max_bytes: Optional[int] = None  # cap on bytes read: (1 - val_fraction)·max_bytes train, the rest val
    vocab_size: int = 256  # byte-level by default; 50257 for GPT-2 BPE shards
    # --- multihop probe (data.name=multihop) ---
    hops: List[int] = field(default_factory=lambda: [1, 2, 3, 4])  # k values; k = assignments to follow
    n_vars: int = 12  # variables (= statements) per example, target chain plus distractor chains
    train_examples: int = 20000  # hop counts drawn uniformly from `hops`
    val_examples: int = 800  # split evenly over `hops`; also the examples MultiHopProbe.accuracy scores
    queries: int = 0  # extra queries after each example's answer ("?v=d" for other variables): recall practice
    seed: int = 0  # seed of the example generator (not of training)
    loss_on: str = "all"  # all tokens, or "answers": only each "?x=" query's digit (multihop)
    format: str = "assign"  # multihop statements "x=3;" and queries "?x=", or compact: "x3" and "?x"
    aligned: bool = False  # training windows start at multiples of train.seq_len (multihop: one example a row)


@dataclass
class TokenData:
    """Two 1-D token tensors and where they came from.

    Byte-level sources give uint8 tensors (every torch op works on them and they are 8× smaller
    than int64); shards give uint16 tensors backed by a memory map where possible. torch supports
    few ops on uint16, so consumers take windows through `batch_iterator` / `val_batches` (which
    return int64) or call `.long()` on a slice.
    """

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    fingerprint: Dict[str, Any]
