"""One read of softmax attention over depth, the operation every AttnRes variant is built from:

    h = Σ_i α_i v_i,    α = normalise_i( q · RMSNorm(v_i) )

Keys are RMS-normalised, values are mixed raw; no 1/sqrt(d), no temperature. Because
RMSNorm(v)·w = (g ∘ w)·v / rms(v), a reader's key-norm gain g folds into its query, and 1/rms(v)
belongs to the source alone (shared by all its readers).

Two levels: `read` is the op, R readers over the same sources on the kernel set the caller's plan
names (`attnres.kernels.plan`), the fused kernels or the formula written out here (any derivative
order); `depth_read` is the public form of one read, which decides the kernel set itself. A
read's `state` continues a running read with more sources: phase two of the two-phase schedule
(docs/MATH.md), whose phase one is a `read` of several static readers at once.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from . import kernels
from .config import divisors, positive_int
from .kernels import fused_read

NORMALISERS = ("softmax", "sigmoid")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type sums are accumulated in: fp32 for half types, the type itself otherwise."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def inv_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """1/rms over the channels, (..., 1) in v's type; the sum of squares in fp32 at least (in fp16
    it overflows once rms(v)·sqrt(d) passes 256, which would make every read a plain mean)."""
    norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=acc_dtype(v.dtype))
    return torch.rsqrt(norm.square() / v.shape[-1] + eps).to(v.dtype)


def logits(scores: torch.Tensor, normaliser: str) -> torch.Tensor:
    """What the softmax over sources takes. "sigmoid" is renormalised, σ(s_i)/Σ_j σ(s_j) =
    softmax_i(log σ(s_i)): weights stay a convex combination, zero queries still give the plain
    mean, so that ablation changes the nonlinearity alone."""
    return scores if normaliser == "softmax" else F.logsigmoid(scores)


def result_type(sources: Sequence[torch.Tensor]) -> torch.dtype:
    """The type of a read's output: the sources' common type, as the reference's stack promotes them."""
    return functools.reduce(torch.promote_types, (s.dtype for s in sources))


def read(queries: torch.Tensor, sources: Sequence[torch.Tensor], state=None, *, kernel: str, per_token: bool = False,
         key_norm: bool = True, eps: float = 1e-6, normaliser: str = "softmax", heads: int = 1,
         out_dtype: Optional[torch.dtype] = None, with_lse: bool = False, with_weights: bool = False):
    """R readers over `sources` (each (..., d)): queries (R, d) static, key-norm gains folded in, or
    (..., d) per token (R = 1). state: (out (..., d), lse (..., H)), one reader's running read to
    continue. Returns the R outputs (..., d) in out_dtype (None: the sources' common type), their
    log-sum-exps (..., H) if with_lse, their weights (..., H, n) if with_weights (reference only)."""
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    dtype = out_dtype or result_type([*sources, *(state[:1] if state is not None else [])])
    if kernel == "torch":
        return _reference(queries, sources, state, per_token, key_norm, eps, normaliser, heads, dtype, with_lse,
                          with_weights)
    # one type: the sublayers' (under autocast the embedding is fp32), widened to fp32 for the C kernels
    kind = acc_dtype(sources[-1].dtype) if kernel == "c" else sources[-1].dtype
    flat = [s if s.dim() == 2 and s.dtype == kind and s.is_contiguous() else s.reshape(-1, d).to(kind).contiguous()
            for s in sources]  # rows already (the residuals' sources): no view, no autograd node per read
    q = queries if queries.dim() == 2 and queries.is_contiguous() else queries.reshape(-1, d).contiguous()
    init_out, init_lse = (None, None) if state is None else (state[0].reshape(-1, d).contiguous(),
                                                             state[1].reshape(1, -1, heads).contiguous())
    cfg = (heads, normaliser == "sigmoid", key_norm, eps, per_token, dtype)
    if torch.compiler.is_compiling():
        out, lse, _ = fused_read.depth_read_op(flat, q, init_out, init_lse, *cfg, kernel)
        outs = out.unbind(0)
    else:
        *outs, lse = fused_read.Read.apply(q, init_out, init_lse, (kernel, *cfg), *flat)
    if len(lead) > 1:
        outs = [o.view(*lead, d) for o in outs]
    return list(outs), ([s.view(*lead, heads) for s in lse.unbind(0)] if with_lse else None), None


def _reference(queries, sources, state, per_token, key_norm, eps, normaliser, heads, dtype, with_lse, with_weights):
    """`read` written out in torch: stack the sources, normalise the keys, one softmax per reader."""
    d = sources[0].shape[-1]
    V = torch.stack(list(sources), dim=-2)  # (..., n, d)
    K = V * inv_rms(V, eps) if key_norm else V
    if state is not None:  # the running read is one more source, whose logit is its log-sum-exp
        V = torch.cat([state[0].unsqueeze(-2), V.to(dtype)], -2)
    outs, lses, weights = [], [], []
    for q in [queries] if per_token else queries:
        t = logits((K * q.unsqueeze(-2)).unflatten(-1, (heads, d // heads)).sum(-1), normaliser)  # (..., n, H)
        if state is not None:
            t = torch.cat([state[1].unsqueeze(-2).to(t.dtype), t], -2)
        alpha = torch.softmax(t, dim=-2)
        outs.append((alpha.unsqueeze(-1) * V.unflatten(-1, (heads, d // heads))).sum(-3).flatten(-2).to(dtype))
        if with_lse:
            lses.append(torch.logsumexp(t, dim=-2))
        if with_weights:
            weights.append(alpha.transpose(-1, -2)[..., 0 if state is None else 1 :])
    return outs, (lses if with_lse else None), (weights if with_weights else None)


def depth_read(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    key_gain: Optional[torch.Tensor] = None,
    *,
    key_norm: bool = True,
    eps: float = 1e-6,
    normaliser: str = "softmax",
    heads: int = 1,
    state: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    return_state: bool = False,
    return_weights: bool = False,
):
    """Read `sources` (each (..., d)) with `query` ((d,) static or (..., d) per token).

    key_gain (d,): the reader's key-norm gain (None: ones). heads > 1 splits the channels into
    groups, each with its own normalisation over the sources (one rms per source over all d).
    state: (out, lse), a running read of this reader continued by these sources (two-phase);
    return_state adds this read's log-sum-exp (..., heads). Returns h (..., d) in the sources'
    common type, then, if asked, the weights (..., heads, n) and the log-sum-exp.
    """
    d = sources[0].shape[-1]
    if positive_int("heads", heads, "channel groups with their own softmax over depth") and d % heads:
        raise ValueError(f"heads={heads} must divide d_model={d}; allowed: {divisors(d, most=64)}")
    if normaliser not in NORMALISERS:
        raise ValueError(f"normaliser={normaliser!r} is not known; allowed: {', '.join(NORMALISERS)}")
    q = query * key_gain if key_gain is not None and key_norm else query
    per_token = q.dim() > 1
    kernel = "torch" if return_weights else kernels.path(*sources, q)
    outs, lse, weights = read(q if per_token else q.reshape(1, -1), sources, state, kernel=kernel, per_token=per_token,
                              key_norm=key_norm, eps=eps, normaliser=normaliser, heads=heads, with_lse=return_state,
                              with_weights=return_weights)
    out = [outs[0], *(weights if return_weights else []), *(lse if return_state else [])]
    return tuple(out) if len(out) > 1 else out[0]
