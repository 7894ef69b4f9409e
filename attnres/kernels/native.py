"""Build and load the C kernels of the CPU path (`csrc/*.c`), once per machine, with the system C
compiler; called through ctypes.

Why plain C through ctypes rather than a PyTorch C++ extension: the kernels take raw float
pointers and need nothing from ATen, so they compile in well under a second with `cc` alone (a
C++ extension compiles torch's headers for a minute and needs ninja), and the core keeps its rule
of importing torch (and optionally Triton) only. Triton itself needs the same C compiler for its
launchers, so a machine that runs the GPU path can build these too.

Cache: `$ATTNRES_CACHE_DIR`, else `$XDG_CACHE_HOME/attnres/kernels`, else `~/.cache/attnres/kernels`. The file
name carries a hash of the source and the headers it includes, the flags, the compiler's version and this CPU's feature
flags (the build uses -march=native), so a shared home directory on a mixed cluster never hands
one node another's binary. Builds write to a temporary name and rename, so concurrent jobs of a
multirun never load a half-written library.

OpenMP (`OPENMP_LIBRARIES`): where torch's own OpenMP runtime is GNU libgomp, loaded from torch's
lib folder as libgomp.so.1 (the Linux wheels), the kernels are built with -fopenmp. Their
dependency on libgomp.so.1 then binds to that already loaded copy, so their parallel regions run on
the same worker threads as torch's ops and follow torch.set_num_threads; a second OpenMP runtime
would bring a second set of threads competing for the cores. Anywhere else (clang, whose
-fopenmp links its own libomp, included), or if the compiler cannot build with -fopenmp, they are
built without it and run on the calling thread.

If there is no compiler, or the build fails, `load` returns None and `why_unavailable` says why:
the automatic backend then uses the PyTorch path (attnres.kernels).
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
# Reassociation lets the compiler vectorise the dot products' reductions (the rounding differs
# from a sequential sum as a BLAS's does); NaN and infinity semantics are kept (-inf is a real
# value here: exp(-inf) = 0), so no -ffast-math.
FLAGS = [
    "-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
    "-fno-trapping-math", "-fopenmp-simd", "-std=c11", "-shared", "-fPIC",
]

# Libraries whose parallel regions share torch's OpenMP threads (see the module docstring).
OPENMP_LIBRARIES = ("depth_read", "depth_read_one", "streams", "rms_norm")

_loaded: dict[str, Optional[ctypes.CDLL]] = {}
_errors: dict[str, str] = {}


def cache_dir() -> Path:
    if os.environ.get("ATTNRES_CACHE_DIR"):
        return Path(os.environ["ATTNRES_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnres" / "kernels"


def compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_uses_libgomp() -> bool:
    """Whether torch's OpenMP runtime is GNU libgomp from torch's own lib folder (soname libgomp.so.1)."""
    return sys.platform.startswith("linux") and (Path(torch.__file__).parent / "lib" / "libgomp.so.1").exists()


def _build(name: str, cc: str, source: Optional[Path] = None) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout.split("\n")[0]
    source = source or CSRC / f"{name}.c"
    # GCC's -fopenmp links libgomp; clang's would link libomp, a second runtime beside torch's.
    if name in OPENMP_LIBRARIES and torch_uses_libgomp() and "clang" not in version.lower():
        try:
            return _build_with(name, source, cc, version, FLAGS + ["-fopenmp"])
        except (RuntimeError, subprocess.SubprocessError):
            pass  # a compiler without OpenMP: the same kernels, on the calling thread
    return _build_with(name, source, cc, version, FLAGS)


def _build_with(name: str, source: Path, cc: str, version: str, flags: list[str]) -> Path:
    headers = [h.read_text() for h in sorted(CSRC.glob("*.h"))]  # what the sources include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(flags), version, _cpu_identity()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        # -I: a source from elsewhere (build_from) includes the headers of csrc/, as the key says
        done = subprocess.run([cc, *flags, f"-I{CSRC}", str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(name: str) -> Optional[ctypes.CDLL]:
    """The compiled library csrc/<name>.c (built on first use), or None if it cannot be built."""
    if name in _loaded:
        return _loaded[name]
    lib = None
    cc = compiler()
    if os.environ.get("ATTNRES_NATIVE", "1") == "0":
        _errors[name] = "ATTNRES_NATIVE=0"
    elif cc is None:
        _errors[name] = "no C compiler found (set CC, or install cc/gcc/clang)"
    else:
        try:
            lib = ctypes.CDLL(str(_build(name, cc)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            _errors[name] = str(err)
    _loaded[name] = lib
    return lib


def build_from(name: str, source: Path) -> ctypes.CDLL:
    """The library `name` built from another source file (with the headers of csrc/, the same
    flags and cache), for measuring one version of a kernel against another in one process
    (benchmarks/cpu_kernel_bench.py --against); `install` makes it the one the wrappers call.
    Raises RuntimeError if there is no compiler or the build fails."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install cc/gcc/clang)")
    return ctypes.CDLL(str(_build(name, cc, Path(source))))


