"""Held-out loss and bits per byte on a run's validation split, in float32 without autocast.

The windows are training's `harness.data.val_batches` (with `--as-training`, exactly the set
behind `val/loss`; by default the whole split). Bits per byte divide the nats by each predicted
token's byte length, so models with different tokenizers compare.
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

    # Data of another tokenizer (`--data` naming GPT-2 shards for a byte model) failed deep in the
    # embedding ("index out of range in self"); said here, naming both vocabularies.
    top = int(val_tokens.numpy().max() if val_tokens.dtype == torch.uint16 else val_tokens.max()) if val_tokens.numel() else 0
    if top >= model.config.vocab_size:
        raise ValueError(f"the validation split holds token {top}, beyond the model's vocabulary of "
                         f"{model.config.vocab_size} (model.vocab_size): data of another tokenizer; allowed: the "
                         "data the model was trained on, or its tokenizer's")
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
            # Summed over tokens, not a mean of batch means, so a short last batch is not over-weighted.
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
