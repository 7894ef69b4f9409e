"""RMSNorm through one C kernel each way (csrc/rms_norm.c), torch.nn.RMSNorm's math, for
`attnres.layers.RMSNorm` where the C kernels serve (fp32 CPU tensors in eager mode): torch's CPU
RMSNorm is a chain of small ops, and a training step runs one per sublayer, forward and backward."""
from __future__ import annotations

from typing import Optional

import torch

from . import native
from .native import F32, I64, INT, P

native.declare({
    "attnres_rms_norm_forward": [P, P, P, P, I64, INT, F32, INT],
    "attnres_rms_norm_backward": [P, P, P, P, P, P, I64, INT, INT],
})


class _CRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        d = x.shape[-1]
        rows = x.reshape(-1, d).contiguous()
        native.check_fp32_cpu("RMSNorm", rows, weight)
        N = rows.shape[0]
        y = torch.empty_like(rows)
        rho = torch.empty(N, dtype=torch.float32)
        native.call("attnres_rms_norm_forward", rows.data_ptr(), native.ptr(weight), y.data_ptr(), rho.data_ptr(), N, d,
                    eps, native.threads(N))
        ctx.save_for_backward(x, rho, weight)  # x, not rows: an input keeps its history for create_graph
        ctx.eps = eps
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rho, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
            return _differentiable_backward(ctx, x, weight, grad)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        N, d = rows.shape
        g = grad.reshape(N, d).contiguous()
        dx = torch.empty_like(rows)
        want_dw = weight is not None and ctx.needs_input_grad[1]
        dw = torch.empty(d, dtype=torch.float32) if want_dw else None
        native.call("attnres_rms_norm_backward", rows.data_ptr(), native.ptr(weight), rho.data_ptr(), g.data_ptr(),
                    dx.data_ptr(), native.ptr(dw), N, d, native.threads(N))
        return dx.view(x.shape), dw, None


def _differentiable_backward(ctx, x, weight, grad):
    """The backward through torch's own RMSNorm, for higher-order gradients (a gradient penalty, a
    Hessian-vector product): the kernel's gradients are constants to autograd, which would drop
    every second-order term through the norm without a word."""
    inputs = [x] + ([weight] if weight is not None and ctx.needs_input_grad[1] else [])
    with torch.enable_grad():
        y = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, ctx.eps)
        grads = torch.autograd.grad(y, inputs, grad, create_graph=True)
    return grads[0], (grads[1] if len(grads) > 1 else None), None


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """torch.nn.functional.rms_norm over the last dimension by the C kernels (fp32 CPU tensors;
    weight (d,) or None)."""
    return _CRMSNorm.apply(x, weight, eps)
