"""Build and load the C kernels of the CPU path (csrc/*.c, one shared library), called through ctypes.

Plain C through ctypes rather than a PyTorch C++ extension: the kernels take raw float pointers,
compile in about a second with `cc` alone (no torch headers, no ninja), and the core keeps its rule
of importing torch only. The library is built once per machine into `$ATTNRES_CACHE_DIR` (else
`$XDG_CACHE_HOME/attnres/kernels`, else `~/.cache/attnres/kernels`), under a name hashed from the
sources, the flags, the compiler and this CPU's features (the build uses -march=native), written to
a temporary name and renamed, so concurrent jobs never load a half-written file. Where torch's
OpenMP runtime is GNU libgomp (the Linux wheels) the kernels are built with -fopenmp, so their
threads are torch's own (torch.set_num_threads governs them). Without a compiler, or if the build
fails, `available()` is False and the reference serves the CPU.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

CSRC = Path(__file__).with_name("csrc")
# Reassociation lets the compiler vectorise the reductions (rounded as a BLAS's are); NaN and
# infinity keep their meaning (exp(-inf) = 0 is used), so no -ffast-math.
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-fopenmp-simd", "-std=c11", "-shared", "-fPIC"]
MIN_TOKENS_PER_THREAD = 256  # below this a thread's share costs more to hand out than it saves

P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_signatures: dict[str, list] = {}  # C function -> argument types, declared by the wrappers
_state: dict[str, object] = {}


def declare(signatures: dict[str, list]) -> None:
    """Argument types of C functions (every kernel returns an int status), set when the library loads."""
    _signatures.update(signatures)


def cache_dir() -> Path:
    if os.environ.get("ATTNRES_CACHE_DIR"):
        return Path(os.environ["ATTNRES_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnres" / "kernels"


def compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor() or platform.machine()


def _openmp_flags(version: str) -> list[str]:
    """-fopenmp where the kernels can share torch's libgomp (GCC; clang's would bring libomp, a
    second set of threads competing for the cores)."""
    torch_gomp = sys.platform.startswith("linux") and (Path(torch.__file__).parent / "lib" / "libgomp.so.1").exists()
    return ["-fopenmp"] if torch_gomp and "clang" not in version.lower() else []


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout.split("\n")[0]
    sources = sorted(CSRC.glob("*.c"))
    texts = [p.read_text() for p in sources + sorted(CSRC.glob("*.h"))]
    last_error = None
    for flags in (FLAGS + _openmp_flags(version), FLAGS):  # a compiler without OpenMP: the same kernels, one thread
        key = hashlib.sha256("\0".join([*texts, " ".join(flags), version, _cpu_features()]).encode()).hexdigest()[:16]
        target = cache_dir() / f"attnres-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, *map(str, sources), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                os.replace(tmp, target)
                return target
            lines = done.stderr.strip().splitlines()
            last_error = f"{cc} failed: {lines[-1] if lines else done.returncode}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(last_error)


def library() -> Optional[ctypes.CDLL]:
    """The compiled kernels (built on first use), or None if they cannot be built here."""
    if "lib" not in _state:
        lib, cc = None, compiler()
        if cc is None:
            _state["why"] = "no C compiler found (set CC, or install cc, gcc or clang)"
        else:
            try:
                lib = ctypes.CDLL(str(_build(cc)))
                for name, argtypes in _signatures.items():
                    getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, ctypes.c_int
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                _state["why"] = str(err)
                lib = None
        _state["lib"] = lib
    return _state["lib"]


def available() -> bool:
    return library() is not None


def why_unavailable() -> Optional[str]:
    return _state.get("why")


def call(name: str, *args) -> None:
    """Call C function `name`; a non-zero status means its scratch could not be allocated."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the C kernels could not be built: {why_unavailable()}")
    if getattr(lib, name)(*args):
        raise MemoryError(f"{name}: out of memory for the kernel's scratch")


def threads(tokens: int) -> int:
    """Threads a call splits its tokens over: torch's (torch.set_num_threads), at most one per
    MIN_TOKENS_PER_THREAD tokens; one in a process forked after OpenMP's pool may have started
    (libgomp's pool does not survive a fork)."""
    if _state.get("forked"):
        return 1
    return max(1, min(torch.get_num_threads(), tokens // MIN_TOKENS_PER_THREAD))


os.register_at_fork(after_in_child=lambda: _state.__setitem__("forked", True))


def check_fp32_cpu(what: str, *tensors) -> None:
    """One clear error instead of a crash: the kernels read raw contiguous fp32 memory."""
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"):
            raise ValueError(f"{what}: the C kernels take contiguous fp32 CPU tensors, got {t.dtype} on {t.device} "
                             f"(contiguous={t.is_contiguous()})")


def ptr(t: Optional[torch.Tensor]):
    """The data pointer of t, or None (NULL) for an absent optional argument."""
    return t.data_ptr() if t is not None else None


def ptrs(tensors) -> Optional[ctypes.Array]:
    """A C array of the tensors' data pointers (NULL when empty)."""
    return (P * len(tensors))(*[t.data_ptr() for t in tensors]) if len(tensors) else None
