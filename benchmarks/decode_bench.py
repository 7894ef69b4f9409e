"""Inference latency: prefill of a prompt and token-by-token decoding from the KV cache, of each
variant against the baseline, in one process on the same model shape and prompt.

    python benchmarks/decode_bench.py --preset 194m              # GPU: bf16 weights, block vs baseline
    python benchmarks/decode_bench.py --layers 2 --prompt 16 --new 4 --rounds 2   # CPU, tiny

Each decoded token is timed on its own (synchronised), as a user waits for it; the report gives
median ratios to the baseline over rounds, with their interquartile range.
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from attnres import VARIANTS, DecoderLM, ModelConfig, ResidualConfig  # noqa: E402
from benchmarks.model_bench import PRESETS, machine  # noqa: E402


def build(variant: str, cfg: ModelConfig, block_size, device, dtype) -> DecoderLM:
    torch.manual_seed(0)
    knobs = {} if block_size is None else dict(block_size=block_size)
    return DecoderLM(cfg, ResidualConfig(name=variant, **knobs)).to(device=device, dtype=dtype).eval()


def _now(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


@torch.no_grad()
def one_round(model: DecoderLM, prompt: torch.Tensor, new: int, cuda: bool) -> tuple[float, list[float]]:
    """Prefill time and each decoding step's time, in ms."""
    cache = model.kv_cache(prompt.shape[0], prompt.shape[1] + new)
    t = _now(cuda)
    logits = model(prompt, cache=cache)[0]
    prefill = 1000 * (_now(cuda) - t)
    steps = []
    for _ in range(new):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        t = _now(cuda)
        logits = model(nxt, cache=cache)[0]
        steps.append(1000 * (_now(cuda) - t))
    return prefill, steps


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--variants", default="block", help="comma-separated; baseline is always added")
    ap.add_argument("--layers", type=int, help="model.layers (Transformer blocks); default: the preset's")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (prefill)")
    ap.add_argument("--new", type=int, default=64, help="tokens decoded one at a time")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--json", help="output path (default benchmarks/out/decode_bench_<device>.json)")
    args = ap.parse_args(argv)
    for name in ("batch", "prompt", "new", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: allowed: a whole number from 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    preset = PRESETS[args.preset]
    mcfg = {**preset["model"], **({"layers": args.layers} if args.layers else {})}
    cfg = ModelConfig(max_seq_len=args.prompt + args.new, **mcfg)
    block_size = None if preset["blocks"] is None else max(1, round(2 * cfg.layers / preset["blocks"]))
    variants = ["baseline"] + [v for v in args.variants.split(",") if v and v != "baseline"]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; allowed: {', '.join(VARIANTS)}")
    try:
        models = {v: build(v, cfg, block_size, device, dtype) for v in variants}
    except ValueError as e:
        ap.error(str(e))
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)

    sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a time limit stops it as Ctrl-C does
    prefill = {v: [] for v in variants}
    per_token = {v: [] for v in variants}
    rounds = 0
    try:
        for v in variants:  # warm-up: Triton autotunes and compiles each new shape once
            one_round(models[v], prompt, min(args.new, 4), cuda)
        for r in range(args.rounds):
            # A rotating order and ratios within a round cancel the machine's drift.
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            got = {v: one_round(models[v], prompt, args.new, cuda) for v in order}
            for v in variants:
                prefill[v].append(got[v][0])
                per_token[v].append(statistics.median(got[v][1]))
            rounds += 1
    except KeyboardInterrupt:
        print(f"# interrupted: reporting the {rounds} of {args.rounds} rounds done", file=sys.stderr)
        if rounds == 0:
            raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, sigterm)

    def spread(xs):
        q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
        return statistics.median(xs), q[0], q[2]

    rows = []
    for v in variants:
        ratio, q1, q3 = spread([a / b for a, b in zip(per_token[v], per_token["baseline"])])
        pre_ratio = statistics.median([a / b for a, b in zip(prefill[v], prefill["baseline"])])
        rows.append(dict(variant=v, prefill_ms=statistics.median(prefill[v]), token_ms=statistics.median(per_token[v]),
                         token_ratio=ratio, token_ratio_q1=q1, token_ratio_q3=q3, prefill_ratio=pre_ratio))
    info = dict(machine=machine(), device=str(device), dtype=str(dtype).removeprefix("torch."), preset=args.preset,
                model=vars(cfg), block_size=block_size, batch=args.batch, prompt=args.prompt, new=args.new,
                rounds=rounds, rows=rows)
    print(f"# {info['machine'].get('gpu', info['machine']['cpu'])}, {device}, {info['dtype']}: d_model={cfg.d_model} "
          f"layers={cfg.layers}, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, {rounds} rounds")
    print(f"{'variant':12s} {'prefill ms':>10s} {'× base':>7s} {'ms/token':>9s} {'× base':>7s} {'(IQR)':>16s}")
    for r in rows:
        print(f"{r['variant']:12s} {r['prefill_ms']:10.2f} {r['prefill_ratio']:7.3f} {r['token_ms']:9.3f} "
              f"{r['token_ratio']:7.3f}  [{r['token_ratio_q1']:.3f}, {r['token_ratio_q3']:.3f}]")
    out = Path(args.json) if args.json else Path(__file__).parent / "out" / f"decode_bench_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=2, default=str))
    print(f"wrote {out}")
    return info


if __name__ == "__main__":
    main()
