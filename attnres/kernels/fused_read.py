"""The fused depth read: one autograd formula over two kernel sets, Triton (triton_kernels.py, CUDA)
and C (cpu_read.py, CPU).

    read(sources, query, init) -> outputs of R readers (R, N, d) and their log-sum-exp (R, N, H)

Sources are read in place through a table of pointers (never stacked); each source's 1/rms is
computed once per call for all its readers, outside autograd, and the key norm's gradient is
folded into the sources' gradients in the backward. `init` continues one reader's running read
(its normalised output and log-sum-exp): the merge of the two-phase schedule.

In eager mode the read is an autograd.Function (a custom operator's dispatch costs more than a
small read); under torch.compile it is the operator `attnres::depth_read`, whose backward is
another operator. Both run `_forward` and `_backward`. The kernels' gradients are constants to
autograd, so a second derivative through a fused read raises; the reference has any order.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import backend, cpu_read


def _on_c(t: Tensor) -> bool:
    return t.device.type == "cpu" and backend() != "triton"


def _triton():
    from . import triton_kernels  # imported on first use: Triton is optional, and reads TRITON_INTERPRET at import

    return triton_kernels


def _forward(sources, query, init_out, init_lse, heads, sigmoid, key_norm, eps, per_token, out_dtype):
    """(the R outputs, each (N, d) in out_dtype, lse (R, N, H) fp32, the sources' 1/rms (n, N) or empty)."""
    if _on_c(query):
        R = 1 if per_token else query.shape[0]
        rhos = cpu_read.inv_rms(sources, eps) if key_norm and not cpu_read.one_reader(R, heads, len(sources)) else []
        outs, lse = cpu_read.read_forward(sources, rhos, query, init_out, init_lse, heads, sigmoid, per_token, key_norm, eps)
        outs = [o.to(out_dtype) for o in outs]
    else:
        tk = _triton()
        rhos = [tk.inv_rms_forward(s, eps) for s in sources] if key_norm else []
        o0 = init_out[None] if init_out is not None else None
        out, lse = tk.read_forward(sources, rhos, query, o0, init_lse, heads, sigmoid, per_token, out_dtype)
        outs = list(out.unbind(0))
    rho = torch.stack(rhos) if rhos else query.new_empty(0, dtype=torch.float32)
    return outs, lse, rho


def _backward(sources, rho, query, init_out, init_lse, outs, lse, grad_outs, grad_lse, heads, sigmoid, per_token, key_norm,
              eps):
    """(d_sources: n tensors (N, d), d_query, d_init_out (N, d) or None, d_init_lse or None);
    grad_outs: the R outputs' gradients, None for an output that received none."""
    rhos = list(rho.unbind(0)) if rho.numel() else []
    merge = init_lse is not None
    g = [torch.zeros_like(o) if x is None else x for x, o in zip(grad_outs, outs)]
    glse = grad_lse.contiguous() if grad_lse is not None else None
    if _on_c(query):
        if key_norm and not rhos and glse is not None:  # the one-reader path takes no gradient of lse
            rhos = cpu_read.inv_rms(sources, eps)
        dsrc, dq, do0, dlse0 = cpu_read.read_backward(
            sources, rhos, query, [o.float() for o in outs] if merge else None, init_lse, lse,
            [x.float().contiguous() for x in g], glse, heads, sigmoid, per_token, key_norm, eps)
        return dsrc, dq.to(query.dtype), do0, dlse0
    tk = _triton()
    fold = bool(rhos) and heads == 1  # the Triton kernel folds the key norm's gradient for one head only
    dsrc, drho, dq, do0, dlse0 = tk.read_backward(
        sources, rhos, query, init_out[None] if merge else None, init_lse, lse, torch.stack(g).contiguous(), glse,
        heads, sigmoid, per_token, fold_rms=fold)
    if drho is not None:  # ρ = (mean v² + ε)^(-1/2): ∂ρ/∂v = −ρ³ v / d
        dsrc = dsrc + (-drho * rho.pow(3) / dsrc.shape[-1]).unsqueeze(-1).to(dsrc.dtype) * torch.stack(sources)
    return list(dsrc.unbind(0)), dq.to(query.dtype), (do0[0] if merge else None), dlse0


# The Triton reads copy a host-built table of source pointers at each call, which a CUDA graph
# cannot capture: torch.compile's CUDA-graph modes leave ops with this tag out of their graphs.
_NOT_IN_CUDA_GRAPHS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("attnres::depth_read", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def depth_read_op(sources: list[Tensor], query: Tensor, init_out: Optional[Tensor], init_lse: Optional[Tensor], heads: int,
                  sigmoid: bool, key_norm: bool, eps: float, per_token: bool,
                  out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    outs, lse, rho = _forward(list(sources), query, init_out, init_lse, heads, sigmoid, key_norm, eps, per_token, out_dtype)
    return torch.stack(outs), lse, rho


@depth_read_op.register_fake
def _(sources, query, init_out, init_lse, heads, sigmoid, key_norm, eps, per_token, out_dtype):
    N, d = sources[0].shape
    R = 1 if per_token else query.shape[0]
    rho = query.new_empty((len(sources), N) if key_norm else (0,), dtype=torch.float32)
    return query.new_empty(R, N, d, dtype=out_dtype), query.new_empty(R, N, heads, dtype=torch.float32), rho


@torch.library.custom_op("attnres::depth_read_backward", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def depth_read_backward_op(sources: list[Tensor], rho: Tensor, query: Tensor, init_out: Optional[Tensor],
                           init_lse: Optional[Tensor], out: Tensor, lse: Tensor, grad_out: Tensor,
                           grad_lse: Optional[Tensor], heads: int, sigmoid: bool, per_token: bool, key_norm: bool,
                           eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dsrc, dq, do0, dlse0 = _backward(list(sources), rho, query, init_out, init_lse, list(out.unbind(0)), lse,
                                     list(grad_out.unbind(0)), grad_lse, heads, sigmoid, per_token, key_norm, eps)
    empty = grad_out.new_empty(0, dtype=torch.float32)
    return torch.stack(dsrc), dq, (empty if do0 is None else do0), (empty.clone() if dlse0 is None else dlse0)


@depth_read_backward_op.register_fake
def _(sources, rho, query, init_out, init_lse, out, lse, grad_out, grad_lse, heads, sigmoid, per_token, key_norm, eps):
    empty = grad_out.new_empty(0, dtype=torch.float32)
    merge = init_lse is not None
    return (grad_out.new_empty(len(sources), *sources[0].shape, dtype=sources[0].dtype), torch.empty_like(query),
            torch.empty_like(init_out) if merge else empty, torch.empty_like(init_lse) if merge else empty.clone())


def _setup(ctx, inputs, output):
    sources, query, init_out, init_lse, heads, sigmoid, key_norm, eps, per_token, _ = inputs
    ctx.cfg = (heads, sigmoid, per_token, key_norm, eps)
    ctx.save_for_backward(output[2], query, init_out, init_lse, output[0], output[1], *sources)


def _op_backward(ctx, grad_out, grad_lse, _):
    rho, query, init_out, init_lse, out, lse, *sources = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    dsrc, dq, do0, dlse0 = depth_read_backward_op(sources, rho, query, init_out, init_lse, out, lse, grad_out, grad_lse,
                                                  *ctx.cfg)
    merge = init_lse is not None
    return list(dsrc.unbind(0)), dq, (do0 if merge else None), (dlse0 if merge else None), None, None, None, None, None, None


depth_read_op.register_autograd(_op_backward, setup_context=_setup)


class _Read(torch.autograd.Function):
    """depth_read_op without the operator's dispatch, for eager mode: the same _forward/_backward,
    each reader's output a tensor of its own, each source's gradient too (autograd adds a later
    gradient into it in place)."""

    @staticmethod
    def forward(ctx, query, init_out, init_lse, cfg, *sources):
        heads, sigmoid, key_norm, eps, per_token, out_dtype = cfg
        ctx.set_materialize_grads(False)  # an unused lse gets no gradient (the one-reader path takes none)
        outs, lse, rho = _forward(list(sources), query, init_out, init_lse, *cfg)
        ctx.cfg, ctx.R = (heads, sigmoid, per_token, key_norm, eps), len(outs)
        ctx.save_for_backward(rho, query, init_out, init_lse, lse, *outs, *sources)
        return (*outs, lse)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        rho, query, init_out, init_lse, lse, *rest = ctx.saved_tensors
        outs, sources = rest[: ctx.R], rest[ctx.R :]
        dsrc, dq, do0, dlse0 = _backward(sources, rho, query, init_out, init_lse, outs, lse, list(grads[: ctx.R]),
                                         grads[ctx.R], *ctx.cfg)
        return dq, do0, dlse0, None, *dsrc


def read(sources: list[Tensor], query: Tensor, init: Optional[tuple[Tensor, Tensor]] = None, *, heads: int = 1,
         sigmoid: bool = False, key_norm: bool = True, eps: float = 1e-6, per_token: bool = False,
         out_dtype: Optional[torch.dtype] = None) -> tuple[list[Tensor], Tensor]:
    """R readers over the sources (each (N, d), contiguous, one dtype): R outputs (N, d), lse (R, N, H).

    query: (R, d) static queries, the key-norm gain folded in, or (N, d) per token (R = 1).
    init: (o (N, d), lse (1, N, H)), a running read of one reader to continue, or None.
    """
    init_out, init_lse = init if init is not None else (None, None)
    out_dtype = out_dtype or sources[0].dtype
    if torch.compiler.is_compiling():
        out, lse, _ = depth_read_op(sources, query, init_out, init_lse, heads, sigmoid, key_norm, eps, per_token, out_dtype)
        return list(out.unbind(0)), lse
    *outs, lse = _Read.apply(query, init_out, init_lse, (heads, sigmoid, key_norm, eps, per_token, out_dtype), *sources)
    return outs, lse
