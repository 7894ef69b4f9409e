"""The C depth-read kernels (attnres/kernels/csrc/depth_read.c, and depth_read_one.c for one
reader and one head) on their own, and every C read inside a model.

    python benchmarks/cpu_kernel_bench.py                      # isolated calls, the shapes below
    python benchmarks/cpu_kernel_bench.py --shapes 25,9 8,5,16 # n sources, R readers[, heads[, merge]]
    python benchmarks/cpu_kernel_bench.py --model block        # per-call times in training steps
    python benchmarks/cpu_kernel_bench.py --model block --floor  # its ratio with the kernels doing nothing
    python benchmarks/cpu_kernel_bench.py --model block --norm   # it and the baseline, C RMSNorm vs torch's
    python benchmarks/cpu_kernel_bench.py --model block --against depth_read=old.c  # a kernel change, A/B in the steps

Isolated: one call of the forward and of the backward kernel over N tokens, one thread, buffers
allocated once and reused (only the kernel's own scratch is allocated, in C; warm caches), best
of 5 batches; GFLOP/s counts 2·N·n·R·d
multiply-adds per direction-pass (forward 2 of them, backward 5). In a model: the default model
(d_model 64, `model.layers=16`, batch 16 × 128, one thread) steps as in model_bench.py and every
kernel call is timed where it happens, grouped by (direction, kernel, sources, readers, merge): what the
reads cost with the caches the sublayers leave behind. Floor (`--floor`): the baseline, the variant,
and the variant with every C kernel entry point replaced by one that returns at once (the Python
wrappers, autograd nodes, allocations, gradient accumulation and optimizer all still run) and
the outputs zero-filled (left as allocated they soon hold NaN, and exp of NaN runs 4x slower
here), alternating, CPU time: the step-time ratio the variant would have with kernels that only
write their outputs. Prints only; one thread.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import openmp  # noqa: E402

openmp.set_wait_policy()  # as run.py trains: before torch loads OpenMP (a short spin; harness/openmp.py)
import torch  # noqa: E402

from attnres import VARIANTS, DecoderLM, ModelConfig, ResidualConfig, layers  # noqa: E402
from attnres.kernels import cpu_kernels, native  # noqa: E402
from harness import malloc  # noqa: E402

DEFAULT_SHAPES = ["1,1,1,1", "7,1,1,1", "8,5", "25,9", "8,5,16"]


def _ptrs(ts):
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


def isolated(n: int, R: int, H: int, merge: bool, N: int, d: int, reps: int) -> None:
    lib = cpu_kernels._need()
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(N, d, generator=g) for _ in range(n)]
    rms = [cpu_kernels.inv_rms_forward(s, 1e-6) for s in srcs]
    q = torch.randn(R, d, generator=g) * 0.3
    o0 = torch.randn(R, N, d, generator=g) if merge else None
    lse0 = torch.randn(R, N, H, generator=g) if merge else None
    out, lse, grad = torch.empty(R, N, d), torch.empty(R, N, H), torch.randn(R, N, d, generator=g)
    dsrc = [torch.empty(N, d) for _ in range(n)]
    dq, do0, dlse0 = torch.empty(R, d), torch.empty(R, N, d), torch.empty(R, N, H)
    sp, rp, op, gp, dp = _ptrs(srcs), _ptrs(rms), _ptrs(list(out.unbind(0))), _ptrs(list(grad.unbind(0))), _ptrs(dsrc)
    whole = (ctypes.c_int64 * 2)(0, N)  # one token range, on the calling thread

    def forward():
        lib.attnres_read_forward_ranges(sp, rp, n, q.data_ptr(), 0, native.ptr(o0), native.ptr(lse0), op,
                                        lse.data_ptr(), N, d, H, R, 0, whole, 1)

    def backward():
        lib.attnres_read_backward_ranges(sp, rp, n, q.data_ptr(), 0, op if merge else None, native.ptr(lse0),
                                         lse.data_ptr(), gp, None, dp, None, dq.data_ptr(),
                                         native.ptr(do0 if merge else None), native.ptr(dlse0 if merge else None), N, d,
                                         H, R, 0, 1, whole, 1)

    kernels = {"depth_read": (forward, backward)}
    if R == 1 and H == 1:  # what the model runs for such reads: depth_read_one.c (1/rms in the kernel)
        one = native.require("depth_read_one", cpu_kernels._READ_ONE_SIGNATURES, "the one-reader reads")
        o0p, l0p = native.ptr(o0[0] if merge else None), native.ptr(lse0[0] if merge else None)
        q0 = q[0].contiguous()

        def one_forward():
            one.attnres_read_one_forward(sp, n, q0.data_ptr(), 0, o0p, l0p, op[0], lse.data_ptr(), d, 1e-6, 1, 0,
                                         whole, 1)

        def one_backward():
            one.attnres_read_one_backward(sp, n, q0.data_ptr(), 0, op[0], l0p, lse.data_ptr(), gp[0], dp,
                                          dq.data_ptr(), native.ptr(do0 if merge else None),
                                          native.ptr(dlse0 if merge else None), d, 1e-6, 1, 0, whole, 1)

        kernels["depth_read_one"] = (one_forward, one_backward)
    flop = 2 * N * n * R * d
    kind = "merge" if merge else "read"
    for name, fns in kernels.items():
        times = []
        for fn in fns:
            for _ in range(3):
                fn()
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                best = min(best, (time.perf_counter() - t) / reps)
            times.append(best)
        print(f"{kind:5s} n={n:2d} R={R} heads={H:2d} d={d} N={N} {name:14s}: forward {1e6 * times[0]:7.0f} µs "
              f"({2 * flop / times[0] / 1e9:5.1f} GFLOP/s), backward {1e6 * times[1]:7.0f} µs "
              f"({5 * flop / times[1] / 1e9:5.1f} GFLOP/s)")


def training_step(variant: str):
    """One AdamW training step of the default model (d_model 64, `model.layers=16`, batch 16 × 128)
    with the given residual variant, as a function (model_bench.py steps the same way)."""
    cfg = ModelConfig(max_seq_len=128, d_model=64, layers=16, n_heads=2, d_ff=192, vocab_size=256)
    g = torch.Generator().manual_seed(0)
    idx, tgt = (torch.randint(0, 256, (16, 128), generator=g) for _ in range(2))
    torch.manual_seed(0)
    model = DecoderLM(cfg, ResidualConfig(name=variant))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        _, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


@contextlib.contextmanager
def timed_kernels():
    """Inside: every call of cpu_kernels' read wrappers (and so of the C entry points behind them)
    is counted and timed, keyed by (direction, kernel, sources, readers, merge); yields that dict
    of [count, seconds]. The wrappers are put back on leaving."""
    calls = collections.defaultdict(lambda: [0, 0.0])
    originals = {}

    def timed(name, kernel, readers, merge):
        inner = originals[name] = getattr(cpu_kernels, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            result = inner(*args, **kwargs)
            entry = calls[(name.split("_")[-1], kernel, len(args[0]), readers(args), merge(args))]
            entry[0] += 1
            entry[1] += time.perf_counter() - t
            return result

        setattr(cpu_kernels, name, wrapper)

    try:
        # depth_read.c: (sources, inv_rms, query, init_out, ...); depth_read_one.c: (sources, query,
        # init_out or the read's own output, init_lse, ...), one reader
        timed("read_forward", "read", lambda a: a[2].shape[0], lambda a: a[3] is not None)
        timed("read_backward", "read", lambda a: a[2].shape[0], lambda a: a[3] is not None)
        timed("read_one_forward", "read_one", lambda a: 1, lambda a: a[2] is not None)
        timed("read_one_backward", "read_one", lambda a: 1, lambda a: a[3] is not None)
        yield calls
    finally:
        for name, inner in originals.items():
            setattr(cpu_kernels, name, inner)


def in_model(variant: str, steps: int) -> dict:
    with timed_kernels() as calls:
        step = training_step(variant)
        for _ in range(3):
            step()
        calls.clear()
        t = time.perf_counter()
        for _ in range(steps):
            step()
    print(f"{variant}: {1e3 * (time.perf_counter() - t) / steps:.1f} ms per training step, {steps} steps")
    total = 0.0
    for (direction, kernel, n, R, merge), (count, seconds) in sorted(calls.items()):
        total += seconds
        print(f"  {direction:8s} {kernel:8s} {'merge' if merge else 'read ':5s} n={n:2d} R={R}: {count // steps:3d} per step, "
              f"{1e6 * seconds / count:7.1f} µs a call")
    print(f"  kernels (with their Python wrappers): {1e3 * total / steps:.1f} ms per step")
    return dict(calls)


KERNEL_ENTRY_POINTS = {  # library: its entry points that read or write the sources
    "depth_read": (cpu_kernels._SIGNATURES, ["attnres_read_forward_ranges", "attnres_read_backward_ranges",
                                             "attnres_inv_rms_forward", "attnres_inv_rms_backward"]),
    "depth_read_one": (cpu_kernels._READ_ONE_SIGNATURES, ["attnres_read_one_forward", "attnres_read_one_backward"]),
}

# cpu_kernels' functions whose results are the kernels' outputs (every entry point above is behind one)
ZEROED_WRAPPERS = ("read_forward", "read_backward", "read_one_forward", "read_one_backward", "inv_rms_forward",
                   "inv_rms_backward")


def _zeroing(fn):
    """fn, then its output tensors zero-filled (the results of a kernel call that did nothing)."""
    def call(*args, **kwargs):
        result = fn(*args, **kwargs)
        stack = [result]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                item.zero_()
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
        return result
    return call


def _alternating(steps_of: dict, switch, rounds: int, steps: int, after=None) -> dict:
    """CPU seconds per step of each configuration (a key of steps_of, its training step), rounds
    alternating them (the order rotates), `switch(config)` before each one's steps, one warm-up
    step each first; `after(config)`, if given, right after each round's steps of a config."""
    configs = list(steps_of)
    times = {c: [] for c in configs}
    for c in configs:
        switch(c)
        steps_of[c]()
    for r in range(rounds):
        k = r % len(configs)
        for c in configs[k:] + configs[:k]:
            switch(c)
            t = time.process_time()
            for _ in range(steps):
                steps_of[c]()
            times[c].append((time.process_time() - t) / steps)
            if after is not None:
                after(c)
    return times


