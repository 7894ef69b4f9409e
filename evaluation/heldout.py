"""Held-out loss and bits per byte on a run's validation split.

Design decisions:
- The windows are `harness.data.val_batches`: fixed, contiguous, non-overlapping windows on the
  seq_len grid, spread evenly over the split. With training's batch size and batch count
  (`--as-training`) they are exactly the set behind training's `val/loss`; by default the whole
  split is scored, the better estimate for comparing runs and variants.
- Loss is the mean over every predicted token (sum / count, not a mean of batch means, so a
  smaller last batch is not over-weighted). Bits per byte = total nats / ln 2 / total bytes of the
  predicted tokens, with each token's byte length from the tokenizer: for the byte-level
  vocabulary it is loss / ln 2; for GPT-2 it makes models with different tokenizers comparable.
- Computed in float32 without autocast: evaluation numbers should not depend on the device.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


@torch.no_grad()
def heldout_metrics(
    model,
    val_tokens: torch.Tensor,
    seq_len: int,
    tokenizer=None,
    batch_size: int = 16,
    max_batches: Optional[int] = None,
) -> dict[str, float]:
    """{"loss", "perplexity", "bits_per_byte" (when the tokenizer is known), "tokens"}."""
    from harness.data import val_batches

    device = next(model.parameters()).device
    byte_len = None
    if tokenizer is not None:
        byte_len = torch.tensor(
            [len(tokenizer.token_bytes(i)) for i in range(model.config.vocab_size)], dtype=torch.float64, device=device
        )
    was_training = model.training
    model.eval()
    nats, count, n_bytes = 0.0, 0, 0.0
    try:
        for x, y in val_batches(val_tokens, batch_size, seq_len, max_batches=max_batches):
            x, y = x.to(device), y.to(device)
            logits, _ = model(x)
            nats += float(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum"))
            count += y.numel()
            if byte_len is not None:
                n_bytes += float(byte_len[y].sum())
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("the validation split gave no batch (max_batches=0?)")
    out = {"loss": nats / count, "perplexity": math.exp(min(nats / count, 700.0)), "tokens": float(count)}
    if byte_len is not None and n_bytes > 0:
        out["bits_per_byte"] = nats / math.log(2) / n_bytes
    return out
