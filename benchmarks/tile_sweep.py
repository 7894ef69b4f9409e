"""Where the fused reads spend their time on a GPU, and how the Triton knobs move it: op_bench's
work (32 sublayers, S = 4, 16k tokens, d = 2048, bf16, forward + backward of every read).

    python benchmarks/tile_sweep.py                       # CUDA only
    python benchmarks/tile_sweep.py --reader-groups 1,2,4 --reps 5
    python benchmarks/tile_sweep.py --triton BWD_DQ_SECOND_PASS=false --config PREFETCH=false   # knobs moved together

One profiled step per implementation (kernel time against wall time: the gap is host overhead),
then each switch and reader group of attnres.kernels.triton_kernels moved from the defaults alone
(--config: several together), timing the step and the read kernels; tiles, warps and programs per
SM are the autotuner's, and each row records what it chose. Prints
a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from attnres import kernels  # noqa: E402
from benchmarks.model_bench import kernel_times, machine, parse_triton_knobs, set_triton_knobs  # noqa: E402
from benchmarks.op_bench import bench, make_inputs, ours  # noqa: E402


def profiled(fn, inputs, top: int, steps: int = 1) -> dict:
    """`steps` steps under the profiler, per step: wall time, summed kernel time, the forward and
    backward read kernels' time (which, unlike the step's wall time here, host noise leaves alone),
    and the `top` costliest kernels."""
    emb, outs, queries, gains, grads = inputs

    def step():
        hs = fn(emb, outs, queries, gains)
        torch.autograd.backward(hs, grads[: len(hs)])

    wall_ms, rows = kernel_times(step, True, steps)
    return dict(wall_ms=wall_ms, busy_ms=sum(r["ms"] for r in rows),
                read_fwd_ms=sum(r["ms"] for r in rows if r["name"] == "_read_fwd_kernel"),
                read_bwd_ms=sum(r["ms"] for r in rows if r["name"] == "_read_bwd_kernel"), top=rows[:top])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reader-groups", default="1,2,none", help="readers per launch to try besides the default "
                    "(none: all of a read's readers in one launch)")
    ap.add_argument("--triton", action="append", default=[], metavar="NAME=VALUE",
                    help="a knob's value for every configuration, the defaults' row included (model_bench's option)")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=VALUE,...",
                    help="time these configurations (knobs moved from the defaults together) instead of "
                         "moving one knob at a time; repeatable")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--json", default=str(Path(__file__).parent / "out" / "tile_sweep_cuda.json"))
    args = ap.parse_args(argv)
    try:
        groups = [None if x == "none" else int(x) for x in args.reader_groups.split(",") if x]
    except ValueError:
        groups = [0]
    if any(g is not None and g < 1 for g in groups):
        ap.error(f"--reader-groups {args.reader_groups!r}: allowed: comma-separated whole numbers from 1, or none")
    if not kernels.triton_available():
        ap.error("needs Triton (pip install triton)")
    from attnres.kernels import triton_kernels as tk

    set_triton_knobs(args.triton, ap.error)
    default = {k: getattr(tk, k) for k in tk.KNOBS}
    together = [parse_triton_knobs(c.split(","), ap.error, "--config") for c in args.config]
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (torch.cuda.is_available() is False)")

    S, L, N, d = 4, 32, 16384, 2048
    inputs = make_inputs(L, N, d, torch.bfloat16, torch.device("cuda"))
    impls = {"fused per read": ours("triton", "per_read", S), "fused two-phase": ours("triton", "two_phase", S)}
    info = dict(machine=machine(), sublayers=L, block_size=S, tokens=N, d=d, reps=args.reps, default=default,
                profiles={}, rows=[])
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The switches first (the untimed ones lead): a stage stopped at its time limit has timed them.
    tried = {**{k: [not default[k]] for k in tk.SWITCHES}, "READER_GROUP": groups}
    configs = [default] + ([{**default, **c} for c in together] if together else
                           [{**default, k: v} for k, values in tried.items() for v in values if v != default[k]])
    sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a time limit stops it as Ctrl-C
    try:
        for name, fn in impls.items():
            bench(fn, inputs, 1, 2, True)  # compiles
            prof = info["profiles"][name] = profiled(fn, inputs, args.top)
            print(f"# {name}: profiled step {prof['wall_ms']:.1f} ms, kernels busy {prof['busy_ms']:.1f} ms",
                  flush=True)
            for r in prof["top"]:
                print(f"  {r['ms']:8.2f} ms {r['calls']:5d}x  {r['name'][:90]}", flush=True)
        # Per implementation: the step's median wall time, then the read kernels' time, forward/backward.
        print(f"{'knobs moved from the defaults':40s} " + " ".join(f"{n + ': step, fwd/bwd ms':>38s}" for n in impls),
              flush=True)
        for config in configs:
            moved = {k: v for k, v in config.items() if v != default[k]}
            row = dict(knobs=config, moved=moved, ms={}, read_fwd_ms={}, read_bwd_ms={})
            for name, fn in impls.items():
                with tk.knobs(**config):
                    row["ms"][name] = bench(fn, inputs, args.reps, 2, True)[0]
                    prof = profiled(fn, inputs, 0, steps=3)
                row["read_fwd_ms"][name], row["read_bwd_ms"][name] = prof["read_fwd_ms"], prof["read_bwd_ms"]
            row["autotuned"] = tk.chosen()
            info["rows"].append(row)
            label = ", ".join(f"{k}={v}" for k, v in moved.items()) or "defaults"
            print(f"{label:40s} " + " ".join(
                f"{row['ms'][n]:20.2f} {row['read_fwd_ms'][n]:7.2f}/{row['read_bwd_ms'][n]:<7.2f}" for n in impls), flush=True)
            out.write_text(json.dumps(info, indent=2))
    except KeyboardInterrupt:
        print(f"# interrupted: {len(info['rows'])} of {len(configs)} configurations timed", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        kernels.set_backend(None)
        kernels.set_schedule(None)
    out.write_text(json.dumps(info, indent=2))
    print(f"wrote {out}")
    return info


if __name__ == "__main__":
    main()