def norm_ab(variant: str, rounds: int, steps: int = 3) -> dict:
    """The baseline and the variant, each with the C RMSNorm (attnres.layers.RMSNorm, the
    default) and with torch's (nn.RMSNorm.forward), rounds alternating the four: what the C norm
    saves each model, and each ratio with both models on the same norm."""
    c_norm = layers.RMSNorm.forward

    def use(config) -> None:
        layers.RMSNorm.forward = c_norm if config[1] == "C" else torch.nn.RMSNorm.forward

    configs = [(v, norm) for v in ("baseline", variant) for norm in ("C", "torch")]
    steps_of = {}
    try:
        for c in configs:
            use(c)
            steps_of[c] = training_step(c[0])
        times = _alternating(steps_of, use, rounds, steps)
    finally:
        layers.RMSNorm.forward = c_norm
    out = {}
    for c in configs:
        same = statistics.median(t / b for t, b in zip(times[c], times[("baseline", c[1])]))
        to_torch = statistics.median(t / b for t, b in zip(times[c], times[(c[0], "torch")]))
        out[f"{c[0]}, {c[1]} norm"] = {"step_ms": 1e3 * statistics.median(times[c]), "ratio": same, "vs_torch_norm": to_torch}
        print(f"{c[0] + ', ' + c[1] + ' norm':28s} {1e3 * statistics.median(times[c]):7.1f} ms CPU per step   "
              f"ratio to the baseline on the same norm {same:.3f}   step vs the same model on torch's norm {to_torch:.3f}")
    print(f"({rounds} alternating rounds of {steps} steps each, one thread, medians)")
    return out


