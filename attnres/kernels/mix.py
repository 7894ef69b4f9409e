"""The PyTorch path's two autograd steps, the CPU counterparts of the Triton kernels.

`mix(alpha, values)`: R readers mix n sources by given weights (phase 1 of the two-phase
schedule, or a whole read with R = 1):

    out_r[..., h, :] = Σ_i α[r, ..., h, i] · v_i[..., h, :]

`merge_read(o, lse, q, extras, alpha, sources, ...)`: phase 2: continue a phase-1 read (its
normalised output o = Σ_c α_c v_c and log-sum-exp lse) with k more sources u_k scored by the
query q (key norm inside), by online softmax:

    h = (e^lse·o + Σ_k e^{t_k}·u_k) / (e^lse + Σ_k e^{t_k})

Design decisions (measured on a 2-core CPU, where these reads are memory-bound):
- No stacking: sources are read in place. A stack copies every source on every read, and would be
  kept for backward (O(L²) activation memory for Full AttnRes).
- One autograd node per read, not two per source: plain autograd would materialise a product per
  source and, in backward, a full-size weight-gradient product per (read, source) pair.
- Each source's gradient is written once per `mix`, summed over its R readers, so the two-phase
  schedule allocates and accumulates one gradient per (chunk, source), not one per (read, source).
- `merge_read` keeps references and per-token scalars only, not o: its backward needs
  g·o = Σ_c α_c (g·v_c), and the dot products g·v_c it computes for that are, times the merge
  weight of o, exactly the gradient of the phase-1 weights α of its reader. So the merge returns
  that gradient, and `mix` computes weight gradients only for the readers without a merge
  (`alpha_grad_readers`): every (reader, source) dot product is computed once, and o never
  outlives the forward (Block AttnRes's activation memory stays at the per-read schedule's).
- Products for dot products go through one reused scratch buffer (`row_dot`): a fresh
  multi-megabyte temporary per dot (what `torch.linalg.vecdot` allocates) costs more than the dot.
- Gradients are returned as fresh base tensors, never views, so that autograd adds later
  contributions into them in place.
- Accumulation in fp32 for bf16/fp16 sources, in the sources' type otherwise (float64 stays exact).
Both are autograd.Functions of plain tensor ops, which torch.compile traces.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..depth_attention import acc_dtype, inv_rms_acc

# Rows per tile: bounds the scratch buffer of the backward (for very many tokens), and at the
# default sizes covers all tokens at once (smaller tiles measured slower: per-op overhead).
_TILE_BYTES = 1 << 23


def _tiles(N: int, row_bytes: int):
    step = max(32, _TILE_BYTES // max(1, row_bytes))
    if N <= step:
        # One tile without a loop: under torch.compile, range() over a symbolic N made Dynamo
        # specialise on it, so every new sequence length recompiled (and after 8, ran eager).
        return [slice(0, N)]
    return [slice(t, min(t + step, N)) for t in range(0, N, step)]


def row_dot(x: torch.Tensor, y: torch.Tensor, scratch: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Σ over the last dim of x·y (broadcast), the product going through a caller-owned scratch."""
    shape = torch.broadcast_shapes(x.shape, y.shape)
    prod = scratch.view(-1)[: math.prod(shape)].view(shape)
    torch.mul(x, y, out=prod)
    return torch.sum(prod, -1, out=out)


