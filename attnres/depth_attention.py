"""One read of softmax attention over depth: the operation every AttnRes variant is built from.

    h = Σ_i α_i v_i,   α = softmax_i( w · RMSNorm(v_i) )          (PAPER.md, Full AttnRes)

Keys are normalised, values are mixed raw; no 1/sqrt(d), no temperature. Because
RMSNorm(v)·w = (g ∘ w)·v / rms(v), the key-norm gain g and the query w fold into one vector
`q = g ∘ w`, and 1/rms(v) is a property of the source alone, shared by all its readers. The
residual modules use exactly that factorisation; `depth_read` below states the formula plainly
(stack, normalise, score, normalise over sources, mix) and is the reference the tests and the
kernels are checked against.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

NORMALISERS = ("softmax", "sigmoid")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type sums are accumulated in: fp32 for half types, the type itself otherwise."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def inv_rms_acc(v: torch.Tensor, eps: float) -> torch.Tensor:
    """1/rms over the channel dimension, (..., 1), in the accumulation type of v.

    Through the 2-norm (one reduction, no squared copy of v: this runs once per source). The
    sum of squares is taken in fp32 at least: in fp16 it overflows (65504) once rms(v)·sqrt(d)
    passes 256, which would make 1/rms zero and every read a plain mean."""
    norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=acc_dtype(v.dtype))
    return torch.rsqrt(norm.square() / v.shape[-1] + eps)


def inv_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """1/rms over the channel dimension, kept as (..., 1) so it broadcasts over channels, in v's type."""
    return inv_rms_acc(v, eps).to(v.dtype)


def normalise_scores(scores: torch.Tensor, normaliser: str, dim: int = -1) -> torch.Tensor:
    """Turn depth scores into mixing weights over `dim` (the source axis).

    "sigmoid" is the paper's ablation (sigmoid instead of softmax). The paper does not say
    whether the weights are renormalised; we renormalise, σ(s_i)/Σ_j σ(s_j), so that the output
    stays a convex combination of sources like the softmax's (bounded hidden states are the
    point of AttnRes) and zero queries give the same plain mean: the ablation then isolates the
    shape of the nonlinearity alone (a sigmoid saturates, so one source can never take it all).
    Computed as softmax(log σ(s)), the same weights: σ(s)/Σσ would be 0/0 where every score of a
    token is below about −100 (σ underflows in fp32), and this is what the kernels and the
    two-phase schedule compute, so the paths agree there too.
    """
    if normaliser == "softmax":
        return torch.softmax(scores, dim=dim)
    if normaliser == "sigmoid":
        return torch.softmax(torch.nn.functional.logsigmoid(scores), dim=dim)
    raise ValueError(f"normaliser={normaliser!r} is not known; allowed: {', '.join(NORMALISERS)}")


def depth_read(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    key_gain: Optional[torch.Tensor] = None,
    *,
    key_norm: bool = True,
    eps: float = 1e-6,
    normaliser: str = "softmax",
    heads: int = 1,
    return_weights: bool = False,
):
    """Reference read of `sources` (each (..., d)) by `query` ((d,) static or (..., d) per token).

    key_gain (d,) is the RMSNorm gain of this reader's key norm (None: ones). With `heads` > 1 the
    channels split into that many groups, each with its own normalisation over sources; the key
    norm still uses the rms over all d channels (one rms per source, shared by every group).
    Returns h (..., d) and, if asked, the weights (..., heads, n_sources).
    """
    V = torch.stack(list(sources), dim=-2)  # (..., n, d)
    d = V.shape[-1]
    if heads < 1 or d % heads:
        raise ValueError(f"heads={heads} must be a positive divisor of d_model={d}")
    K = V * inv_rms(V, eps) if key_norm else V
    if key_gain is not None and key_norm:
        K = K * key_gain
    q = query.unsqueeze(-2)  # (..., 1, d): broadcasts over sources
    scores = (K * q).unflatten(-1, (heads, d // heads)).sum(-1)  # (..., n, heads)
    alpha = normalise_scores(scores, normaliser, dim=-2)  # over sources
    h = (alpha.unsqueeze(-1) * V.unflatten(-1, (heads, d // heads))).sum(-3).flatten(-2)
    if return_weights:
        return h, alpha.transpose(-1, -2)
    return h