def floor(variant: str, rounds: int, steps: int = 3) -> dict:
    """Median CPU time per step and ratio to the baseline's of the variant with its kernels and
    with every kernel entry point doing nothing (see the module docstring), rounds alternating
    the three (the order rotates), each round `steps` steps of each after one warm-up step."""
    libs = {name: native.require(name, sigs, "the floor measurement") for name, (sigs, _) in KERNEL_ENTRY_POINTS.items()}
    real = {(name, fn): getattr(libs[name], fn) for name, (_, fns) in KERNEL_ENTRY_POINTS.items() for fn in fns}
    wrappers = {name: getattr(cpu_kernels, name) for name in ZEROED_WRAPPERS}
    skipped = [0]

    def nothing(*args):
        skipped[0] += 1
        return 0  # the entry points' "done" status

    def kernels_on(on: bool) -> None:
        for (name, fn), f in real.items():
            setattr(libs[name], fn, f if on else nothing)
        for name, f in wrappers.items():
            setattr(cpu_kernels, name, f if on else _zeroing(f))

    configs = [("baseline", True), (variant, True), (variant, False)]
    steps_of = {c: training_step(c[0]) for c in configs}  # the no-op's garbage stays in its own model
    try:
        times = _alternating(steps_of, lambda c: kernels_on(c[1]), rounds, steps)
    finally:
        kernels_on(True)
    base = times[configs[0]]
    out = {"skipped_calls": skipped[0]}
    for c, label in zip(configs, ("baseline", variant, f"{variant}, kernels doing nothing")):
        ratio = statistics.median(t / b for t, b in zip(times[c], base))
        out[label] = {"step_ms": 1e3 * statistics.median(times[c]), "ratio": ratio}
        print(f"{label:36s} {out[label]['step_ms']:7.1f} ms CPU per step   ratio {ratio:.3f}")
    print(f"({rounds} alternating rounds of {steps} steps each, one thread, medians)")
    return out