def _mix(alpha: torch.Tensor, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The forward of `mix`, in the accumulation type."""
    R, N, H, n = alpha.shape
    d = values[0].shape[-1]
    adt = acc_dtype(values[0].dtype)
    w = alpha.to(adt).permute(3, 1, 0, 2).contiguous().unsqueeze(-1)  # (n, N, R, H, 1)
    vs = [v.view(N, 1, H, -1) for v in values]
    # Reader 0's output has a storage of its own (it is the input of the chunk's first
    # sublayer, kept for backward); the others share one token-major buffer (N, R-1, d) that
    # dies with the chunk. Token-major, so that every tile below is contiguous.
    first = torch.empty(N, d, dtype=adt, device=alpha.device)
    rest = torch.empty(N, R - 1, d, dtype=adt, device=alpha.device) if R > 1 else None
    accs = [first.view(N, 1, H, -1)] + ([rest.view(N, R - 1, H, -1)] if R > 1 else [])
    spans = [slice(0, 1)] + ([slice(1, R)] if R > 1 else [])
    for sl in _tiles(N, R * d * torch.finfo(adt).bits // 8):
        for acc, rs in zip(accs, spans):
            a = acc[sl]
            torch.mul(w[0][sl, rs], vs[0][sl], out=a)
            for i in range(1, n):
                a.addcmul_(w[i][sl, rs], vs[i][sl])
    return [first] + (list(rest.unbind(1)) if R > 1 else [])


class _Mix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, alpha: torch.Tensor, out_dtype: torch.dtype, alpha_grad_readers: int, *values: torch.Tensor):
        ctx.alpha_grad_readers = alpha_grad_readers
        ctx.save_for_backward(alpha, *values)
        return tuple(o.to(out_dtype) for o in _mix(alpha, values))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        alpha, *values = ctx.saved_tensors
        R, N, H, n = alpha.shape
        d = values[0].shape[-1]
        adt = acc_dtype(values[0].dtype)
        w = alpha.to(adt).permute(3, 0, 1, 2).contiguous().unsqueeze(-1)  # (n, R, N, H, 1)
        present = [r for r in range(R) if grads[r] is not None]
        gs = {r: grads[r].to(adt).reshape(N, H, -1) for r in present}
        vs = [v.view(N, H, -1) for v in values]
        dots_for = [r for r in present if r < ctx.alpha_grad_readers] if ctx.needs_input_grad[0] else []
        d_alpha = alpha.new_zeros(n, R, N, H, dtype=adt) if ctx.needs_input_grad[0] else None
        d_values = [torch.empty(N, d, dtype=adt, device=alpha.device) if ctx.needs_input_grad[3 + i] else None for i in range(n)]
        tiles = _tiles(N, d * torch.finfo(adt).bits // 8)
        scratch = torch.empty((tiles[0].stop - tiles[0].start) * d, dtype=adt, device=alpha.device) if dots_for else None
        for sl in tiles:
            for i in range(n):
                vt = vs[i][sl]
                for r in dots_for:
                    row_dot(gs[r][sl], vt, scratch, out=d_alpha[i, r, sl])
                if d_values[i] is None:
                    continue
                out = d_values[i].view(N, H, -1)[sl]
                if not present:
                    out.zero_()
                    continue
                torch.mul(w[i][present[0], sl], gs[present[0]][sl], out=out)
                for r in present[1:]:
                    out.addcmul_(w[i][r, sl], gs[r][sl])
        d_alpha = d_alpha.permute(1, 2, 3, 0).to(alpha.dtype) if d_alpha is not None else None
        return (d_alpha, None, None, *[dv.to(v.dtype) if dv is not None else None for dv, v in zip(d_values, values)])


def mix(alpha: torch.Tensor, values: Sequence[torch.Tensor], out_dtype: torch.dtype, alpha_grad_readers: Optional[int] = None) -> tuple:
    """alpha (R, N, H, n), values n × (N, d) → R tensors (N, d) in out_dtype (reader 0's with a
    storage of its own). The weight gradient is computed here for readers < alpha_grad_readers
    (default: all); the others' comes from their `merge_read`."""
    if not torch.is_grad_enabled():  # no node to record (and see merge_read: Dynamo under no_grad)
        return tuple(o.to(out_dtype) for o in _mix(alpha, values))
    R = alpha.shape[0]
    return _Mix.apply(alpha, out_dtype, R if alpha_grad_readers is None else alpha_grad_readers, *values)


class _SourceScores(torch.autograd.Function):
    """s[n, h, r] = (v_h · Q_rh)[n] · ρ[n] for a completed source v (N, d) and R queries Q (R, d),
    ρ = 1/rms(v) (or 1): one matrix product for all the source's readers, and one gradient for v
    (the key path of all readers and the rms term together) instead of three."""

    @staticmethod
    def forward(ctx, v, Q, H, eps):
        N, d = v.shape
        R = Q.shape[0]
        Qv = Q.to(v.dtype)
        if H == 1:
            raw = (v @ Qv.t()).unsqueeze(1)  # (N, 1, R)
        else:
            raw = torch.bmm(v.view(N, H, -1).transpose(0, 1), Qv.view(R, H, -1).permute(1, 2, 0)).transpose(0, 1)
        rho = None
        if eps is not None:  # (N, 1), in fp32 for bf16/fp16 v: an fp16 sum of squares overflows
            rho = inv_rms_acc(v, eps)
        ctx.H, ctx.key_norm = H, eps is not None
        ctx.save_for_backward(v, Q, raw, *([rho] if rho is not None else []))
        return (raw * rho.unsqueeze(-1)).to(v.dtype) if rho is not None else raw.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        v, Q, raw, *rho = ctx.saved_tensors
        N, d = v.shape
        H, R = ctx.H, Q.shape[0]
        g = (grad * rho[0].unsqueeze(-1)).to(v.dtype) if ctx.key_norm else grad  # dL/draw (N, H, R)
        Qv = Q.to(v.dtype)
        if H == 1:
            dv = g.squeeze(1) @ Qv
            dQ = g.squeeze(1).t() @ v
        else:
            dv = torch.bmm(g.transpose(0, 1), Qv.view(R, H, -1).transpose(0, 1)).transpose(0, 1).reshape(N, d)
            dQ = torch.bmm(g.permute(1, 2, 0), v.view(N, H, -1).transpose(0, 1)).transpose(0, 1).reshape(R, d)
        if ctx.key_norm:  # through ρ: ∂ρ/∂v = −ρ³v/d, ∂s/∂ρ = raw
            r = rho[0]  # fp32 for bf16/fp16 v (ρ³ underflows fp16 once rms(v) passes ~25)
            drho = (grad.to(r.dtype) * raw).sum((1, 2)).unsqueeze(-1)
            if dv.dtype == r.dtype:
                dv.addcmul_(-drho * r * r * r / d, v)
            else:
                dv.add_((-drho * r * r * r / d * v).to(dv.dtype))
        return dv, dQ.to(Q.dtype), None, None


def source_scores(v: torch.Tensor, Q: torch.Tensor, heads: int, eps: Optional[float]) -> torch.Tensor:
    """Scores (N, heads, R) of a completed source v (N, d) for the R effective queries Q (R, d),
    key-normalised with 1/rms(v) unless eps is None."""
    return _SourceScores.apply(v, Q, heads, eps)


def _head_dot(x: torch.Tensor, q: torch.Tensor, H: int) -> torch.Tensor:
    """(x·q) per head: x (N, d), q (d,) → (N, H); a matrix-vector product, no temporary."""
    N = x.shape[0]
    if H == 1:
        return (x @ q).unsqueeze(-1)
    return torch.bmm(x.view(N, H, -1).transpose(0, 1), q.view(H, -1, 1)).squeeze(-1).t()


def _merge(o, lse, q, extras, eps, key_norm, sigmoid):
    """The phase-2 merge's forward: h (N, d) in o's type, and the softmax weights, 1/rms and raw
    scores its backward reuses."""
    N, d = o.shape
    H = lse.shape[-1]
    adt = o.dtype
    qa = q.to(adt)
    rho, qv, t = [], [], [lse]
    for u in extras:
        ua = u.to(adt)
        r = inv_rms_acc(ua, eps) if key_norm else None
        s = _head_dot(ua, qa, H)
        qv.append(s)
        rho.append(r)
        s = s * r if key_norm else s
        t.append(F.logsigmoid(s) if sigmoid else s)
    # (1 + k, N, H): the phase-1 state is a source with logit lse. Sources first, so that the
    # softmax runs over a short leading axis with contiguous rows.
    weights = torch.softmax(torch.stack(t), 0)
    h = torch.empty(N, d, dtype=adt, device=o.device)
    hv = h.view(N, H, -1)
    torch.mul(weights[0].unsqueeze(-1), o.view(N, H, -1), out=hv)
    for k, u in enumerate(extras):
        hv.addcmul_(weights[k + 1].unsqueeze(-1), u.to(adt).view(N, H, -1))
    return h, weights, rho, qv


class _MergeRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, lse, q, alpha, cfg, n_extra, *tensors):
        eps, key_norm, sigmoid, out_dtype = cfg
        extras, sources = tensors[:n_extra], tensors[n_extra:]
        h, weights, rho, qv = _merge(o, lse, q, extras, eps, key_norm, sigmoid)
        ctx.cfg, ctx.n_extra = cfg, n_extra
        ctx.save_for_backward(q, alpha, weights, *(rho if key_norm else []), *qv, *extras, *sources)
        return h.to(out_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        _, key_norm, sigmoid, _ = ctx.cfg  # (eps, key_norm, sigmoid, out_dtype)
        k = ctx.n_extra
        q, alpha, weights, *rest = ctx.saved_tensors
        rho, rest = (rest[:k], rest[k:]) if key_norm else ([None] * k, rest)
        qv, extras, sources = rest[:k], rest[k : 2 * k], rest[2 * k :]
        N, H = weights.shape[1:]
        d = q.shape[-1]
        adt = weights.dtype
        g = grad.to(adt).reshape(N, H, -1)
        scratch = torch.empty(N * d, dtype=adt, device=g.device)
        # g·v_c for the phase-1 sources: g·o = Σ_c α_c (g·v_c) here, and β·(g·v_c) is dL/dα_c.
        gv = torch.stack([row_dot(g, v.to(adt).view(N, H, -1), scratch) for v in sources], -1)  # (N, H, n_c)
        go = (alpha.to(adt) * gv).sum(-1)
        gu = [row_dot(g, u.to(adt).view(N, H, -1), scratch) for u in extras]
        dots = torch.stack([go, *gu])  # (1 + k, N, H)
        dt = weights * (dots - (weights * dots).sum(0))  # softmax backward
        d_alpha = (weights[0].unsqueeze(-1) * gv).to(alpha.dtype)
        d_o = torch.empty(N, d, dtype=adt, device=g.device)
        torch.mul(weights[0].unsqueeze(-1), g, out=d_o.view(N, H, -1))
        dq = torch.zeros(H, d // H, dtype=adt, device=g.device)
        d_extras = []
        for j, u in enumerate(extras):
            ua = u.to(adt).view(N, H, -1)
            s = qv[j] * rho[j] if key_norm else qv[j]
            ds = dt[j + 1] * torch.sigmoid(-s) if sigmoid else dt[j + 1]  # d log σ(s)/ds = σ(−s)
            dsr = ds * rho[j] if key_norm else ds  # (N, H)
            du_base = torch.empty(N, d, dtype=adt, device=g.device)
            du = du_base.view(N, H, -1)
            torch.mul(weights[j + 1].unsqueeze(-1), g, out=du)  # value path
            du.addcmul_(dsr.unsqueeze(-1), q.to(adt).view(H, -1))  # key path through q·u
            if key_norm:  # through 1/rms: ∂ρ/∂u = −ρ³u/d, ∂s/∂ρ = q·u
                drho = (ds * qv[j]).sum(-1, keepdim=True)
                du.addcmul_((-drho * rho[j] ** 3 / d).unsqueeze(-1), ua)
            if H == 1:
                dq += dsr.t() @ ua.view(N, d)
            else:
                dq += torch.einsum("nh,nhc->hc", dsr, ua)
            d_extras.append(du_base.to(u.dtype))
        return (d_o, dt[0], dq.view(d).to(q.dtype), d_alpha, None, None, *d_extras, *([None] * len(sources)))


def merge_read(
    o: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    extras: Sequence[torch.Tensor],
    alpha: torch.Tensor,
    sources: Sequence[torch.Tensor],
    *,
    eps: float,
    key_norm: bool,
    sigmoid: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Phase 2 for one reader: o (N, d), lse (N, H) and weights alpha (N, H, n_c) of its phase-1
    read over `sources` (from `mix`, with this reader's weight gradient left to this function),
    q (d,) its effective query (gain folded in), extras the k sources (N, d) to add."""
    if not torch.is_grad_enabled():
        # No node to record. (Also: under torch.compile Dynamo inlines a Function's forward here
        # with its arguments shifted by one, a graph break, seen with torch 2.13.)
        return _merge(o, lse, q, extras, eps, key_norm, sigmoid)[0].to(out_dtype)
    cfg = (eps, key_norm, sigmoid, out_dtype)
    return _MergeRead.apply(o, lse, q, alpha, cfg, len(extras), *extras, *sources)
