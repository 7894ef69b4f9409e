"""The fused depth read: one autograd formula over two kernel sets, Triton (triton_kernels.py, CUDA)
and C (cpu_read.py, CPU), each with the same `forward` and `backward`.

    Read.apply(query, init_out, init_lse, cfg, *sources) -> R outputs (N, d), lse (R, N, H)

Sources are read in place through a table of pointers (never stacked); each source's 1/rms is
computed once per call for all its readers, outside autograd, and the key norm's gradient is
folded into the sources' gradients in the backward. `init` continues one reader's running read
(its normalised output and log-sum-exp): the merge of the two-phase schedule.

In eager mode the read is an autograd.Function (a custom operator's dispatch costs more than a
small read); under torch.compile it is the operator `attnres::depth_read`, whose backward is
another operator. The kernels' gradients are constants to autograd, so a second derivative
through a fused read raises; the reference has any order. Which kernel set runs is the caller's
`kernel` ("c" or "triton", from `attnres.kernels.plan`): nothing here decides it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import cpu_read


def kernel_set(kernel: str):
    """The module whose forward/backward run a read: cpu_read for "c", triton_kernels for "triton"."""
    if kernel == "c":
        return cpu_read
    from . import triton_kernels  # imported on first use: Triton is optional, and reads TRITON_INTERPRET at import

    return triton_kernels


# The Triton reads copy a host-built table of source pointers at each call, which a CUDA graph
# cannot capture: torch.compile's CUDA-graph modes leave ops with this tag out of their graphs.
_NOT_IN_CUDA_GRAPHS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("attnres::depth_read", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def depth_read_op(sources: list[Tensor], query: Tensor, init_out: Optional[Tensor], init_lse: Optional[Tensor], heads: int,
                  sigmoid: bool, key_norm: bool, eps: float, per_token: bool, out_dtype: torch.dtype,
                  kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    outs, lse, rho = kernel_set(kernel).forward(list(sources), query, init_out, init_lse, heads, sigmoid, per_token, key_norm,
                                                eps, out_dtype)
    return torch.stack(outs), lse, rho


@depth_read_op.register_fake
def _(sources, query, init_out, init_lse, heads, sigmoid, key_norm, eps, per_token, out_dtype, kernel):
    N, d = sources[0].shape
    R = 1 if per_token else query.shape[0]
    rho = query.new_empty((len(sources), N) if key_norm else (0,), dtype=torch.float32)
    return query.new_empty(R, N, d, dtype=out_dtype), query.new_empty(R, N, heads, dtype=torch.float32), rho


@torch.library.custom_op("attnres::depth_read_backward", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def depth_read_backward_op(sources: list[Tensor], rho: Tensor, query: Tensor, init_out: Optional[Tensor],
                           init_lse: Optional[Tensor], out: Tensor, lse: Tensor, grad_out: Tensor,
                           grad_lse: Optional[Tensor], heads: int, sigmoid: bool, per_token: bool, key_norm: bool,
                           eps: float, kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dsrc, dq, do0, dlse0 = kernel_set(kernel).backward(list(sources), rho, query, init_out, init_lse, list(out.unbind(0)),
                                                       lse, list(grad_out.unbind(0)), grad_lse, heads, sigmoid, per_token,
                                                       key_norm, eps)
    empty = grad_out.new_empty(0, dtype=torch.float32)
    return torch.stack(dsrc), dq, (empty if do0 is None else do0), (empty.clone() if dlse0 is None else dlse0)


@depth_read_backward_op.register_fake
def _(sources, rho, query, init_out, init_lse, out, lse, grad_out, grad_lse, heads, sigmoid, per_token, key_norm, eps,
      kernel):
    empty = grad_out.new_empty(0, dtype=torch.float32)
    merge = init_lse is not None
    return (grad_out.new_empty(len(sources), *sources[0].shape, dtype=sources[0].dtype), torch.empty_like(query),
            torch.empty_like(init_out) if merge else empty, torch.empty_like(init_lse) if merge else empty.clone())


def _setup(ctx, inputs, output):
    sources, query, init_out, init_lse, heads, sigmoid, key_norm, eps, per_token, _, kernel = inputs
    ctx.cfg = (heads, sigmoid, per_token, key_norm, eps, kernel)
    ctx.save_for_backward(output[2], query, init_out, init_lse, output[0], output[1], *sources)


def _op_backward(ctx, grad_out, grad_lse, _):
    rho, query, init_out, init_lse, out, lse, *sources = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    dsrc, dq, do0, dlse0 = depth_read_backward_op(sources, rho, query, init_out, init_lse, out, lse, grad_out, grad_lse,
                                                  *ctx.cfg)
    merge = init_lse is not None
    return (list(dsrc.unbind(0)), dq, (do0 if merge else None), (dlse0 if merge else None), *[None] * 7)


depth_read_op.register_autograd(_op_backward, setup_context=_setup)


class Read(torch.autograd.Function):
    """depth_read_op without the operator's dispatch, for eager mode: each reader's output a tensor
    of its own, each source's gradient too (autograd adds a later gradient into it in place).
    cfg: (kernel, heads, sigmoid, key_norm, eps, per_token, out_dtype)."""

    @staticmethod
    def forward(ctx, query, init_out, init_lse, cfg, *sources):
        kernel, heads, sigmoid, key_norm, eps, per_token, out_dtype = cfg
        ctx.set_materialize_grads(False)  # an unused lse gets no gradient (the one-reader path takes none)
        ctx.kernels = kernel_set(kernel)
        outs, lse, rho = ctx.kernels.forward(list(sources), query, init_out, init_lse, heads, sigmoid, per_token, key_norm,
                                             eps, out_dtype)
        ctx.cfg, ctx.R = (heads, sigmoid, per_token, key_norm, eps), len(outs)
        ctx.save_for_backward(rho, query, init_out, init_lse, lse, *outs, *sources)
        return (*outs, lse)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        rho, query, init_out, init_lse, lse, *rest = ctx.saved_tensors
        outs, sources = rest[: ctx.R], rest[ctx.R :]
        dsrc, dq, do0, dlse0 = ctx.kernels.backward(list(sources), rho, query, init_out, init_lse, outs, lse,
                                                    list(grads[: ctx.R]), grads[ctx.R], *ctx.cfg)
        return dq, do0, dlse0, None, *dsrc