def against(variant: str, alternatives: dict, rounds: int, steps: int = 3) -> dict:
    """The variant's training steps with the C libraries as built now ("current") and with some of
    them built from other sources ("against": {library: source file}, e.g. the previous commit's),
    rounds alternating the two on one model (the order swaps each round), `steps` steps each:
    median CPU time per step and, per kernel and direction, median time per step in the read
    wrappers. In a step the kernels meet the caches the sublayers leave behind, which isolated
    calls do not show; and the kernels' own time varies far less than the step's on a shared
    machine, so this is what resolves a change of a few percent in one kernel."""
    builds = {"current": {name: native.load(name) for name in alternatives},
              "against": {name: native.build_from(name, Path(path)) for name, path in alternatives.items()}}

    def use(config) -> None:
        for name, lib in builds[config].items():
            native.install(name, lib)

    def record(config) -> None:  # each kernel's time per step in this round's steps
        kernels = collections.defaultdict(float)
        for (direction, kernel, *_), (_, seconds) in calls.items():
            kernels[f"{kernel} {direction}"] += seconds / steps
        for key, seconds in kernels.items():
            per_round[config][key].append(seconds)

    step = training_step(variant)
    per_round = {c: collections.defaultdict(list) for c in builds}
    try:
        with timed_kernels() as calls:
            times = _alternating({c: step for c in builds}, lambda c: (use(c), calls.clear()), rounds, steps,
                                 after=record)
    finally:
        use("current")
    for c in builds:
        per_round[c]["step (CPU)"] = times[c]
    what = ", ".join(f"{name}={path}" for name, path in alternatives.items())
    print(f"{variant}: ms per step, current build vs against ({what}); {rounds} alternating rounds of {steps} steps, medians")
    out = {}
    for key in sorted(per_round["current"], key=lambda k: (k == "step (CPU)", k)):
        a, b = (1e3 * statistics.median(per_round[c][key]) for c in builds)
        out[key] = {"current_ms": a, "against_ms": b}
        print(f"  {key:20s} current {a:8.2f}   against {b:8.2f}   against − current {b - a:+7.2f}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES,
                    help="n,R[,heads[,merge]]: sources, readers, heads (1), 1 for a phase-2 merge (0)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--model", choices=VARIANTS, metavar="VARIANT",
                    help="a residual variant: time the kernel calls inside its training steps")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--floor", action="store_true",
                    help="with --model: the variant's step-time ratio with its kernels and with them doing nothing")
    ap.add_argument("--norm", action="store_true",
                    help="with --model: the baseline and the variant with the C RMSNorm and with torch's")
    ap.add_argument("--against", nargs="+", metavar="LIBRARY=SOURCE",
                    help="with --model: the kernel times in its steps with the current build and with LIBRARY "
                         "(depth_read, depth_read_one, ...) built from SOURCE, alternating")
    ap.add_argument("--rounds", type=int, default=10, help="--floor, --norm, --against: alternating rounds")
    args = ap.parse_args(argv)
    if (args.floor or args.norm or args.against) and not args.model:
        ap.error("--floor, --norm and --against need --model VARIANT")
    alternatives, libraries = {}, sorted(p.stem for p in native.CSRC.glob("*.c"))
    for spec in args.against or []:
        name, _, path = spec.partition("=")
        if name not in libraries or not Path(path).is_file():
            ap.error(f"--against {spec}: expected LIBRARY=SOURCE, LIBRARY one of {', '.join(libraries)} and SOURCE "
                     "an existing C file")
        alternatives[name] = path
    torch.set_num_threads(1)
    malloc.keep_freed_memory()  # as the harness trains (and model_bench.py measures)
    if not cpu_kernels.available():
        raise SystemExit(f"the C kernels could not be built: {native.why_unavailable('depth_read')}")
    if args.model:
        if args.floor:
            floor(args.model, args.rounds)
        elif args.norm:
            norm_ab(args.model, args.rounds)
        elif alternatives:
            try:
                against(args.model, alternatives, args.rounds)
            except RuntimeError as err:  # the other source did not build
                raise SystemExit(f"--against: {err}") from None
        else:
            in_model(args.model, args.steps)
        return
    for spec in args.shapes:
        n, R, *rest = (int(x) for x in spec.split(","))
        H, merge = (rest[0] if rest else 1), (rest[1] if len(rest) > 1 else 0)
        isolated(n, R, H, bool(merge), args.tokens, args.d, args.reps)


if __name__ == "__main__":
    main()
