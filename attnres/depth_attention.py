"""One read of softmax attention over depth, the operation every AttnRes variant is built from:

    h = Σ_i α_i v_i,    α = normalise_i( q · RMSNorm(v_i) )

Keys are RMS-normalised, values are mixed raw; no 1/sqrt(d), no temperature. Because
RMSNorm(v)·w = (g ∘ w)·v / rms(v), a reader's key-norm gain g folds into its query, and 1/rms(v)
belongs to the source alone (shared by all its readers).

`depth_read` is the one entry point: the fused kernels where `attnres.kernels.path` says they
serve these tensors, else the formula written out in it (any derivative order). Its `state`
argument and `read_chunk` are the two phases of the two-phase schedule (docs/MATH.md): several
static readers over the same sources at once, then each reader's read continued with more sources.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from . import kernels
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
    if normaliser == "softmax":
        return scores
    if normaliser == "sigmoid":
        return F.logsigmoid(scores)
    raise ValueError(f"normaliser={normaliser!r} is not known; allowed: {', '.join(NORMALISERS)}")


def _fused(query, sources) -> bool:
    return kernels.path(*sources, query) != "torch"


def _flat(sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """(N, d) rows, contiguous, of one type (under autocast the embedding is fp32 and the
    sublayers' outputs half: the kernels read the sublayers' type)."""
    dtype = sources[-1].dtype
    return [s.reshape(-1, s.shape[-1]).to(dtype).contiguous() for s in sources]


def _result_type(sources: Sequence[torch.Tensor]) -> torch.dtype:
    """The type of a read's output: the sources' common type, as the reference's stack promotes them."""
    return functools.reduce(torch.promote_types, (s.dtype for s in sources))


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
    if heads < 1 or d % heads:
        raise ValueError(f"heads={heads} must be a positive divisor of d_model={d}")
    logits(query.new_zeros(()), normaliser)  # an unknown normaliser fails here, on every path
    q = query * key_gain if key_gain is not None and key_norm else query
    dtype = _result_type([*sources, *(state[:1] if state is not None else [])])
    if not return_weights and _fused(q, sources):
        lead = sources[0].shape[:-1]
        per_token = q.dim() > 1
        init = None if state is None else (state[0].reshape(-1, d).contiguous(), state[1].reshape(1, -1, heads).contiguous())
        outs, lse = fused_read.read(_flat(sources), q.reshape(-1 if per_token else 1, d).contiguous(), init, heads=heads,
                                    sigmoid=normaliser == "sigmoid", key_norm=key_norm, eps=eps, per_token=per_token,
                                    out_dtype=dtype)
        h = outs[0].view(*lead, d)
        return (h, lse[0].view(*lead, heads)) if return_state else h
    V = torch.stack(list(sources), dim=-2)  # (..., n, d)
    K = V * inv_rms(V, eps) if key_norm else V
    t = logits((K * q.unsqueeze(-2)).unflatten(-1, (heads, d // heads)).sum(-1), normaliser)  # (..., n, H)
    if state is not None:  # the running read is one more source, whose logit is its log-sum-exp
        t = torch.cat([state[1].unsqueeze(-2).to(t.dtype), t], -2)
        V = torch.cat([state[0].unsqueeze(-2), V.to(dtype)], -2)
    alpha = torch.softmax(t, dim=-2)
    h = (alpha.unsqueeze(-1) * V.unflatten(-1, (heads, d // heads))).sum(-3).flatten(-2).to(dtype)
    out = [h]
    if return_weights:
        out.append(alpha.transpose(-1, -2)[..., 0 if state is None else 1 :])
    if return_state:
        out.append(torch.logsumexp(t, dim=-2))
    return tuple(out) if len(out) > 1 else h


def read_chunk(queries: torch.Tensor, sources: Sequence[torch.Tensor], *, key_norm=True, eps=1e-6,
               normaliser="softmax", heads=1):
    """Phase one of the two-phase schedule: R static readers (queries (R, d), gains folded in) over
    the same sources at once. Returns each reader's output (R tensors (..., d), in the
    accumulation type) and log-sum-exp (R tensors (..., H)): the `state` its later reads continue."""
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    opts = dict(key_norm=key_norm, eps=eps, normaliser=normaliser, heads=heads)
    if _fused(queries, sources):
        outs, lse = fused_read.read(_flat(sources), queries.contiguous(), heads=heads, sigmoid=normaliser == "sigmoid",
                                    key_norm=key_norm, eps=eps, out_dtype=acc_dtype(sources[-1].dtype))
        return [o.view(*lead, d) for o in outs], [s.view(*lead, heads) for s in lse.unbind(0)]
    reads = [depth_read(q, sources, return_state=True, **opts) for q in queries]
    return [h for h, _ in reads], [lse for _, lse in reads]
