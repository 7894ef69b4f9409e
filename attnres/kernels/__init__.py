"""Fast depth reads: fused kernels (forward and backward) and the PyTorch path, one math.

Which path runs (`use_fused`):
- `ATTNRES_KERNEL=auto` (default): the Triton kernels for CUDA tensors of type fp32/bf16/fp16 when
  Triton imports; the C kernels (csrc/depth_read.c and, for reads of one reader and one head,
  csrc/depth_read_one.c, built on first use with the system C compiler, see native.py) for fp32 CPU tensors in eager mode outside CPU autocast; the PyTorch
  path otherwise (float64, CPU autocast, CPU under torch.compile, no compiler, no Triton);
- `ATTNRES_KERNEL=triton`: the Triton kernels on any device; on CPU they need TRITON_INTERPRET=1
  set before Triton is first used (that is how the tests run them without a GPU);
- `ATTNRES_KERNEL=cpu`: the C kernels (fp32 CPU tensors; an error if they cannot be built);
- `ATTNRES_KERNEL=torch`: the PyTorch path everywhere.
`set_backend(...)` overrides the variable from Python (None: back to the variable). The schedule
of static-query Block and Full reads (`ATTNRES_SCHEDULE` / `set_schedule`) is "two_phase" (the
paper's Algorithm 1, default) or "per_read" (one read per sublayer); see readers.py.
Whichever runs, the model is the same: the paths and schedules are tested against each other and
against `attnres.depth_read`.

Beside the reads, `rms_norm.py` (csrc/rms_norm.c) is the CPU RMSNorm of `attnres.layers.RMSNorm`,
which every variant's sublayers and final norm use under the same rule (`c_kernels_chosen`).

The core imports torch only: Triton is imported when a kernel first runs, never at import time,
and the C kernels are compiled and loaded on their first use.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Callable, Optional, Sequence

import torch

BACKENDS = ("auto", "triton", "cpu", "torch")
SCHEDULES = ("two_phase", "per_read")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_backend: Optional[str] = None
_schedule: Optional[str] = None


def _find_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


_TRITON = _find_triton()  # looked up once, without importing Triton (and traceable afterwards)


def triton_available() -> bool:
    """Whether Triton is installed."""
    return _TRITON


def _choice(value: str, allowed, what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not known; allowed: {', '.join(allowed)}")
    return value


def set_backend(name: Optional[str]) -> None:
    """Force the read path: "auto", "triton", "cpu", "torch", or None to follow ATTNRES_KERNEL."""
    global _backend
    _backend = None if name is None else _choice(name, BACKENDS, "backend")


def backend() -> str:
    return _backend or _choice(os.environ.get("ATTNRES_KERNEL", "auto"), BACKENDS, "ATTNRES_KERNEL")


def set_schedule(name: Optional[str]) -> None:
    """Force the schedule of static-query Block/Full reads: "two_phase", "per_read", or None to
    follow ATTNRES_SCHEDULE."""
    global _schedule
    _schedule = None if name is None else _choice(name, SCHEDULES, "schedule")


def schedule() -> str:
    return _schedule or _choice(os.environ.get("ATTNRES_SCHEDULE", "two_phase"), SCHEDULES, "ATTNRES_SCHEDULE")


def cpu_kernels_available() -> bool:
    """Whether the C kernels of the CPU path build and load here (built on the first call)."""
    from . import cpu_kernels

    return cpu_kernels.available()


def use_fused(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether reads over tensors like x, by a module with parameters like `params`, run a fused
    kernel (Triton or C; see the module docstring) rather than the PyTorch path. The parameters
    count too: the kernels take the queries in the type of the sources (the PyTorch path mixes
    any types, so an fp32 embedding read by a bf16 or float64 module takes it)."""
    mode = backend()
    if mode == "torch":
        return False
    if mode == "triton":
        if not triton_available():
            raise RuntimeError("the Triton read path was requested (ATTNRES_KERNEL=triton or set_backend) but Triton is not installed: pip install 'attnres[kernels]'")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 to run on CPU")
        return True
    if x.is_cuda and mode == "auto":
        return all(t.dtype in _KERNEL_DTYPES for t in (x, *params)) and triton_available()
    from . import native

    return c_kernels_chosen([x, *params], cpu_kernels_available, lambda: native.why_unavailable("depth_read"), traceable=True)


def c_kernels_chosen(tensors, available: Callable[[], bool], why: Callable[[], Optional[str]], *, traceable: bool) -> bool:
    """The one rule for whether a library of C kernels serves these tensors (the depth reads
    here, mHC's stream mixing in residuals/hyper_connections.py): backend "auto" or "cpu"; fp32
    CPU tensors outside CPU autocast; the library built. Under torch.compile, auto leaves the work
    to the PyTorch path, which Inductor fuses (measured faster than the C kernels behind a custom
    op, which it cannot fuse); a forced "cpu" keeps kernels that are a traceable operator. With
    "cpu", tensors they cannot take and a library that cannot be built are errors, not fallbacks."""
    mode = backend()
    if mode not in ("auto", "cpu"):
        return False
    if torch.compiler.is_compiling() and (mode == "auto" or not traceable):
        return False
    ok = all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and not torch.is_autocast_enabled("cpu")
    if mode == "cpu" and not ok:
        bad = next((t for t in tensors if t.device.type != "cpu" or t.dtype != torch.float32), tensors[0])
        raise RuntimeError(f"the C kernels (ATTNRES_KERNEL=cpu) take fp32 CPU tensors outside autocast; got {bad.dtype} on {bad.device}")
    if not ok:
        return False
    if available():
        return True
    if mode == "cpu":
        raise RuntimeError(f"the C kernels (ATTNRES_KERNEL=cpu) could not be built: {why()}")
    return False


def make_reader(res, x: torch.Tensor, want_weights: bool):
    """The read path of AttentionResidual `res` for an embedding like x (see readers.py)."""
    from .readers import FusedReader, TorchReader

    two_phase = schedule() == "two_phase"
    if res.query_kind != "scalar" and use_fused(x, res.output_query):
        return FusedReader(res, x, want_weights, two_phase)
    return TorchReader(res, x, want_weights, two_phase)


def fused_depth_read(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    key_gain: Optional[torch.Tensor] = None,
    *,
    key_norm: bool = True,
    eps: float = 1e-6,
    normaliser: str = "softmax",
    heads: int = 1,
) -> torch.Tensor:
    """`attnres.depth_read` through the fused kernels (same arguments, same result): each
    source's 1/rms by one kernel, then one read kernel over the list of sources. Triton on CUDA
    (or forced), the C kernels on CPU."""
    from ..depth_attention import NORMALISERS
    from . import ops

    _choice(normaliser, NORMALISERS, "normaliser")
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    if heads < 1 or d % heads:
        raise ValueError(f"heads={heads} must be a positive divisor of d_model={d}")
    flat = [s.reshape(-1, d).contiguous() for s in sources]
    q = query * key_gain if (key_gain is not None and key_norm) else query
    per_token = q.dim() > 1
    q = q.reshape(-1, d).contiguous() if per_token else q.reshape(1, d).contiguous()
    rms = [ops.inv_rms(s, eps) for s in flat] if key_norm else []
    out, _ = ops.read(flat, rms, q, None, None, heads, normaliser == "sigmoid", per_token, sources[0].dtype)
    return out[0].view(*lead, d)


__all__ = [
    "BACKENDS", "SCHEDULES", "backend", "cpu_kernels_available", "fused_depth_read", "make_reader",
    "schedule", "set_backend", "set_schedule", "triton_available", "use_fused",
]
