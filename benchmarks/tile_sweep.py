"""Where the fused reads spend their time on a GPU, and how the Triton tile size moves it: op_bench's
work (32 sublayers, S = 4, 16k tokens, d = 2048, bf16, forward + backward of every read).

    python benchmarks/tile_sweep.py                       # CUDA only
    python benchmarks/tile_sweep.py --fwd 2048,8192 --bwd 1024,4096 --reps 5

First one profiled step of each implementation: the kernels' summed time against the step's wall
time (a gap is host overhead: launches, pointer tables, autograd) and its costliest kernels. Then
the step time with each forward tile budget (backward at its default), and each backward budget
(forward at its default): attnres.kernels.triton_kernels.FWD_TILE_ELEMS / BWD_TILE_ELEMS, the
elements of one [readers, rows, head width] fp32 tile a program holds. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from attnres import kernels  # noqa: E402
from benchmarks.model_bench import machine  # noqa: E402
from benchmarks.op_bench import bench, make_inputs, ours  # noqa: E402


def profiled(fn, inputs, top: int) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    emb, outs, queries, gains, grads = inputs
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        hs = fn(emb, outs, queries, gains)
        torch.autograd.backward(hs, grads[: len(hs)])
        torch.cuda.synchronize()
        wall = 1000 * (time.perf_counter() - t)
    rows = sorted(({"name": e.key, "calls": e.count, "ms": e.self_device_time_total / 1000}
                   for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0),
                  key=lambda r: -r["ms"])
    return dict(wall_ms=wall, busy_ms=sum(r["ms"] for r in rows), top=rows[:top])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fwd", default="2048,8192,16384", help="forward tile budgets to try besides the default")
    ap.add_argument("--bwd", default="1024,4096,8192", help="backward tile budgets to try besides the default")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--json", default=str(Path(__file__).parent / "out" / "tile_sweep_cuda.json"))
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and kernels.triton_available()):
        ap.error("needs a CUDA device and Triton (torch.cuda.is_available() is False or Triton is missing)")
    try:
        fwd_budgets, bwd_budgets = ([int(x) for x in a.split(",") if x] for a in (args.fwd, args.bwd))
    except ValueError:
        ap.error(f"--fwd {args.fwd!r} / --bwd {args.bwd!r}: comma-separated whole numbers")
    from attnres.kernels import triton_kernels as tk

    S, L, N, d = 4, 32, 16384, 2048
    inputs = make_inputs(L, N, d, torch.bfloat16, torch.device("cuda"))
    impls = {"fused per read": ours("triton", "per_read", S), "fused two-phase": ours("triton", "two_phase", S)}
    default = (tk.FWD_TILE_ELEMS, tk.BWD_TILE_ELEMS)
    info = dict(machine=machine(), sublayers=L, block_size=S, tokens=N, d=d, reps=args.reps, default=default,
                profiles={}, rows=[])
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, fn in impls.items():
        bench(fn, inputs, 1, 2, True)  # compiles
        prof = info["profiles"][name] = profiled(fn, inputs, args.top)
        print(f"# {name}: profiled step {prof['wall_ms']:.1f} ms, kernels busy {prof['busy_ms']:.1f} ms", flush=True)
        for r in prof["top"]:
            print(f"  {r['ms']:8.2f} ms {r['calls']:5d}x  {r['name'][:90]}", flush=True)
    configs = [default] + [(f, default[1]) for f in fwd_budgets] + [(default[0], b) for b in bwd_budgets]
    print(f"{'fwd elems':>9s} {'bwd elems':>9s} " + " ".join(f"{n:>16s}" for n in impls), flush=True)
    try:
        for fwd, bwd in configs:
            tk.FWD_TILE_ELEMS, tk.BWD_TILE_ELEMS = fwd, bwd
            ms = {name: bench(fn, inputs, args.reps, 2, True)[0] for name, fn in impls.items()}
            info["rows"].append(dict(fwd_tile_elems=fwd, bwd_tile_elems=bwd, ms=ms))
            print(f"{fwd:9d} {bwd:9d} " + " ".join(f"{ms[n]:13.2f} ms" for n in impls), flush=True)
            out.write_text(json.dumps(info, indent=2))
    except KeyboardInterrupt:
        print(f"# interrupted: {len(info['rows'])} of {len(configs)} configurations timed", file=sys.stderr)
    finally:
        tk.FWD_TILE_ELEMS, tk.BWD_TILE_ELEMS = default
        kernels.set_backend(None)
        kernels.set_schedule(None)
    out.write_text(json.dumps(info, indent=2))
    print(f"wrote {out}")
    return info


if __name__ == "__main__":
    main()
