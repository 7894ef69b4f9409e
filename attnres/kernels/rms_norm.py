"""RMSNorm through one C kernel each way (csrc/rms_norm.c) for fp32 CPU tensors in eager mode.

The math is torch.nn.RMSNorm's: y = x · (mean x² + eps)^(-1/2) ∘ w. `attnres.layers.RMSNorm`
(every sublayer's PreNorm and the model's final norm, in every residual variant, the baseline
included) runs it where the C kernels serve (`kernels.c_kernels_chosen`: backend auto or cpu,
fp32 CPU tensors outside autocast, not under torch.compile, where Inductor fuses torch's own), and
torch's RMSNorm everywhere else. Why: torch's CPU RMSNorm is a chain of elementwise ops and
reductions, ~470 µs for one forward and backward at the default model's shape (2048 tokens,
d 64), and a step of the default model runs 33 of them (benchmarks/RESULTS.md, fourteenth pass).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import native

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int

_SIGNATURES = {
    "attnres_rms_norm_forward": [_P, _P, _P, _P, _I64, _INT, ctypes.c_float, _INT],
    "attnres_rms_norm_backward": [_P, _P, _P, _P, _P, _P, _I64, _INT, _INT],
}


def available() -> bool:
    """Whether csrc/rms_norm.c builds and loads here (built on the first call)."""
    return native.bind("rms_norm", _SIGNATURES) is not None


def why_unavailable() -> Optional[str]:
    return native.why_unavailable("rms_norm")


def _need():
    return native.require("rms_norm", _SIGNATURES, "RMSNorm")


class _CRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        d = x.shape[-1]
        rows = x.reshape(-1, d).contiguous()
        native.check_fp32_cpu("RMSNorm", rows, weight)
        N = rows.shape[0]
        y = torch.empty_like(rows)
        rho = torch.empty(N, dtype=torch.float32)
        _need().attnres_rms_norm_forward(rows.data_ptr(), native.ptr(weight), y.data_ptr(), rho.data_ptr(), N, d, eps,
                                          native.threads(N))
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
        status = _need().attnres_rms_norm_backward(
            rows.data_ptr(), native.ptr(weight), rho.data_ptr(), g.data_ptr(), dx.data_ptr(),
            native.ptr(dw), N, d, native.threads(N),
        )
        if status:
            raise MemoryError("RMSNorm backward: out of memory for the gain gradient's accumulators")
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
