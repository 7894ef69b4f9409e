"""The C kernels of csrc/depth_read.c behind the same four functions as triton_kernels.py
(`read_forward`, `read_backward`, `inv_rms_forward`, `inv_rms_backward`), for contiguous fp32
CPU tensors. ops.py routes a CPU call here, so the custom operators, their autograd and the
readers are shared by both kernel paths. Two differences, both for the CPU's sake: the backward
can fold the key norm's gradient into the sources' (fold_rms), and a merge's backward is given
the read's output where the Triton backward takes the initial state (ops._setup).
Reads of one reader and one head (the phase-2 merges, and per-sublayer reads with a static or a
per-token query) have kernels of their own, csrc/depth_read_one.c (`read_one_forward`,
`read_one_backward`: the sources' 1/rms computed in the kernel), called by ops._CReadOne in eager
mode.

Threads (`native.threads`): a call splits its tokens into contiguous ranges, one per OpenMP
thread, in torch's own pool (the library is built with OpenMP only where it can share torch's
runtime, see native.py; elsewhere the ranges run one after another on the calling thread). As many
as torch.get_num_threads() by default, so `torch.set_num_threads` governs the reads like every
other op; ATTNRES_CPU_THREADS=k sets it apart; one in a forked child.
An earlier version split over Python threads; on this project's 2-core machine that was slower in
the model, because torch's spinning OpenMP workers held the cores the second thread needed.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from . import native
from .native import threads

_TT = 64  # tokens per tile: TT in csrc/depth_read.c
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


_SIGNATURES = {
    "attnres_read_forward_ranges": [_P, _P, _INT, _P, _INT, _P, _P, _P, _P, _I64, _INT, _INT, _INT, _INT, _P, _INT],
    "attnres_read_backward_ranges": [
        _P, _P, _INT, _P, _INT, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _INT, _INT, _INT, _INT, _INT, _P, _INT,
    ],
    "attnres_openmp": [],
    "attnres_inv_rms_forward": [_P, _P, _I64, _INT, ctypes.c_float],
    "attnres_inv_rms_backward": [_P, _P, _P, _P, _I64, _INT],
}


_READ_ONE_SIGNATURES = {
    "attnres_read_one_forward": [_P, _INT, _P, _INT, _P, _P, _P, _P, _INT, ctypes.c_float, _INT, _INT, _P, _INT],
    "attnres_read_one_backward": [
        _P, _INT, _P, _INT, _P, _P, _P, _P, _P, _P, _P, _P, _INT, ctypes.c_float, _INT, _INT, _P, _INT,
    ],
    "attnres_read_one_max_sources": [],
}


def available() -> bool:
    return native.bind("depth_read", _SIGNATURES) is not None


def _need():
    return native.require("depth_read", _SIGNATURES, "the CPU depth reads")


def _ptrs(tensors) -> Optional[ctypes.Array]:
    return (_P * len(tensors))(*[t.data_ptr() for t in tensors]) if len(tensors) else None


def uses_openmp() -> bool:
    """Whether the library runs its token ranges on OpenMP threads (else one after another)."""
    return bool(_need().attnres_openmp())


def _ranges(N: int) -> list[tuple[int, int]]:
    """The contiguous token ranges a read of N tokens splits into, one per thread (native.threads),
    whole tiles each but the last."""
    bounds, k = _split(N, threads(N), _TT)
    return [(bounds[j], bounds[j + 1]) for j in range(k)]


@functools.lru_cache(maxsize=64)
def _split(N: int, k: int, group: int) -> tuple[ctypes.Array, int]:
    """The bounds of k contiguous token ranges of whole groups of `group` tokens (the kernels'
    tiles; the last range takes the rest) and their count, as the *_ranges entry points take
    them; kept per shape: in a training step a call's Python runs with cold caches, where each
    line costs (benchmarks/RESULTS.md)."""
    per_range = -(-N // k)
    step = max(group, -(-per_range // group) * group)
    starts = list(range(0, N, step))
    return (_I64 * (len(starts) + 1))(*starts, N), len(starts)


def _rows(x) -> list:
    """The R reader rows of x: a (R, N, d) tensor or already a list of R (N, d) tensors."""
    return list(x) if isinstance(x, (list, tuple)) else list(x.unbind(0))


def read_forward(sources, inv_rms, query, init_out, init_lse, heads, sigmoid, per_token, out_dtype, separate=False):
    """As triton_kernels.read_forward; with `separate`, the R outputs are R tensors of their own
    (a list) rather than one (R, N, d) tensor, so that each reader's output lives and dies alone."""
    lib = _need()
    ref = sources[0] if sources else init_out
    N, d = ref.shape[-2], ref.shape[-1]
    R = 1 if per_token else query.shape[0]
    native.check_fp32_cpu("depth read", *sources, *inv_rms, query, init_out, init_lse)
    if separate:
        outs = [torch.empty(N, d, dtype=torch.float32) for _ in range(R)]
    else:
        out = torch.empty(R, N, d, dtype=torch.float32)
        outs = list(out.unbind(0))
    lse = torch.empty(R, N, heads, dtype=torch.float32)
    bounds, k = _split(N, threads(N), _TT)
    status = lib.attnres_read_forward_ranges(
        _ptrs(sources), _ptrs(inv_rms), len(sources), query.data_ptr(), per_token, native.ptr(init_out),
        native.ptr(init_lse), _ptrs(outs), lse.data_ptr(), N, d, heads, R, sigmoid, bounds, k,
    )
    if status:
        raise MemoryError("depth read: out of memory for the kernel's scratch")
    if separate:
        return (outs if out_dtype == torch.float32 else [o.to(out_dtype) for o in outs]), lse
    return (out if out_dtype == torch.float32 else out.to(out_dtype)), lse


