"""The C kernels of mHC's stream mixing (csrc/streams.c) as tensor functions: contiguous fp32 CPU
tensors in, freshly allocated tensors out. The autograd around them is in
attnres/residuals/hyper_connections.py; this module only checks, allocates and calls.

The state is one (..., n, d) tensor (per token the n streams, contiguous); `N` below is the
number of tokens, the product of the leading dimensions. Each function is one call over all
tokens, split over torch's OpenMP threads (`native.threads`) where the library is built with
OpenMP (see native.py).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import native

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_F32 = ctypes.c_float


_SIGNATURES = {  # each ends with the thread count
    "mhc_sinkhorn_forward": [_P, _P, _I64, _INT, _INT, _INT],
    "mhc_sinkhorn_backward": [_P, _P, _P, _I64, _INT, _INT, _INT],
    "mhc_mix_forward": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _INT, _INT, _INT, _F32, _INT],
    "mhc_mix_backward": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _INT, _INT, _INT, _INT],
    "mhc_update_forward": [_P, _P, _P, _P, _P, _I64, _INT, _INT, _INT],
    "mhc_update_backward": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _INT, _INT, _INT],
}


def available() -> bool:
    """Whether csrc/streams.c builds and loads here (built on the first call)."""
    return native.bind("streams", _SIGNATURES) is not None


def why_unavailable() -> Optional[str]:
    return native.why_unavailable("streams")


def _need():
    return native.require("streams", _SIGNATURES, "mHC")


def _done(status: int, what: str) -> None:
    if status != 0:
        raise MemoryError(f"{what}: the C kernel could not allocate its scratch")


def _tokens(x: torch.Tensor, trailing: int) -> int:
    size = 1
    for s in x.shape[: x.dim() - trailing]:
        size *= s
    return size


def sinkhorn_forward(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Sinkhorn-Knopp of exp(logits − max) for logits (..., n, n)."""
    lib = _need()
    native.check_fp32_cpu("sinkhorn", logits)
    n = logits.shape[-1]
    out = torch.empty_like(logits)
    N = _tokens(logits, 2)
    _done(lib.mhc_sinkhorn_forward(logits.data_ptr(), out.data_ptr(), N, n, iters, native.threads(N)), "sinkhorn")
    return out


def sinkhorn_backward(logits: torch.Tensor, grad: torch.Tensor, iters: int) -> torch.Tensor:
    """The gradient of the logits, the iterations recomputed from them."""
    lib = _need()
    native.check_fp32_cpu("sinkhorn backward", logits, grad)
    dlogits = torch.empty_like(logits)
    N = _tokens(logits, 2)
    _done(lib.mhc_sinkhorn_backward(logits.data_ptr(), grad.data_ptr(), dlogits.data_ptr(), N, logits.shape[-1], iters,
                                    native.threads(N)), "sinkhorn backward")
    return dlogits


def mix_forward(H: torch.Tensor, proj: torch.Tensor, gates: torch.Tensor, bias: torch.Tensor, iters: int, eps: float,
                want_pre: bool = False):
    """From the streams H (..., n, d) and proj = vec(H) @ (g ∘ φ) (N, 2n + n²): rstd (N,), the
    pre-mix h (..., d), post (..., n), res (..., n, n), and pre (..., n) if want_pre, else None."""
    lib = _need()
    native.check_fp32_cpu("mHC mix", H, proj, gates, bias)
    n, d = H.shape[-2], H.shape[-1]
    lead, N = H.shape[:-2], _tokens(H, 2)
    rstd = torch.empty(N, dtype=torch.float32)
    h = torch.empty(*lead, d, dtype=torch.float32)
    pre = torch.empty(*lead, n, dtype=torch.float32) if want_pre else None
    post = torch.empty(*lead, n, dtype=torch.float32)
    res = torch.empty(*lead, n, n, dtype=torch.float32)
    _done(lib.mhc_mix_forward(H.data_ptr(), proj.data_ptr(), gates.data_ptr(), bias.data_ptr(), rstd.data_ptr(),
                              h.data_ptr(), native.ptr(pre), post.data_ptr(), res.data_ptr(), N, n, d, iters, eps,
                              native.threads(N)), "mHC mix")
    return rstd, h, pre, post, res


def mix_backward(H, proj, rstd, gates, bias, dh, dpost, dres, gH, iters: int):
    """Gradients of the mix from those of h, post, res (each may be None) and gH, what H receives
    elsewhere (None: nothing): G (..., n, d), everything H receives except the projection's
    (G + dproj @ wᵀ is the whole), dproj (N, m), dgates (3,), dbias (m,)."""
    lib = _need()
    native.check_fp32_cpu("mHC mix backward", H, proj, rstd, gates, bias, dh, dpost, dres, gH)
    n, d = H.shape[-2], H.shape[-1]
    N, m = proj.shape
    G = torch.empty_like(H)
    dproj = torch.empty(N, m, dtype=torch.float32)
    dgates = torch.zeros(3, dtype=torch.float64)
    dbias = torch.zeros(m, dtype=torch.float64)
    _done(lib.mhc_mix_backward(H.data_ptr(), proj.data_ptr(), rstd.data_ptr(), gates.data_ptr(), bias.data_ptr(),
                               native.ptr(dh), native.ptr(dpost), native.ptr(dres), native.ptr(gH), G.data_ptr(), dproj.data_ptr(),
                               dgates.data_ptr(), dbias.data_ptr(), N, n, d, iters, native.threads(N)), "mHC mix backward")
    return G, dproj, dgates.float(), dbias.float()


def update_forward(Hp: torch.Tensor, v: torch.Tensor, post: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """H'_i = post_i·v + Σ_j res_ij·H_j for streams Hp (..., n, d), v (..., d), post (..., n),
    res (..., n, n)."""
    lib = _need()
    native.check_fp32_cpu("mHC update", Hp, v, post, res)
    n, d = Hp.shape[-2], Hp.shape[-1]
    Hn = torch.empty_like(Hp)
    N = _tokens(Hp, 2)
    _done(lib.mhc_update_forward(Hp.data_ptr(), v.data_ptr(), post.data_ptr(), res.data_ptr(), Hn.data_ptr(), N, n, d,
                                 native.threads(N)), "mHC update")
    return Hn


def update_backward(G, Hp, v, post, res):
    """From G, the gradient of H': dHp, dv, dpost, dres."""
    lib = _need()
    native.check_fp32_cpu("mHC update backward", G, Hp, v, post, res)
    n, d = Hp.shape[-2], Hp.shape[-1]
    dHp, dv, dpost, dres = torch.empty_like(Hp), torch.empty_like(v), torch.empty_like(post), torch.empty_like(res)
    N = _tokens(Hp, 2)
    _done(lib.mhc_update_backward(G.data_ptr(), Hp.data_ptr(), v.data_ptr(), post.data_ptr(), res.data_ptr(),
                                  dHp.data_ptr(), dv.data_ptr(), dpost.data_ptr(), dres.data_ptr(), N, n, d, native.threads(N)),
          "mHC update backward")
    return dHp, dv, dpost, dres
