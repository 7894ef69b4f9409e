"""The two sublayers of a Transformer block, each a function h -> f(h) with its own PreNorm.

A sublayer never adds its input back: the residual module decides how outputs are combined.
This is what lets one model carry every residual variant of the paper.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config import ModelConfig
from .kernels import rms_norm

_ROPE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


@torch.compiler.assume_constant_result
def rope_tables(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding tables (Su et al. 2021) for `apply_rope`, cached per shape and
    device: cos over both halves of a head, and sin with its first half negated, each
    (seq_len, 1, head_dim) so that they broadcast over the heads of a (B, T, H, head_dim) tensor.

    Computed in float64 then cast, so that float64 tests see exact rotations too. Under
    torch.compile they are constants of the graph (`assume_constant_result`): a lookup in the
    graph made Dynamo guard on the cache's contents (the step that filled it made the next one
    recompile), and a computation in the graph was fused into the rotation, float64 sin and cos
    for every element of q and k (on an H200, 8.7 ms of a 125 ms 194m step).
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
    tables: the same values bit for bit as the pairwise form, in four ops instead of eight. On a
    CPU at d_model 64 the op count, not the arithmetic, set the rotation's cost (5% of a training
    step, benchmarks/RESULTS.md). x: (B, T, H, head_dim), contiguous (before the heads are moved
    forward for attention: elementwise ops on the transposed view were slower)."""
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
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k, v = self.kv_proj(x).view(B, T, 2, self.n_kv_heads, self.head_dim).unbind(2)
        # One table of max_seq_len rows, sliced (row t does not depend on the table's length): a
        # table per length made torch.compile specialise on T and recompile for every new length.
        rows = self.max_seq_len if T <= self.max_seq_len else T
        cos, sin = rope_tables(rows, self.head_dim, self.rope_theta, x.device, x.dtype)
        # narrow, not [:T]: compiled, the tables are graph constants, and [:T] of one specialised on T.
        cos, sin = cos.narrow(0, 0, T), sin.narrow(0, 0, T)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1))


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
    """f(h) = op(RMSNorm(h)): one attention or one MLP with its own PreNorm (PAPER.md, vocabulary)."""

    def __init__(self, kind: str, cfg: ModelConfig):
        super().__init__()
        self.kind = kind  # "attn" or "mlp": the analysis draws the two kinds of rows apart
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.op = CausalSelfAttention(cfg) if kind == "attn" else SwiGLU(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.op(self.norm(h))
