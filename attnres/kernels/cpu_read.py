"""The C depth read (csrc/depth_read.c) behind the same two functions as triton_kernels.py:
contiguous fp32 CPU tensors in, fresh tensors out. Each call splits its tokens into contiguous
ranges of whole 64-token tiles, one per thread (native.threads)."""
from __future__ import annotations

import ctypes
import functools

import torch

from . import native
from .native import F32, I64, INT, P

native.declare({
    "attnres_read_forward_ranges": [P, P, INT, P, INT, P, P, P, P, I64, INT, INT, INT, INT, INT, F32, P, INT],
    "attnres_read_backward_ranges": [P, P, INT, P, INT, P, P, P, P, P, P, P, P, P, P, I64, INT, INT, INT, INT, INT, INT, F32,
                                     P, INT],
    "attnres_inv_rms": [P, P, INT, I64, INT, F32, INT],
})
ONE_READER_SOURCES = 64  # MAX_SOURCES in csrc/depth_read.c


def one_reader(readers: int, heads: int, n: int) -> bool:
    """Whether the kernel reads these sources on its one-reader path, which takes no 1/rms: it
    computes them in the same sweep as the scores."""
    return readers == 1 and heads == 1 and 1 <= n <= ONE_READER_SOURCES

TILE = 64  # tokens per tile of the C kernel (TT in csrc/depth_read.c)


@functools.lru_cache(maxsize=64)
def _ranges(N: int, k: int) -> tuple[ctypes.Array, int]:
    """Bounds of k contiguous token ranges of whole tiles (the last takes the rest), and their count."""
    per_range = -(-N // k)
    step = max(TILE, -(-per_range // TILE) * TILE)
    starts = list(range(0, N, step))
    return (I64 * (len(starts) + 1))(*starts, N), len(starts)


def inv_rms(sources: list[torch.Tensor], eps: float) -> list[torch.Tensor]:
    """1/rms of every row of each source (N, d): n tensors (N,)."""
    N, d = sources[0].shape
    rhos = [torch.empty(N, dtype=torch.float32) for _ in sources]
    native.call("attnres_inv_rms", native.ptrs(sources), native.ptrs(rhos), len(sources), N, d, eps, native.threads(N))
    return rhos


def forward(sources, query, init_out, init_lse, heads, sigmoid, per_token, key_norm, eps, out_dtype=torch.float32,
            rhos=None):
    """R readers over n sources (each (N, d)): the R outputs, each an (N, d) tensor of its own in
    out_dtype, lse (R, N, heads), and the sources' 1/rms (n, N), empty for raw keys and on the
    one-reader path (which computes them in the same sweep as the scores; `rhos` given: the tiles'
    path with these). query: (R, d) static or (N, d) per token (R = 1); init_out (N, d) and
    init_lse (1, N, heads): one reader's running read to continue (the two-phase merge), or None."""
    N, d = sources[0].shape
    R = 1 if per_token else query.shape[0]
    native.check_fp32_cpu("depth read", *sources, query, init_out, init_lse)
    if rhos is None and (not key_norm or one_reader(R, heads, len(sources))):
        rhos = []
    elif rhos is None:
        rhos = [torch.empty(N, dtype=torch.float32) for _ in sources]
        native.call("attnres_inv_rms", native.ptrs(sources), native.ptrs(rhos), len(sources), N, d, eps, native.threads(N))
    outs = [torch.empty(N, d, dtype=torch.float32) for _ in range(R)]
    lse = torch.empty(R, N, heads, dtype=torch.float32)
    bounds, k = _ranges(N, native.threads(N))
    native.call("attnres_read_forward_ranges", native.ptrs(sources), native.ptrs(rhos), len(sources), query.data_ptr(),
                per_token, native.ptr(init_out), native.ptr(init_lse), native.ptrs(outs), lse.data_ptr(), N, d, heads, R,
                sigmoid, key_norm, eps, bounds, k)
    rho = torch.stack(rhos) if rhos else query.new_empty(0, dtype=torch.float32)
    return [o.to(out_dtype) for o in outs], lse, rho


def backward(sources, rho, query, init_out, init_lse, outs, lse, grad_outs, grad_lse, heads, sigmoid, per_token, key_norm,
             eps):
    """Gradients of `forward` (grad_outs: None for an output that received none): d_sources (n
    tensors (N, d)), d_query like query, d_init_out (N, d) and d_init_lse, or None without init."""
    rhos = list(rho.unbind(0)) if rho.numel() else []
    if key_norm and not rhos and grad_lse is not None:  # the one-reader path takes no gradient of lse
        rhos = inv_rms(sources, eps)
    grads = [torch.zeros_like(o, dtype=torch.float32) if g is None else g.float().contiguous() for g, o in zip(grad_outs, outs)]
    merge = [o.float() for o in outs] if init_lse is not None else None
    glse = grad_lse.contiguous() if grad_lse is not None else None
    dsrc, dq, do0, dlse0 = read_backward(sources, rhos, query, merge, init_lse, lse, grads, glse, heads, sigmoid, per_token,
                                         key_norm, eps)
    return dsrc, dq.to(query.dtype), do0, dlse0


def read_backward(sources, rhos, query, outs, init_lse, lse, grad_outs, grad_lse, heads, sigmoid, per_token, key_norm, eps):
    """The C backward of `forward`, the key norm's gradient folded into the sources' (rhos are
    constants): (d_sources: n tensors (N, d), d_query like query, d_init_out (N, d) or None,
    d_init_lse or None). A merge passes its own outputs `outs` (the kernel needs g·out, not the
    running read); grad_outs: R contiguous fp32 tensors."""
    N, d = sources[0].shape
    R, n = len(grad_outs), len(sources)
    # one tensor per source: autograd adds later gradients into a base tensor of its own in place
    dsrc = [torch.empty(N, d, dtype=torch.float32) for _ in range(n)]
    merge = init_lse is not None
    do0 = torch.empty(N, d, dtype=torch.float32) if merge else None
    dlse0 = torch.empty(R, N, heads, dtype=torch.float32) if merge else None
    dq = torch.empty(N if per_token else R, d, dtype=torch.float32)
    bounds, k = _ranges(N, native.threads(N))
    native.call("attnres_read_backward_ranges", native.ptrs(sources), native.ptrs(rhos), n, query.data_ptr(), per_token,
                native.ptrs(outs) if merge else None, native.ptr(init_lse), lse.data_ptr(), native.ptrs(grad_outs), native.ptr(grad_lse),
                native.ptrs(dsrc), None, dq.data_ptr(), native.ptr(do0), native.ptr(dlse0), N, d, heads, R, sigmoid,
                bool(rhos), key_norm, eps, bounds, k)
    return dsrc, dq, do0, dlse0