def read_backward(sources, inv_rms, query, init_out, init_lse, lse, grad_out, grad_lse, heads, sigmoid, per_token,
                  fold_rms=False, check=True):
    """As triton_kernels.read_backward (d_sources a list of (N, d) tensors here), except that a
    merge passes, in the place of init_out, the read's own output (the C backward needs g·out,
    not the initial state: see csrc/depth_read.c). grad_out and that output may be (R, N, d)
    tensors or lists of R (N, d) tensors (`read_forward(separate=True)`). With fold_rms the key
    norm's gradient is added to the sources' (d_inv_rms is None). check=False: the caller
    guarantees contiguous fp32 CPU tensors (ops._CRead: checked in its forward)."""
    lib = _need()
    gouts = _rows(grad_out)
    outs = _rows(init_out) if init_out is not None else None
    R, (N, d) = len(gouts), gouts[0].shape
    n = len(sources)
    if check:
        native.check_fp32_cpu("depth read backward", *sources, *inv_rms, query, *(outs or []), init_lse, lse, *gouts, grad_lse)
    # One tensor per source, not views of one (n, N, d) block: autograd adds a source's later
    # gradients into its first one in place only when that is a base tensor of its own.
    dsrc = [torch.empty(N, d, dtype=torch.float32) for _ in range(n)]
    drms = torch.empty(n, N, dtype=torch.float32) if inv_rms and not fold_rms else None
    has_init = init_out is not None
    do0 = torch.empty(R, N, d, dtype=torch.float32) if has_init else None
    dlse0 = torch.empty(R, N, heads, dtype=torch.float32) if has_init else None
    dq = torch.empty(N if per_token else R, d, dtype=torch.float32)
    bounds, k = _split(N, threads(N), _TT)
    status = lib.attnres_read_backward_ranges(
        _ptrs(sources), _ptrs(inv_rms), n, query.data_ptr(), per_token, _ptrs(outs) if outs is not None else None,
        native.ptr(init_lse), lse.data_ptr(), _ptrs(gouts), native.ptr(grad_lse), _ptrs(dsrc),
        _ptrs(list(drms.unbind(0))) if drms is not None else None, dq.data_ptr(), native.ptr(do0), native.ptr(dlse0),
        N, d, heads, R, sigmoid, fold_rms, bounds, k,
    )
    if status:
        raise MemoryError("depth read backward: out of memory for the kernel's scratch")
    return dsrc, drms, dq, do0, dlse0


def inv_rms_forward(x: torch.Tensor, eps: float) -> torch.Tensor:
    lib = _need()
    native.check_fp32_cpu("inv_rms", x)
    N, d = x.shape
    rho = torch.empty(N, dtype=torch.float32)
    lib.attnres_inv_rms_forward(x.data_ptr(), rho.data_ptr(), N, d, eps)
    return rho


