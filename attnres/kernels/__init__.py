"""Which implementation of a depth read (and of mHC's stream mixing) runs: decided here only.

- "triton": the Triton kernels, for CUDA tensors of fp32/bf16/fp16 when Triton is installed;
- "c": the C kernels (csrc/, built on first use with the system compiler), for fp32 CPU tensors
  in eager mode outside CPU autocast;
- "torch": the reference (attnres.depth_attention), everywhere else: float64, CPU autocast, CPU
  under torch.compile (Inductor fuses the reference there), no compiler, no Triton.

`ATTNRES_KERNEL=auto|triton|cpu|torch` (or `set_backend`) forces one; a forced path that cannot
serve the tensors is an error, not a fallback. Forced "triton" runs on CPU under
`TRITON_INTERPRET=1`, which is how the tests run the GPU kernels without a GPU.

`plan` is what a residual asks once per forward: the kernel set for its reads and, for static-query
Block and Full, the schedule: the paper's two-phase computation (docs/MATH.md) or one read per
sublayer (`ATTNRES_SCHEDULE=auto|two_phase|per_read` or `set_schedule` forces one). Every kernel
set and schedule computes the same function.
"""
from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple, Optional

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


def schedule() -> str:
    return _forced["schedule"] or _choice(os.environ.get("ATTNRES_SCHEDULE", "auto"), SCHEDULES, "ATTNRES_SCHEDULE")


class Plan(NamedTuple):
    kernel: str  # "triton", "c" or "torch", as `path` decides
    two_phase: bool  # static-query Block/Full: the two-phase schedule instead of one read per sublayer


def plan(sources: Optional[str], *tensors: torch.Tensor, traceable: bool = True, weights: bool = False) -> Plan:
    """How a residual's reads run for one forward over these tensors (the embedding and a parameter).
    `sources`: "block" or "full" for static-query Block and Full AttnRes (which have a schedule to
    choose), else None; `weights`: the depth weights are wanted, which only the reference returns.
    Two phases by default on the C kernels, and for Full on Triton: the faster schedule there."""
    kernel = "torch" if weights else path(*tensors, traceable=traceable)
    if sources not in ("block", "full") or weights:
        return Plan(kernel, False)
    forced = schedule()
    if forced != "auto":
        return Plan(kernel, forced == "two_phase")
    return Plan(kernel, kernel == "c" or (kernel == "triton" and sources == "full"))


__all__ = ["BACKENDS", "SCHEDULES", "Plan", "backend", "path", "plan", "schedule", "set_backend", "set_schedule",
           "triton_available"]
