"""Registers, spills, barriers and an occupancy estimate of every Triton kernel one training step of
a model launches, compiled for a GPU architecture on a machine without one (default sm_90a).

    python benchmarks/kernel_resources.py                                  # block, the 194m shape
    python benchmarks/kernel_resources.py --variant full --d-model 2048 --heads 16
    python benchmarks/kernel_resources.py --triton PREFETCH=false           # any knob of the kernels

A stand-in for Triton's driver compiles each launch (counts from the cubin) and runs nothing.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

REGS_PER_SM, SMEM_PER_SM, MAX_PROGRAMS, MAX_WARPS = 65536, 228 * 1024, 32, 64  # sm_90's limits


class _StandInDriver:
    """What JITFunction.run asks of the active driver before it compiles."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True

    def get_active_torch_device(self):
        return torch.device("cpu")


def compile_only(arch: int) -> dict:
    """From now on in this process, Triton launches compile for sm_<arch> and run nothing; returns
    the dict that fills with (kernel name, constexprs, warps) -> compiled kernel."""
    import triton
    from triton.runtime import driver, jit

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_resources: TRITON_INTERPRET=1 is set; allowed: unset (it compiles, not interprets)")
    try:
        from triton.backends.compiler import GPUTarget

        # Triton internals (set_active, JITFunction.run): checked with Triton 3.6 and 3.9.
        driver.set_active(_StandInDriver(GPUTarget("cuda", arch, 32)))
        jit.JITFunction.run  # noqa: B018 (the method replaced below)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"kernel_resources: Triton {triton.__version__} lacks an internal this tool uses ({e}); "
                         "checked with Triton 3.6 and 3.9") from None
    compiled, run = {}, jit.JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        constexprs = tuple(sorted((k, v) for k, v in kwargs.items() if k.isupper()))
        compiled.setdefault((self.fn.__name__, constexprs, kwargs.get("num_warps", 4)), kernel)
        return kernel

    jit.JITFunction.run = compile_launch
    from attnres.kernels import triton_kernels as tk

    # every autotuning candidate is compiled (and reported), none timed: the first is kept
    tk._bench = lambda kernel_call, quantiles: (kernel_call(), [1.0] * len(quantiles))[1]
    for kernel in (tk._read_fwd_kernel, tk._read_bwd_kernel):
        kernel.cache_results = False  # a choice on disk from an earlier run would skip the candidates
    compiled["_tools"] = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return compiled


def resources(kernel, tools: str, warps: int) -> dict:
    """What the compiled cubin's resource table says (cuobjdump, bundled with Triton), and the
    barriers in its PTX (one per cross-warp reduction or layout change)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        done = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", str(cubin)],
                              capture_output=True, text=True, check=True)
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", done.stdout))
    regs = int(usage["REG"])
    shared = int(getattr(kernel.metadata, "shared", 0) or 0)
    by_regs = REGS_PER_SM // max(1, regs * 32 * warps)
    by_smem = SMEM_PER_SM // shared if shared else MAX_PROGRAMS
    programs = min(by_regs, by_smem, MAX_PROGRAMS, MAX_WARPS // warps)
    return dict(registers=regs, local_bytes=int(usage.get("LOCAL", 0)) + int(usage.get("STACK", 0)),
                shared_bytes=shared, barriers=kernel.asm["ptx"].count("bar.sync"),
                programs_per_sm=programs, occupancy=programs * warps / MAX_WARPS)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="block")
    ap.add_argument("--d-model", type=int, default=896)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--layers", type=int, default=3, help="Transformer blocks (the kernels depend on S, not on depth)")
    ap.add_argument("--block-size", type=int, default=3, help="S (3: the 194m preset's 8 blocks of 24 sublayers)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--arch", type=int, default=90, help="compute capability ×10 (90: H100/H200)")
    ap.add_argument("--triton", action="append", default=[], metavar="NAME=VALUE",
                    help="set a knob of the Triton kernels for this run, as model_bench.py --triton; repeatable")
    args = ap.parse_args(argv)
    from attnres import VARIANTS, DecoderLM, ModelConfig, ResidualConfig, kernels

    if args.variant not in VARIANTS:
        ap.error(f"--variant {args.variant}: unknown; allowed: {', '.join(VARIANTS)}")
    if not kernels.triton_available():
        ap.error("Triton is not installed (pip install triton)")
    compiled = compile_only(args.arch)
    from attnres.kernels import triton_kernels as tk
    from benchmarks.model_bench import set_triton_knobs

    set_triton_knobs(args.triton, ap.error)

    os.environ["TRITON_INTERPRET"] = "1"  # read by use_fused alone: lets the Triton path take CPU tensors
    kernels.set_backend("triton")
    try:
        cfg = ModelConfig(vocab_size=64, d_model=args.d_model, layers=args.layers, n_heads=args.heads, max_seq_len=8)
        model = DecoderLM(cfg, ResidualConfig(name=args.variant, block_size=args.block_size))
        model = model.to(getattr(torch, args.dtype))
        idx = torch.randint(0, 64, (1, 8))
        _, loss = model(idx, idx)
        loss.float().backward()
    except ValueError as e:
        ap.error(str(e))
    finally:
        del os.environ["TRITON_INTERPRET"]
        kernels.set_backend(None)
    tools = compiled.pop("_tools")
    rows = []
    print(f"# {args.variant}, d_model {args.d_model}, {args.heads} heads, S {args.block_size}, {args.dtype}, "
          f"sm_{args.arch}a; every autotuning candidate (tiles fwd {tk.FWD_TILE} / bwd {tk.BWD_TILE} elements)")
    print(f"{'kernel':22s} {'specialisation':44s} {'warps':>5s} {'regs':>5s} {'local B':>7s} {'barriers':>8s} "
          f"{'progs/SM':>8s} {'occupancy':>9s}")
    for (name, constexprs, warps), kernel in sorted(compiled.items(), key=lambda kv: kv[0][0]):
        spec = {k: v for k, v in constexprs if k in ("R", "R_PAD", "BLOCK_T", "W_PAD", "HAS_INIT", "ACCUMULATE",
                                                      "DQ_SECOND_PASS", "D_PAD")}
        row = dict(kernel=name, spec=spec, warps=warps, **resources(kernel, tools, warps))
        rows.append(row)
        text = " ".join(f"{k}={v}" for k, v in spec.items())
        print(f"{name:22s} {text:44s} {warps:5d} {row['registers']:5d} {row['local_bytes']:7d} {row['barriers']:8d} "
              f"{row['programs_per_sm']:8d} {row['occupancy']:9.0%}")
    return rows


if __name__ == "__main__":
    main()
