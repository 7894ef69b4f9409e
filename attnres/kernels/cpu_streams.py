"""mHC's steps on the C kernels (csrc/streams.c), for fp32 CPU tensors in eager mode: the same
function as the torch steps of ManifoldHyperConnections.stream, whose loop calls them.

The state is one (..., n, d) tensor. `UpdateThenMix` is one autograd step per sublayer: the
previous sublayer's update H = post·v + res·H_prev and this sublayer's mix of H (the projection as
one matmul, then 1/rms, gates, Sinkhorn and the pre-mix h per token in C); `Update` is the last
sublayer's update alone. H then has a single consumer, so its gradient is written once, by one
kernel, instead of being summed over autograd branches.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import native
from .native import F32, I64, INT, P

native.declare({  # each ends with the thread count
    "mhc_mix_forward": [P, P, P, P, P, P, P, P, P, I64, INT, INT, INT, F32, INT],
    "mhc_mix_backward": [P, P, P, P, P, P, P, P, P, P, P, P, P, I64, INT, INT, INT, INT],
    "mhc_update_forward": [P, P, P, P, P, I64, INT, INT, INT],
    "mhc_update_backward": [P, P, P, P, P, P, P, P, P, I64, INT, INT, INT],
})


def _mix(ctx, H, w):
    """h, post, res of the streams H (..., n, d), with w = g ∘ φ (n·d, 2n + n²); keeps on ctx what
    the backward needs besides H (the projection and 1/rms: 2n + n² + 1 floats a token)."""
    n, d = H.shape[-2:]
    N = H.numel() // (n * d)
    proj = torch.mm(H.view(N, n * d), w)
    rstd, h = torch.empty(N), torch.empty(*H.shape[:-2], d)
    post, res = torch.empty(*H.shape[:-2], n), torch.empty(*H.shape[:-2], n, n)
    native.call("mhc_mix_forward", H.data_ptr(), proj.data_ptr(), ctx.gates.data_ptr(), ctx.bias.data_ptr(),
                rstd.data_ptr(), h.data_ptr(), None, post.data_ptr(), res.data_ptr(), N, n, d, ctx.iters, ctx.eps,
                native.threads(N))
    return proj, rstd, h, post, res


def _mix_backward(ctx, H, proj, rstd, w, dh, dpost, dres, gH):
    """The whole gradient reaching H (gH: what it receives elsewhere, or None), and those of w,
    the gates and the bias."""
    n, d = H.shape[-2:]
    N, m = proj.shape
    G, dproj = torch.empty_like(H), torch.empty(N, m)
    dgates, dbias = torch.zeros(3, dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
    dense = [None if t is None else t.contiguous() for t in (dh, dpost, dres, gH)]
    native.call("mhc_mix_backward", H.data_ptr(), proj.data_ptr(), rstd.data_ptr(), ctx.gates.data_ptr(),
                ctx.bias.data_ptr(), *map(native.ptr, dense), G.data_ptr(), dproj.data_ptr(), dgates.data_ptr(),
                dbias.data_ptr(), N, n, d, ctx.iters, native.threads(N))
    flat = G.view(N, n * d)
    torch.addmm(flat, dproj, w.t(), out=flat)  # the projection's share (addmm, not addmm_: FlopCounterMode sees it)
    dw = dproj.t().mm(H.view(N, n * d)).t() if ctx.needs_input_grad[4] else None
    return G, dw, dgates.float(), dbias.float()


def _update(Hp, v, post, res):
    n, d = Hp.shape[-2:]
    N = Hp.numel() // (n * d)
    H = torch.empty_like(Hp)
    native.call("mhc_update_forward", Hp.data_ptr(), v.data_ptr(), post.data_ptr(), res.data_ptr(), H.data_ptr(), N, n,
                d, native.threads(N))
    return H


def _update_backward(G, Hp, v, post, res):
    n, d = Hp.shape[-2:]
    N = Hp.numel() // (n * d)
    grads = [torch.empty_like(t) for t in (Hp, v, post, res)]
    native.call("mhc_update_backward", G.data_ptr(), Hp.data_ptr(), v.data_ptr(), post.data_ptr(), res.data_ptr(),
                *(g.data_ptr() for g in grads), N, n, d, native.threads(N))
    return grads


class UpdateThenMix(torch.autograd.Function):
    """H = post·v + res·H_prev (the previous sublayer's update; none before the first sublayer), then
    this sublayer's mix of H: returns (H, h, post', res')."""

    @staticmethod
    def forward(ctx, Hp, v, post, res, w, gates, bias, iters: int, eps: float):
        ctx.set_materialize_grads(False)
        ctx.gates, ctx.bias, ctx.iters, ctx.eps, ctx.first = gates, bias, iters, eps, v is None
        H = Hp if v is None else _update(Hp, v.contiguous(), post, res)
        proj, rstd, h, post_next, res_next = _mix(ctx, H, w)
        ctx.save_for_backward(Hp, v, post, res, H, proj, rstd, w)
        return H, h, post_next, res_next

    @staticmethod
    @once_differentiable
    def backward(ctx, dH, dh, dpost, dres):
        Hp, v, post, res, H, proj, rstd, w = ctx.saved_tensors
        G, dw, dgates, dbias = _mix_backward(ctx, H, proj, rstd, w, dh, dpost, dres, dH)
        if ctx.first:
            return G, None, None, None, dw, dgates, dbias, None, None
        return (*_update_backward(G, Hp, v.contiguous(), post, res), dw, dgates, dbias, None, None)


class Update(torch.autograd.Function):
    """The last sublayer's update alone: H = post·v + res·H_prev."""

    @staticmethod
    def forward(ctx, Hp, v, post, res):
        ctx.set_materialize_grads(False)
        v = v.contiguous()
        ctx.save_for_backward(Hp, v, post, res)
        return _update(Hp, v, post, res)

    @staticmethod
    @once_differentiable
    def backward(ctx, dH):
        if dH is None:
            return None, None, None, None
        return tuple(_update_backward(dH.contiguous(), *ctx.saved_tensors))
