"""Which implementation of a depth read (and of mHC's stream mixing) runs: decided here only.

- "triton": the Triton kernels, for CUDA tensors of fp32/bf16/fp16 when Triton is installed;
- "c": the C kernels (csrc/, built on first use with the system compiler), for fp32 CPU tensors
  in eager mode outside CPU autocast;
- "torch": the reference (attnres.depth_attention), everywhere else: float64, CPU autocast, CPU
  under torch.compile (Inductor fuses the reference there), no compiler, no Triton.

`ATTNRES_KERNEL=auto|triton|cpu|torch` (or `set_backend`) forces one; a forced path that cannot
serve the tensors is an error, not a fallback. Forced "triton" runs on CPU under
`TRITON_INTERPRET=1`, which is how the tests run the GPU kernels without a GPU.

Schedule of static-query Block and Full reads (`two_phase`): the paper's two-phase computation
where it is the faster one, one read per sublayer elsewhere (`ATTNRES_SCHEDULE` or
`set_schedule` forces either). Every path and schedule computes the same function.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

BACKENDS = ("auto", "triton", "cpu", "torch")
SCHEDULES = ("auto", "two_phase", "per_read")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_forced: dict[str, Optional[str]] = {"backend": None, "schedule": None}


def _has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


_TRITON = _has_triton()  # looked up once, without importing Triton (and traceable afterwards)


def triton_available() -> bool:
    return _TRITON


def _choice(value: str, allowed, what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not known; allowed: {', '.join(allowed)}")
    return value


def set_backend(name: Optional[str]) -> None:
    """Force the path ("auto", "triton", "cpu", "torch"); None: back to ATTNRES_KERNEL."""
    _forced["backend"] = None if name is None else _choice(name, BACKENDS, "backend")


def set_schedule(name: Optional[str]) -> None:
    """Force the schedule of static-query Block/Full reads; None: back to ATTNRES_SCHEDULE."""
    _forced["schedule"] = None if name is None else _choice(name, SCHEDULES, "schedule")


def backend() -> str:
    return _forced["backend"] or _choice(os.environ.get("ATTNRES_KERNEL", "auto"), BACKENDS, "ATTNRES_KERNEL")


def path(*tensors: torch.Tensor, traceable: bool = True) -> str:
    """"triton", "c" or "torch" for an operation on these tensors (sources and parameters alike:
    the kernels take one type). `traceable`: whether the fused operation is an operator that
    torch.compile can trace (the reads are; mHC's C path and the C RMSNorm are not)."""
    mode, x = backend(), tensors[0]
    if mode == "torch":
        return "torch"
    if mode == "triton":
        if not _TRITON:
            raise RuntimeError("ATTNRES_KERNEL=triton, but Triton is not installed: pip install 'attnres[kernels]'")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 to run on CPU")
        if any(t.dtype not in TRITON_DTYPES for t in tensors):
            raise RuntimeError(f"ATTNRES_KERNEL=triton, but the Triton kernels take {', '.join(map(str, TRITON_DTYPES))} "
                               f"tensors, not {next(t.dtype for t in tensors if t.dtype not in TRITON_DTYPES)}")
        return "triton"
    if x.is_cuda:
        # on CUDA only the reads have kernels; the rest is torch's own (compiled or not)
        fits = traceable and _TRITON and all(t.dtype in TRITON_DTYPES for t in tensors)
        return "triton" if fits and mode == "auto" else "torch"
    compiling = torch.compiler.is_compiling()
    if compiling and (mode == "auto" or not traceable):
        return "torch"  # Inductor fuses the reference; a C call would be an opaque node in its graph
    fits = all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and not torch.is_autocast_enabled("cpu")
    from . import native

    if fits and native.available():
        return "c"
    if mode == "cpu":
        why = "the tensors are not fp32 CPU tensors outside autocast" if not fits else native.why_unavailable()
        raise RuntimeError(f"ATTNRES_KERNEL=cpu, but the C kernels cannot serve this: {why}")
    return "torch"


def two_phase(sources: str, *tensors: torch.Tensor) -> bool:
    """Whether a static-query AttentionResidual with these sources reads in two phases, for reads
    of these tensors (the embedding and a query).
    The defaults follow benchmarks/RESULTS.md: two phases on the C path, and for Full on CUDA; Block
    on CUDA reads once per sublayer. The reference reads one sublayer at a time."""
    if sources not in ("block", "full"):
        return False
    forced = _forced["schedule"] or _choice(os.environ.get("ATTNRES_SCHEDULE", "auto"), SCHEDULES, "ATTNRES_SCHEDULE")
    if forced != "auto":
        return forced == "two_phase"
    where = path(*tensors)
    return where == "c" or (where == "triton" and sources == "full")


__all__ = ["BACKENDS", "SCHEDULES", "backend", "path", "set_backend", "set_schedule", "triton_available", "two_phase"]
