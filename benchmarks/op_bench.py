"""Op-level benchmark: the depth reads of one training step of Block AttnRes, forward + backward,
raced across implementations on the same shapes, with peak memory.

    python benchmarks/op_bench.py                       # GPU: 32 sublayers, S=4, 16k tokens, d=2048, bf16
    python benchmarks/op_bench.py --tokens 4096 --d 128 --dtype float32   # the CPU-sized race

Implementations: our fused kernels (two-phase and per read), our PyTorch path, the eager and
compiled reference (`attnres.depth_read`), and fla-core's `fused_attnres` when installed (CUDA).
Medians over repeated steps; the JSON is rewritten after each implementation, so a run cut short
keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import openmp  # noqa: E402

openmp.set_wait_policy()  # as run.py trains: before torch loads OpenMP (a short spin; harness/openmp.py)
import torch  # noqa: E402

from attnres import AttentionResidual, depth_read, kernels  # noqa: E402
from benchmarks.model_bench import machine  # noqa: E402


def make_inputs(L, N, d, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    emb = torch.randn(N, d, generator=g).to(device, dtype).requires_grad_()
    outs = [(torch.randn(N, d, generator=g) / L**0.5).to(device, dtype).requires_grad_() for _ in range(L)]
    queries = (0.1 * torch.randn(L + 1, d, generator=g)).to(device).requires_grad_()
    gains = (1 + 0.1 * torch.randn(L + 1, d, generator=g)).to(device).requires_grad_()
    grads = [torch.randn(N, d, generator=g).to(device, dtype) for _ in range(L + 1)]
    return emb, outs, queries, gains, grads


def schedule_reads(read, emb, outs, queries, gains, S):
    """The Block AttnRes schedule with a pluggable read(q, sources, gain) -> h."""
    L = len(outs)
    blocks, partial, hs = [emb], None, []
    for l in range(L):
        hs.append(read(queries[l], blocks + ([partial] if partial is not None else []), gains[l]))
        partial = outs[l] if partial is None else partial + outs[l]
        if (l + 1) % S == 0 or l == L - 1:
            blocks.append(partial)
            partial = None
    hs.append(read(queries[L], blocks, gains[L]))
    return hs


class _Given(torch.nn.Module):
    """Stands in for sublayer l: returns the given output and records the input it was given."""

    def __init__(self, v, seen):
        super().__init__()
        self.v, self.seen = v, seen

    def forward(self, h):
        self.seen.append(h)
        return self.v


def ours(backend: str, schedule: str, S: int):
    modules = {}  # built once, at the first step: building one is not the reads' work (fla's row builds nothing)

    def run(emb, outs, queries, gains):
        kernels.set_backend(backend)
        kernels.set_schedule(schedule)
        L, d = len(outs), emb.shape[-1]
        res = modules.get((L, d, emb.device))
        if res is None:
            res = modules[L, d, emb.device] = AttentionResidual(d, L, sources="block", block_size=S).to(emb.device)
            del res.pseudo_queries, res.output_query
            for norm in list(res.key_norms) + [res.output_norm]:
                del norm.weight
        # The module's parameters become views of the benchmark's queries and gains, taken anew
        # each step, so that the gradients reach the same leaves as in the other implementations.
        res.pseudo_queries, res.output_query = queries[:L], queries[L]
        for l, norm in enumerate(list(res.key_norms) + [res.output_norm]):
            norm.weight = gains[l]
        seen = []
        out = res(emb, [_Given(v, seen) for v in outs])
        return seen + [out]

    return run


def reference(read, S: int):
    def run(emb, outs, queries, gains):
        return schedule_reads(read, emb, outs, queries, gains, S)

    return run


def fla_read():
    from fla.ops.attnres import fused_attnres

    return lambda q, srcs, g: fused_attnres(q, list(srcs), g, rms_eps=1e-6)


def bench(fn, inputs, reps, warmup, cuda):
    emb, outs, queries, gains, grads = inputs
    leaves = [emb, *outs, queries, gains]

    def step():
        for t in leaves:
            t.grad = None
        hs = fn(emb, outs, queries, gains)
        torch.autograd.backward(hs, grads[: len(hs)])

    for _ in range(warmup):
        step()
    times = []
    peak = None
    if cuda:
        for t in leaves:  # the last warm-up step's gradients are the step's output, not an input
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(reps):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - t))
    if cuda:
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(times), peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--sublayers", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16384 if cuda else 4096)
    ap.add_argument("--d", type=int, default=2048 if cuda else 128)
    ap.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    ap.add_argument("--reps", type=int, default=20 if cuda else 5)
    ap.add_argument("--warmup", type=int, default=3 if cuda else 1)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--only", help="comma-separated implementation names")
    ap.add_argument("--json", help="output path (default benchmarks/out/op_bench_<device>.json, ignored by git)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    S, L, N, d = args.block_size, args.sublayers, args.tokens, args.d

    # In the order they run: the eager reference (every row's max|Δ| is against it), then what the
    # op-level bar compares (our fused Block schedule, fla-core), then the compiled reference, so a
    # run stopped at its time limit has the comparisons that matter.
    impls = {"reference eager": reference(depth_read, S)}
    fused = "triton" if cuda and kernels.triton_available() else None
    if not cuda and dtype == torch.float32 and kernels.path(torch.zeros(1)) == "c":
        fused = "cpu"
    if fused:
        impls["fused two-phase"] = ours(fused, "two_phase", S)
    if cuda:
        try:
            impls["fla fused_attnres"] = reference(fla_read(), S)
        except ImportError as e:
            print(f"# fla-core not available ({e}); pip install fla-core einops to race it")
    if fused:
        impls["fused per read"] = ours(fused, "per_read", S)
    # One graph per distinct number of sources (a read sees 1 to N+1 of them), with and without grad.
    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
    impls["reference compiled"] = reference(torch.compile(depth_read, dynamic=False), S)
    impls["torch path two-phase"] = ours("torch", "two_phase", S)
    impls["torch path per read"] = ours("torch", "per_read", S)
    if args.only:
        keep = [k for k in args.only.split(",") if k]
        unknown = [k for k in keep if k not in impls]
        if unknown:
            ap.error(f"--only: no implementation {', '.join(map(repr, unknown))} here; allowed: {', '.join(impls)}")
        impls = {k: v for k, v in impls.items() if k in keep}

    inputs = make_inputs(L, N, d, dtype, device)
    info = dict(machine=machine(), device=str(device), dtype=args.dtype, sublayers=L, block_size=S, tokens=N, d=d,
                reps=args.reps, rows=[])
    rows = info["rows"]
    out = Path(args.json) if args.json else Path(__file__).parent / "out" / f"op_bench_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Every implementation computes the same outputs (checked loosely: bf16 rounding).
    with torch.no_grad():
        ref = torch.stack([h.float() for h in reference(depth_read, S)(*inputs[:4])])
    for name, fn in impls.items():
        with torch.no_grad():
            err = (torch.stack([h.float() for h in fn(*inputs[:4])]) - ref).abs().max().item()
        ms, peak = bench(fn, inputs, args.reps, args.warmup, cuda)
        rows.append(dict(impl=name, ms=ms, peak_mib=peak, max_abs_diff_vs_reference=err))
        print(f"{name:24s} {ms:9.2f} ms  " + (f"{peak:9.1f} MiB  " if peak is not None else "") + f"max|Δ| {err:.2e}", flush=True)
        out.write_text(json.dumps(info, indent=2))
    kernels.set_backend(None)
    kernels.set_schedule(None)

    base = next((r["ms"] for r in rows if r["impl"] == "reference eager"), None)
    print(f"\n# {machine()['cpu']} ({machine().get('gpu', 'no GPU')}), {device}, {args.dtype}: "
          f"{L} sublayers, S={S}, {N} tokens, d={d}; forward+backward of all reads, median of {args.reps}")
    print(f"{'implementation':24s} {'ms':>9s} {'× eager':>8s} {'peak MiB':>9s}")
    for r in rows:
        speed = f"{base / r['ms']:8.2f}" if base else ""
        peak = f"{r['peak_mib']:9.1f}" if r["peak_mib"] is not None else "        -"
        print(f"{r['impl']:24s} {r['ms']:9.2f} {speed} {peak}")
    print(f"wrote {out}")
    return info


if __name__ == "__main__":
    main()