def inv_rms_backward(x: torch.Tensor, rho: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    lib = _need()
    native.check_fp32_cpu("inv_rms backward", x, rho, grad)
    N, d = x.shape
    dx = torch.empty_like(x)
    lib.attnres_inv_rms_backward(x.data_ptr(), rho.data_ptr(), grad.data_ptr(), dx.data_ptr(), N, d)
    return dx


# --- reads of one reader, one head (csrc/depth_read_one.c) -------------------------------------


def read_one_max_sources() -> int:
    """How many sources csrc/depth_read_one.c takes (0: it could not be built)."""
    lib = native.bind("depth_read_one", _READ_ONE_SIGNATURES)
    return lib.attnres_read_one_max_sources() if lib is not None else 0


def read_one_split(N: int) -> tuple[ctypes.Array, int]:
    """The token ranges of a read of N tokens (one per thread, `native.threads`), for
    read_one_forward/backward: a reader takes them once for all its reads."""
    return _split(N, threads(N), 16)  # groups of G = 16 tokens in csrc/depth_read_one.c


def read_one_forward(sources, query, init_out, init_lse, eps, key_norm, sigmoid, split=None):
    """One reader, one head over the sources (each (N, d)), 1/rms of the sources computed in the
    kernel: a running read (init_out (N, d), init_lse (N, 1)) continued by them (a phase-2 merge),
    or with init_out = init_lse = None a plain read of them. query: (d,) static, or (N, d) per
    token. Returns the output (N, d) and its lse (N, 1). 1 to read_one_max_sources() sources
    (ValueError otherwise); split: read_one_split(N), if the caller has it."""
    lib = _read_one_lib()
    native.check_fp32_cpu("depth read (one reader)", *sources, query, init_out, init_lse)
    N, d = sources[0].shape
    out = torch.empty(N, d, dtype=torch.float32)
    lse = torch.empty(N, 1, dtype=torch.float32)
    bounds, k = split or read_one_split(N)
    status = lib.attnres_read_one_forward(
        _ptrs(sources), len(sources), query.data_ptr(), query.dim() == 2, native.ptr(init_out), native.ptr(init_lse),
        out.data_ptr(), lse.data_ptr(), d, eps, key_norm, sigmoid, bounds, k,
    )
    _read_one_status(status, len(sources), "")
    return out, lse


def read_one_backward(sources, query, out, init_lse, lse, grad_out, eps, key_norm, sigmoid, split=None):
    """Gradients of read_one_forward from its own output `out` and lse: (d_sources (a list of
    (N, d)), d_query (shaped as query), d_init_out (N, d), d_init_lse (N, 1)), the last two None
    for a plain read (init_lse None); the key norm's gradient is in d_sources. Takes what
    read_one_forward took and gave (checked there) and a contiguous fp32 grad_out."""
    N, d = out.shape
    dsrc = [torch.empty(N, d, dtype=torch.float32) for _ in sources]  # base tensors (see read_backward)
    dq = torch.empty(query.shape, dtype=torch.float32)
    is_merge = init_lse is not None
    do0 = torch.empty(N, d, dtype=torch.float32) if is_merge else None
    dlse0 = torch.empty(N, 1, dtype=torch.float32) if is_merge else None
    bounds, k = split or read_one_split(N)
    status = _read_one_lib().attnres_read_one_backward(
        _ptrs(sources), len(sources), query.data_ptr(), query.dim() == 2, out.data_ptr(), native.ptr(init_lse),
        lse.data_ptr(), grad_out.data_ptr(), _ptrs(dsrc), dq.data_ptr(), native.ptr(do0), native.ptr(dlse0), d, eps,
        key_norm, sigmoid, bounds, k,
    )
    _read_one_status(status, len(sources), " backward")
    return dsrc, dq, do0, dlse0


def _read_one_status(status: int, n: int, what: str) -> None:
    if status == 2:
        raise ValueError(f"depth read (one reader){what}: {n} sources; allowed: 1 to {read_one_max_sources()}")
    if status:
        raise MemoryError(f"depth read (one reader){what}: out of memory for the query gradient's accumulators")


def _read_one_lib() -> ctypes.CDLL:
    return native.require("depth_read_one", _READ_ONE_SIGNATURES, "the CPU reads of one reader")
