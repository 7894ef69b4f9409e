"""Model-level benchmark: training-step time and peak memory of every residual variant, as ratios
to the baseline's, in one process on the same model and the same batch.

    python benchmarks/model_bench.py                          # CPU: the default model, layers=16
    python benchmarks/model_bench.py --variants baseline,block,full,mhc --rounds 30
    python benchmarks/model_bench.py --preset d128 --threads 1  # the wider CPU shape (d_model 128)
    python benchmarks/model_bench.py --preset 194m --compile  # GPU (bf16 autocast on CUDA)

A step is forward, loss, backward, AdamW and zero_grad, as the harness trains, with its allocator
settings (``--malloc-default`` leaves glibc's). Reports the median of per-round ratios with their
interquartile range, wall and CPU time, and writes JSON (``--json``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import openmp  # noqa: E402

openmp.set_wait_policy()  # as run.py trains: before torch loads OpenMP (a short spin; harness/openmp.py)
import torch  # noqa: E402

from attnres import VARIANTS, DecoderLM, ModelConfig, ResidualConfig  # noqa: E402
from attnres import kernels  # noqa: E402
from harness import malloc  # noqa: E402  (the allocator settings training runs with)

# Model presets: "default" is the harness's CPU default (conf/model/default.yaml: d_model 64,
# 2 heads, d_ff 192; conf/train/default.yaml: batch 16 × 128, byte vocabulary) with
# model.layers=16, the CPU study's shape; "d128" the wider CPU shape the
# first measurements used (d_model 128, 4 heads, batch 16 × 256); "194m" the paper's smallest model
# as the harness's dense preset (conf/model/194m.yaml), one micro-batch of 4 × 8192. `blocks`: the
# Block variants' block count N (S = round(2·layers/N)); None keeps each variant's S = 4 (the CPU
# sweeps' choice), 8 is the paper's N and the GPU sweeps' (conf/residual/block_n8.yaml).
PRESETS = {
    "default": dict(model=dict(d_model=64, layers=16, n_heads=2, d_ff=192, vocab_size=256), batch=16, seq_len=128,
                    blocks=None),
    "d128": dict(model=dict(d_model=128, layers=16, n_heads=4, d_ff=352, vocab_size=256), batch=16, seq_len=256,
                 blocks=None),
    "194m": dict(model=dict(d_model=896, layers=12, n_heads=14, d_ff=3584, vocab_size=256), batch=4, seq_len=8192,
                 blocks=8),
}


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
        info["cpu"] = names[0] if names else info["cpu"]
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


@contextlib.contextmanager
def _kineto_quiet():
    """The profiler's C++ side (kineto) writes `USDT… profiler_start/stop` lines to the process's
    stderr at every start and stop, whatever its log level; they would bury the table. fd 2 goes
    to /dev/null while the profiler runs (a step the timed rounds already ran: anything it warns
    was printed there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def cpu_peak_bytes(fn) -> int:
    """Peak of live bytes allocated during fn() above the level before it (profiler events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _kineto_quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    level = peak = 0
    for _, size in sorted(sizes):
        level += size
        peak = max(peak, level)
    return peak


def kernel_times(step, cuda: bool, steps: int = 1) -> tuple[float, list[dict]]:
    """`steps` calls of step() under the profiler: wall ms per step, and every kernel (CUDA) or
    operator (CPU) with its calls and self ms per step, costliest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _kineto_quiet(), profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = 1000 * (time.perf_counter() - t) / steps
    rows = []
    for e in prof.key_averages():
        if cuda and e.device_type != DeviceType.CUDA:
            continue
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append(dict(name=e.key, calls=e.count // steps, ms=us / 1000 / steps))
    return wall_ms, sorted(rows, key=lambda r: -r["ms"])


def kernel_profile(step, cuda: bool, top: int) -> dict:
    """One step under the profiler: the `top` kernels (CUDA) or operators (CPU) by self time, and
    the summed time of all of them against the step's wall time (on a GPU, the gap is launch and
    host overhead). Where a variant's extra time goes, which the ratios alone cannot say."""
    wall_ms, rows = kernel_times(step, cuda)
    return dict(wall_ms=wall_ms, busy_ms=sum(r["ms"] for r in rows), top=rows[:top])


def state_bytes(model, opt) -> int:
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    for st in opt.state.values():
        total += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
    return total


def parse_triton_knobs(pairs: list[str], error, flag: str = "--triton") -> dict:
    """`triton_kernels` knob values from NAME=VALUE strings (none set). `error(message)` is called
    with one line for a bad one, naming the option it came from (`flag`)."""
    if not pairs:
        return {}
    from attnres.kernels import triton_available

    if not triton_available():
        error(f"{flag}: Triton is not installed (pip install triton)")
    from attnres.kernels import triton_kernels as tk

    knobs = {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        value = {"true": True, "false": False, "none": None}.get(text.strip().lower(), text.strip())
        if name not in tk.KNOBS or (isinstance(value, str) and not value.isdigit()):
            error(f"{flag} {pair!r}: allowed: NAME=VALUE with NAME one of {', '.join(tk.KNOBS)} and VALUE an "
                  "integer, true, false or none")
        knobs[name] = int(value) if isinstance(value, str) else value
    return knobs


def set_triton_knobs(pairs: list[str], error) -> dict:
    """Set `triton_kernels` knobs from NAME=VALUE strings (the module's defaults otherwise); returns
    them as set."""
    knobs = parse_triton_knobs(pairs, error)
    if knobs:
        from attnres.kernels import triton_kernels as tk

        for name, value in knobs.items():
            setattr(tk, name, value)
    return knobs


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; baseline is always added")
    ap.add_argument("--layers", type=int, help="model.layers (Transformer blocks); default: 16 for 'default'")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--blocks", type=int, help="Block variants with about this many blocks, S = round(2·layers/N) "
                    "(default: the preset's: 8 for 194m as the paper, else each variant's S = 4)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--compile", action="store_true", help="torch.compile each model")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--malloc-default", action="store_true",
                    help="leave glibc's malloc thresholds alone (default: as the harness trains, harness/malloc.py)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the rounds, profile one step per variant and print its N costliest kernels "
                         "(CUDA) or operators (CPU)")
    ap.add_argument("--triton", action="append", default=[], metavar="NAME=VALUE",
                    help="set a knob of the Triton kernels for this run (attnres.kernels.triton_kernels.KNOBS; "
                         "VALUE an integer, true, false or none); repeatable")
    ap.add_argument("--json", help="output path (default benchmarks/out/model_bench_<device>.json)")
    return ap


def configure(args, error) -> dict:
    """The run's threads and allocator set, and its device, model config, batch shape, block size
    and variants (baseline first); `error(message)` for a bad one."""
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = False if args.malloc_default else malloc.keep_freed_memory()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = PRESETS[args.preset]
    mcfg = dict(preset["model"])
    if args.layers:
        mcfg["layers"] = args.layers
    batch, seq_len = args.batch or preset["batch"], args.seq_len or preset["seq_len"]
    cfg = ModelConfig(max_seq_len=seq_len, **mcfg)
    blocks = preset["blocks"] if args.blocks is None else args.blocks
    if blocks is not None and blocks < 1:
        error(f"--blocks {blocks}: the number of blocks must be at least 1")
    # S as the sweeps' ${blocks:N} computes it (harness.config.block_size_of), written out here:
    # the harness's resolvers need OmegaConf, which a GPU machine's image may lack.
    block_size = None if blocks is None else max(1, round(2 * cfg.layers / blocks))
    variants = ["baseline"] + [v for v in args.variants.split(",") if v and v != "baseline"]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        error(f"--variants: unknown {', '.join(unknown)}; allowed: {', '.join(VARIANTS)}")
    return dict(kept=kept, device=device, cfg=cfg, batch=batch, seq_len=seq_len, block_size=block_size,
                variants=variants)


def build_runs(setup: dict, use_compile: bool, error) -> dict:
    """Per variant: its model, AdamW and a training step on one fixed batch (bf16 autocast on CUDA)."""
    device, cfg, block_size = setup["device"], setup["cfg"], setup["block_size"]
    cuda = device.type == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (setup["batch"], setup["seq_len"]), generator=gen).to(device)
    tgt = torch.randint(0, cfg.vocab_size, (setup["batch"], setup["seq_len"]), generator=gen).to(device)

    runs = {}
    for v in setup["variants"]:
        torch.manual_seed(0)
        try:
            knobs = {} if block_size is None else dict(block_size=block_size)
            model = DecoderLM(cfg, ResidualConfig(name=v, **knobs)).to(device)
        except ValueError as e:  # a variant that does not fit the shape (block size > sublayers, …)
            error(f"--variants {v}: {e}")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # a small lr keeps the model stable over rounds
        fwd = torch.compile(model) if use_compile else model

        def step(model=model, opt=opt, fwd=fwd):
            with amp:
                _, loss = fwd(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        runs[v] = dict(model=model, opt=opt, step=step)
    return runs


def timed(step, cuda: bool) -> tuple[float, float]:
    """Wall and CPU seconds of one step()."""
    if cuda:
        torch.cuda.synchronize()
    t, c = time.perf_counter(), time.process_time()
    step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t, time.process_time() - c


def time_rounds(runs: dict, warmup: int, n_rounds: int, cuda: bool) -> tuple[dict, dict, int, bool]:
    """Warm-up steps, then `n_rounds` rounds of one step per variant: per variant its wall and CPU
    times and their ratios to the baseline's, the warm-up seconds, the rounds done and whether an
    interrupt stopped them (exit 130 when it came before the first round finished)."""
    variants = list(runs)
    samples = {k: {v: [] for v in variants} for k in ("times", "ratios", "cpu_times", "cpu_ratios")}
    warmup_s, rounds, stage, t = {}, 0, "first round", time.perf_counter()
    try:
        for v in variants:  # with --compile, the first step compiles: its time says what a budget needs
            stage, t = f"warm-up of {v}", time.perf_counter()
            for _ in range(warmup):
                timed(runs[v]["step"], cuda)
            warmup_s[v] = round(time.perf_counter() - t, 2)
        stage, t = "first round", time.perf_counter()
        for r in range(n_rounds):
            # The order rotates and each time is divided by the baseline's in the same round, so
            # the machine's slow drift cancels; CPU time beside wall time resists other processes.
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            got = {v: timed(runs[v]["step"], cuda) for v in order}
            for v in variants:
                samples["times"][v].append(got[v][0])
                samples["ratios"][v].append(got[v][0] / got["baseline"][0])
                samples["cpu_times"][v].append(got[v][1])
                samples["cpu_ratios"][v].append(got[v][1] / got["baseline"][1])
            rounds += 1
    except KeyboardInterrupt:
        if rounds == 0:
            print(f"model_bench: interrupted in the {stage} after {time.perf_counter() - t:.0f} s "
                  f"(warm-ups done, s: {warmup_s}); no rounds to report", file=sys.stderr)
            raise SystemExit(130) from None
        print(f"# interrupted: reporting the {rounds} of {n_rounds} rounds done, no memory pass", file=sys.stderr)
        return samples, warmup_s, rounds, True
    return samples, warmup_s, rounds, False


def memory_pass(runs: dict, rounds: int, cuda: bool) -> dict:
    """Per variant, the bytes of its parameters and optimizer state plus one step's peak; empty
    when interrupted."""
    memory = {}
    try:
        for v, run in runs.items():
            static = state_bytes(run["model"], run["opt"])
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                run["step"]()
                torch.cuda.synchronize()
                memory[v] = static + torch.cuda.max_memory_allocated() - before
            else:
                memory[v] = static + cpu_peak_bytes(run["step"])
    except KeyboardInterrupt:
        print(f"# interrupted in the memory pass: reporting the {rounds} rounds, no memory figures",
              file=sys.stderr)
        memory = {}
    return memory


def profile_pass(runs: dict, cuda: bool, top: int) -> dict:
    """Per variant, kernel_profile of one step; the variants done when interrupted."""
    profiles = {}
    try:
        for v, run in runs.items():
            profiles[v] = kernel_profile(run["step"], cuda, top)
    except KeyboardInterrupt:
        print(f"# interrupted in the profile: reporting {len(profiles)} of {len(runs)} profiles",
              file=sys.stderr)
    return profiles


def _quartile(xs, p):
    # "inclusive": quartiles within the data (the default extrapolates past it with few rounds)
    return statistics.quantiles(xs, n=4, method="inclusive")[p] if len(xs) > 1 else xs[0]


def summarize(samples: dict, memory: dict, cuda: bool) -> list[dict]:
    """One row per variant: median step time and ratios with their quartiles, and memory if measured."""
    times, ratios, cpu_times, cpu_ratios = (samples[k] for k in ("times", "ratios", "cpu_times", "cpu_ratios"))
    rows = []
    for v in times:
        row = dict(variant=v, step_ms=1000 * statistics.median(times[v]), ratio=statistics.median(ratios[v]),
                   ratio_q1=_quartile(ratios[v], 0), ratio_q3=_quartile(ratios[v], 2))
        if not cuda:
            row.update(cpu_step_ms=1000 * statistics.median(cpu_times[v]), cpu_ratio=statistics.median(cpu_ratios[v]),
                       cpu_ratio_q1=_quartile(cpu_ratios[v], 0), cpu_ratio_q3=_quartile(cpu_ratios[v], 2))
        if memory:
            row.update(peak_mib=memory[v] / 2**20, memory_ratio=memory[v] / memory["baseline"])
        rows.append(row)
    return rows


def print_report(info: dict, cfg, cuda: bool) -> None:
    """The run's header line, the table of ratios, and each variant's profile if any."""
    rows, profiles, kept, warmup_s = info["rows"], info["profiles"], info["keep_freed_memory"], info["warmup_seconds"]
    triton_knobs, block_size = info["triton_knobs"], info["block_size"]
    print(f"# {info['machine']['cpu']} ({info['machine'].get('gpu', 'no GPU')}), device {info['device']}, "
          f"threads {torch.get_num_threads()}, d_model={cfg.d_model} layers={cfg.layers} "
          f"batch={info['batch']}x{info['seq_len']}, block size {block_size or 'per variant'}, "
          f"{info['rounds']} alternating rounds, compile={info['compile']}, keep_freed_memory={kept}; "
          f"warm-up s {warmup_s}" + (f"; Triton knobs {triton_knobs}" if triton_knobs else ""))
    cpu_cols = f" {'cpu ms':>8s} {'cpu ratio':>9s} {'(IQR)':>15s}" if not cuda else ""
    print(f"{'variant':18s} {'step ms':>9s} {'time ratio':>10s} {'(IQR)':>15s}{cpu_cols} {'peak MiB':>9s} {'mem ratio':>9s}")
    for row in rows:
        mem = f"{row['peak_mib']:9.1f} {row['memory_ratio']:9.3f}" if "peak_mib" in row else ""
        cpu = (f" {row['cpu_step_ms']:8.1f} {row['cpu_ratio']:9.3f}  [{row['cpu_ratio_q1']:.3f}, {row['cpu_ratio_q3']:.3f}]"
               if not cuda else "")
        print(f"{row['variant']:18s} {row['step_ms']:9.1f} {row['ratio']:10.3f}  [{row['ratio_q1']:.3f}, {row['ratio_q3']:.3f}]{cpu} {mem}")
    for v, prof in profiles.items():
        what = "kernels" if cuda else "operators"
        print(f"# {v}: one profiled step {prof['wall_ms']:.1f} ms, {what} busy {prof['busy_ms']:.1f} ms; "
              f"the costliest {len(prof['top'])}:")
        for r in prof["top"]:
            print(f"  {r['ms']:9.2f} ms {r['calls']:5d}x  {r['name'][:100]}")


def write_json(info: dict, path: str | None, device) -> None:
    out = Path(path) if path else Path(__file__).parent / "out" / f"model_bench_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=2, default=str))
    print(f"wrote {out}")


def main(argv=None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    triton_knobs = set_triton_knobs(args.triton, ap.error)
    setup = configure(args, ap.error)
    device, cfg = setup["device"], setup["cfg"]
    cuda = device.type == "cuda"
    runs = build_runs(setup, args.compile, ap.error)

    # A time limit's SIGTERM (run_gpu.sh's stages) stops the bench as Ctrl-C does; what was
    # measured by then is reported.
    sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:  # SIGTERM stays an interrupt until the memory pass is done: a time limit keeps the rounds
        samples, warmup_s, rounds, interrupted = time_rounds(runs, args.warmup, args.rounds, cuda)
        memory = {} if args.no_memory or interrupted else memory_pass(runs, rounds, cuda)
        # no profile after an interrupt (no memory figures then)
        profiles = profile_pass(runs, cuda, args.profile) if args.profile > 0 and memory else {}
    finally:
        signal.signal(signal.SIGTERM, sigterm)

    rows = summarize(samples, memory, cuda)
    info = dict(machine=machine(), device=str(device), preset=args.preset, model=vars(cfg), batch=setup["batch"],
                seq_len=setup["seq_len"], block_size=setup["block_size"], rounds=rounds, warmup=args.warmup,
                warmup_seconds=warmup_s, compile=args.compile, autocast_bf16=cuda, kernel_backend=kernels.backend(),
                schedule=os.environ.get("ATTNRES_SCHEDULE", "auto"), keep_freed_memory=setup["kept"],
                triton_knobs=triton_knobs, rows=rows, profiles=profiles)
    print_report(info, cfg, cuda)
    write_json(info, args.json, device)
    return info


if __name__ == "__main__":
    main()
