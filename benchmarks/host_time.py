"""Host time of op_bench's step on the Triton path, without a GPU: every kernel is compiled for a
GPU architecture (kernel_resources' stand-in driver) and launched as a no-op, so what is timed is
what the host does per step (Python, autograd, wrappers, allocations, Triton's launcher).

    python benchmarks/host_time.py                     # both schedules, op_bench's 32 sublayers, S = 4, d 2048
    python benchmarks/host_time.py --profile 20        # and the 20 costliest functions (cProfile)
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sublayers", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=16, help="few: the CPU arithmetic on them is not the point")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--arch", type=int, default=90, help="compute capability ×10 the kernels are compiled for")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest functions of 10 steps")
    args = ap.parse_args(argv)
    from attnres import kernels
    from benchmarks.kernel_resources import compile_only
    from benchmarks.op_bench import bench, make_inputs, ours

    if not kernels.triton_available():
        ap.error("Triton is not installed (pip install triton)")
    torch.set_num_threads(1)
    compiled = compile_only(args.arch)  # exits with one line if TRITON_INTERPRET=1 is set or Triton lacks an internal
    from attnres.kernels import triton_kernels  # noqa: F401  (imported without the interpreter: GPU tile sizes)

    os.environ["TRITON_INTERPRET"] = "1"  # read by use_fused alone: lets the Triton path take CPU tensors
    inputs = make_inputs(args.sublayers, args.tokens, args.d, torch.bfloat16, torch.device("cpu"))
    result = {"ms": {}}
    try:
        for schedule in ("two_phase", "per_read"):
            fn = ours("triton", schedule, args.block_size)
            ms = bench(fn, inputs, args.reps, 3, False)[0]  # the warm-up steps compile
            result["ms"][schedule] = ms
            print(f"{schedule:9s}: host {ms:6.2f} ms a step ({args.sublayers + 1} reads, forward and backward)", flush=True)
            if args.profile:
                profile = cProfile.Profile()
                profile.runcall(bench, fn, inputs, 10, 0, False)
                pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    finally:
        del os.environ["TRITON_INTERPRET"]
        kernels.set_backend(None)
        kernels.set_schedule(None)
    result["kernels"] = sorted({key[0] for key in compiled if key != "_tools"})
    return result


if __name__ == "__main__":
    main()
