"""The two sublayers of a Transformer block, each a function h -> f(h) with its own PreNorm.

A sublayer never adds its input back: the residual module decides how outputs are combined.
This is what lets one model carry every residual variant of the paper.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config import ModelConfig, positive_int
from .kernels import rms_norm

_ROPE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


@torch.compiler.assume_constant_result
def rope_tables(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding tables (Su et al. 2021) for `apply_rope`, cached per shape and
    device: cos over both halves of a head, and sin with its first half negated, each
    (seq_len, 1, head_dim) so that they broadcast over the heads of a (B, T, H, head_dim) tensor.
    Computed in float64 then cast, so that float64 tests see exact rotations too; constants of a
    compiled graph (`assume_constant_result`), so Dynamo neither guards on the cache nor recomputes them.
    """
    key = (seq_len, head_dim, theta, str(device), dtype)
    if key not in _ROPE_CACHE:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        _ROPE_CACHE[key] = (torch.cat((cos, cos), -1)[:, None].to(dtype), torch.cat((-sin, sin), -1)[:, None].to(dtype))
    return _ROPE_CACHE[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1, x2) of the two halves of each head (the GPT-NeoX / Llama layout),
    (x1·cos − x2·sin, x2·cos + x1·sin), written as x·cos + (x2, x1)·sin with `rope_tables`' signed
    tables: the same values bit for bit as the pairwise form, in four ops instead of eight (at small
    widths the op count sets the cost). x: (B, T, H, head_dim), contiguous (before the heads are
    moved forward for attention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


class RMSNorm(nn.RMSNorm):
    """torch.nn.RMSNorm (same parameters, state dict and math) on one C kernel each way where
    `kernels.path` says the C kernels serve. Every variant's sublayers and final norm use it, the
    baseline's too, so no ratio between variants rests on one having a faster norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tensors = (x,) if self.weight is None else (x, self.weight)
        if len(self.normalized_shape) == 1 and kernels.path(*tensors, traceable=False) == "c":
            return rms_norm.rms_norm(x, self.weight, torch.finfo(x.dtype).eps if self.eps is None else self.eps)
        return super().forward(x)


class CausalSelfAttention(nn.Module):
    """Grouped-query causal attention through `F.scaled_dot_product_attention`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.rope_theta, self.max_seq_len = cfg.rope_theta, cfg.max_seq_len
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=cfg.qkv_bias)
        # k and v fused: with qkv_bias its bias is (k's bias, v's bias), as the weight's rows are
        self.kv_proj = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)
        # one weight of head_dim shared by every head; absent unless asked, so the state dict is as before
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.eps("prenorm")) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.eps("prenorm")) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cache: Optional["KVCache"] = None, slot: int = 0) -> torch.Tensor:
        """Causal attention over x (B, T, d); with a cache, x holds the T tokens that follow the
        cache's `length` cached positions: their keys and values go into `slot` of the cache and
        the queries attend over everything cached so far."""
        B, T, _ = x.shape
        start = 0 if cache is None else cache.length
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k, v = self.kv_proj(x).view(B, T, 2, self.n_kv_heads, self.head_dim).unbind(2)
        if self.q_norm is not None:  # per head, before the rotation (Qwen3's order)
            q, k = self.q_norm(q), self.k_norm(k)
        # One table of max_seq_len rows, sliced (row t does not depend on the table's length), so a
        # compiled model does not specialise on T.
        rows = self.max_seq_len if start + T <= self.max_seq_len else start + T
        cos, sin = rope_tables(rows, self.head_dim, self.rope_theta, x.device, x.dtype)
        # narrow, not [:T]: compiled, the tables are graph constants, and [:T] of one specialised on T.
        cos, sin = cos.narrow(0, start, T), sin.narrow(0, start, T)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask, causal = None, True
        if cache is not None:
            k, v = cache.update(slot, k, v)
            # query i sits at position start + i and sees keys 0..start + i; one query sees them all
            causal = start == 0
            if not causal and T > 1:
                mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1))


class KVCache:
    """Keys and values of every attention layer for `batch` sequences of up to `max_len` positions,
    for token-by-token decoding (`DecoderLM.kv_cache`, `DecoderLM.forward(idx, cache=...)`).

    `length` positions are cached; a forward with a cache writes its T tokens' keys and values at
    positions length..length+T−1 of each layer and the model then advances `length` by T, so a
    forward that fails leaves `length` as it was. The buffers are made on first write, in the
    keys' type and device (under autocast, the half type the attention computes in).
    The residual stream needs no cache: every depth read mixes one position's own sources.
    """

    def __init__(self, layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int):
        positive_int("kv_cache batch", batch, "sequences the cache holds")
        positive_int("kv_cache max_len", max_len, "positions the cache holds")
        self.batch, self.max_len, self.length = batch, max_len, 0
        self.shape = (batch, n_kv_heads, max_len, head_dim)
        self.keys: list[Optional[torch.Tensor]] = [None] * layers
        self.values: list[Optional[torch.Tensor]] = [None] * layers

    def check(self, batch: int, new: int) -> None:
        """One ValueError when `new` more tokens of `batch` sequences do not fit."""
        if batch != self.batch:
            raise ValueError(f"the KV cache holds batch={self.batch} sequences, the input has {batch}")
        if self.length + new > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} cached + {new} new positions > max_len={self.max_len}; "
                             "make the cache with a larger max_len (DecoderLM.kv_cache(batch, max_len))")

    def update(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H_kv, T, head_dim) at the next T positions of layer `slot`; return the
        layer's keys and values over every position so far."""
        held = self.keys[slot]
        if held is not None and (held.dtype, held.device) != (k.dtype, k.device) and self.length:
            raise ValueError(f"the KV cache holds {self.length} positions as {held.dtype} on {held.device}; this forward "
                             f"makes {k.dtype} on {k.device}: decode in one dtype and device, or reset() the cache")
        if held is None or (held.dtype, held.device) != (k.dtype, k.device):
            self.keys[slot] = k.new_zeros(self.shape)
            self.values[slot] = v.new_zeros(self.shape)
        end = self.length + k.shape[2]
        self.keys[slot][:, :, self.length : end] = k
        self.values[slot][:, :, self.length : end] = v
        return self.keys[slot][:, :, :end], self.values[slot][:, :, :end]

    def reset(self) -> None:
        """Forget every cached position (the buffers stay, to be overwritten)."""
        self.length = 0


class SwiGLU(nn.Module):
    """MLP of Shazeer (2020): down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Sublayer(nn.Module):
    """f(h) = op(RMSNorm(h)): one attention or one MLP with its own PreNorm (docs/MATH.md, vocabulary)."""

    def __init__(self, kind: str, cfg: ModelConfig):
        super().__init__()
        self.kind = kind  # "attn" or "mlp": the analysis draws the two kinds of rows apart
        self.norm = RMSNorm(cfg.d_model, eps=cfg.eps("prenorm"))
        self.op = CausalSelfAttention(cfg) if kind == "attn" else SwiGLU(cfg)

    def forward(self, h: torch.Tensor, cache: Optional[KVCache] = None, slot: int = 0) -> torch.Tensor:
        x = self.norm(h)
        return self.op(x) if cache is None else self.op(x, cache, slot)