def install(name: str, lib: Optional[ctypes.CDLL]) -> None:
    """Make `lib` the library `load(name)` returns from now on (`bind` sets its argument types at
    the next call). The caller keeps the one it replaces (`load(name)` before) to put it back."""
    _loaded[name] = lib


def bind(name: str, signatures: dict) -> Optional[ctypes.CDLL]:
    """`load(name)` with the argument types of its functions set ({function: [ctypes types]};
    every kernel returns an int status), or None if it cannot be built."""
    lib = load(name)
    if lib is not None and not getattr(lib, "_attnres_bound", False):
        for function, argtypes in signatures.items():
            getattr(lib, function).argtypes = argtypes
            getattr(lib, function).restype = ctypes.c_int
        lib._attnres_bound = True
    return lib


def require(name: str, signatures: dict, what: str) -> ctypes.CDLL:
    """`bind`, or a RuntimeError saying why the library could not be built."""
    lib = bind(name, signatures)
    if lib is None:
        raise RuntimeError(f"the C kernels of {what} could not be built: {why_unavailable(name)}")
    return lib


def why_unavailable(name: str) -> Optional[str]:
    """Why `load(name)` returned None (None if it loaded or was not tried)."""
    return _errors.get(name)


# --- arguments of the ctypes calls, shared by the wrappers (cpu_kernels.py, cpu_streams.py, rms_norm.py) -------

MIN_TOKENS_PER_THREAD = 256  # below this a thread's share costs more to hand out than it saves


def threads(tokens: Optional[int] = None) -> int:
    """Threads a kernel call splits its tokens over: ATTNRES_CPU_THREADS, a positive integer or
    "auto"; unset or "auto": torch.get_num_threads(), so that torch.set_num_threads governs the
    kernels like torch's own ops. With `tokens`, no more than one thread per
    MIN_TOKENS_PER_THREAD of them. One in a process forked after OpenMP's pool may have started:
    libgomp's pool does not survive a fork (torch's own ops hang there too)."""
    value = os.environ.get("ATTNRES_CPU_THREADS", "auto").strip()
    if value != "auto" and (not value.isdigit() or int(value) < 1):
        raise ValueError(f"ATTNRES_CPU_THREADS={value!r} is not allowed; allowed: a positive integer or 'auto'")
    if _forked:
        return 1
    k = torch.get_num_threads() if value == "auto" else int(value)
    return k if tokens is None else max(1, min(k, tokens // MIN_TOKENS_PER_THREAD))


def _after_fork() -> None:
    global _forked
    _forked = True


_forked = False  # this process is a fork (see threads)
os.register_at_fork(after_in_child=_after_fork)


def check_fp32_cpu(what: str, *tensors) -> None:
    """One clear error instead of a crash: the kernels read raw contiguous fp32 memory."""
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"):
            raise ValueError(f"{what}: the C kernels take contiguous fp32 CPU tensors, got {t.dtype} on {t.device} (contiguous={t.is_contiguous()})")


def ptr(t: Optional[torch.Tensor]):
    """The data pointer of t, or None (NULL) for an absent optional argument."""
    return t.data_ptr() if t is not None else None
