"""`python -m evaluation.explorer <path or run id> --out depth.html`: the depth-map explorer.

Runs the model on a few prompts from the run's validation split (one per hop count for a
multi-hop run), records every depth-attention weight (each reader over each source, at every
token) and writes one self-contained interactive HTML page (evaluation.explorer_page), logged into
the run as `explorer/depth.html` when given one. Variants without attention over depth are refused.
Rows are readers and columns sources, in the core's layout (`return_weights=True`).
"""
from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path
from typing import Optional

import torch


@torch.no_grad()
def depth_weights(model, idx: torch.Tensor) -> torch.Tensor:
    """(readers, B, T, columns) depth weights of one forward pass of a DecoderLM."""
    check_variant(model)
    _, weights = model.residual(model.embed(idx), model.sublayers, return_weights=True)
    return weights


def check_variant(model) -> None:
    if not getattr(model.residual, "has_depth_weights", False):
        raise ValueError(
            f"variant {model.residual_config.name!r} has no attention over depth to show; "
            "the explorer needs full, block or one of their ablations"
        )


def layout(model) -> dict:
    """Row and column labels, visibility and block boundaries of the model's depth maps."""
    residual = model.residual
    kinds = [s.kind for s in model.sublayers]
    short = {"attn": "A", "mlp": "M"}
    name = {"attn": "attention", "mlp": "MLP"}
    rows = [
        {"label": f"{short[k]}{i // 2}", "kind": k, "title": f"{name[k]} of block {i // 2} (sublayer {i})"}
        for i, k in enumerate(kinds)
    ] + [{"label": "out", "kind": "out", "title": "output read"}]
    cols = [{"label": "emb", "title": "token embedding"}]
    L = len(kinds)
    if residual.sources == "block":
        S = residual.block_size
        for n in range(1, residual.num_columns):
            first, last = (n - 1) * S, min(n * S, L) - 1
            cols.append({"label": f"b{n}", "title": f"block {n}: sublayers {first}–{last}"})
        row_bounds = [l for l in range(L) if residual.block_ends(l)]
        col_bounds = list(range(residual.num_columns - 1))
        boundary = f"AttnRes blocks of S = {S} sublayers"
    else:
        cols += [{"label": f"{short[k]}{i // 2}", "title": f"output of {name[k]} of block {i // 2}"} for i, k in enumerate(kinds)]
        row_bounds = list(range(1, L, 2))
        col_bounds = [0] + list(range(2, L, 2))
        boundary = "Transformer blocks (attention + MLP)"
    visible = residual.visibility()
    return {
        "rows": rows,
        "cols": cols,
        "visible": "".join("1" if v else "0" for v in visible.flatten().tolist()),
        "row_bounds": row_bounds,
        "col_bounds": col_bounds,
        "boundary": boundary,
    }


def explorer_data(model, prompts: list[tuple[str, list[int]]], tokenizer, title: str, subtitle: str) -> dict:
    """Everything the page shows, with each prompt's weights packed as base64 uint16."""
    data = layout(model)
    data.update(title=title, subtitle=subtitle, scale=65535, prompts=[])
    device = next(model.parameters()).device
    for name, ids in prompts:
        w = depth_weights(model, torch.tensor([ids], dtype=torch.long, device=device))[:, 0]  # (R, T, C)
        packed = (w.float().clamp(0, 1) * 65535).round().to(torch.int32).cpu().numpy().astype("<u2").tobytes()
        data["prompts"].append({
            "name": name,
            "tokens": [tokenizer.label(i) for i in ids],
            "weights": base64.b64encode(packed).decode("ascii"),
        })
    data["notes"] = (
        "Each row is a reader: a sublayer (A = attention, M = MLP, numbered by Transformer block) or the "
        "final output read; each column a source it may attend to (emb = token embedding). Colour = softmax "
        f"weight; hatched cells are sources a reader cannot see. White lines mark {data['boundary']}. "
        "Weights are per token; 'average over tokens' shows their mean over the prompt (the paper's Fig. 8)."
    )
    return data


def validation_prompts(source, tokenizer, n: int, length: int, data_overrides: Optional[list[str]] = None) -> list[tuple[str, list[int]]]:
    """`n` windows of `length` tokens spread evenly over the run's validation split (one held-out
    example per hop count for a multi-hop run), as (text, tokens)."""
    from harness.data import load_data

    from .source import data_settings

    data_cfg, _ = data_settings(source, data_overrides)
    if data_cfg.name == "multihop":
        return probe_prompts(data_cfg, n)
    length = min(length, source.model.config.max_seq_len)
    return split_prompts(load_data(data_cfg, length).val, tokenizer, n, length)  # load_data checks the length


def probe_prompts(data_cfg, n: int) -> list[tuple[str, list[int]]]:
    """One held-out multi-hop example per hop count, answer included (all of them when n is 0)."""
    from harness.data import MultiHopProbe

    out = []
    for k, examples in MultiHopProbe.from_config(data_cfg).val_set().items():
        if examples:
            ex = examples[0]
            out.append((f"{k} hop{'s' if k > 1 else ''}: {ex.prompt}{ex.answer}", list(f"\n{ex.prompt}{ex.answer}".encode("ascii"))))
    return out[:n] if n else out


def split_prompts(val: torch.Tensor, tokenizer, n: int, length: int) -> list[tuple[str, list[int]]]:
    """n windows of `length` tokens spread evenly over a validation split, each moved to start
    after a newline when one is within its first half (whole lines read better)."""
    if len(val) < length:
        raise ValueError(f"the validation split has {len(val)} tokens, fewer than --length={length}")
    newline = tokenizer.encode("\n")
    out = []
    for i in range(n):
        start = (len(val) - length) * i // max(1, n - 1) if n > 1 else 0
        window = val[start : start + 2 * length].long().tolist()
        if len(newline) == 1 and newline[0] in window[: length // 2]:
            cut = window.index(newline[0]) + 1
            if len(window) - cut >= length:
                window, start = window[cut:], start + cut  # the name gives where the prompt starts
        ids = window[:length]
        out.append((f"validation #{i + 1} (offset {start}): {tokenizer.decode(ids)[:40]!r}", ids))
    return out


def page(model, prompts: list[tuple[str, list[int]]], tokenizer, name: str, run_id: Optional[str] = None) -> str:
    """The explorer page of a model on these prompts, titled with `name` (a path or run id)."""
    from .explorer_page import render_page

    m, r = model.config, model.residual_config
    title = f"Depth attention · {r.name} · {name}"
    subtitle = (
        f"variant {r.name}, {m.layers} Transformer blocks ({2 * m.layers} sublayers), d_model {m.d_model}, "
        f"vocabulary {m.vocab_size} ({tokenizer.name})" + (f", MLflow run {run_id}" if run_id else "")
    )
    return render_page(explorer_data(model, prompts, tokenizer, title, subtitle))


def training_run_page(model, data_cfg, val: torch.Tensor, run_id: str, n: int = 6, length: int = 48) -> Optional[str]:
    """The page run.py logs into every run whose variant has depth weights, at the end of training
    as one self-contained HTML artifact: the command's default prompts, from the split the run validated on, already in memory. None for variants
    without attention over depth."""
    from .tokenizer import tokenizer_for

    if not getattr(model.residual, "has_depth_weights", False):
        return None
    tokenizer = tokenizer_for(model.config.vocab_size, None)
    if data_cfg.name == "multihop":
        prompts = probe_prompts(data_cfg, n)
    else:
        length = min(length, model.config.max_seq_len, len(val))
        prompts = split_prompts(val, tokenizer, n, length)
    return page(model, prompts, tokenizer, run_id, run_id)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evaluation.explorer", description="Write the depth-map explorer of a model as one HTML file.")
    p.add_argument("source", help="checkpoint folder or file, MLflow run id, or runs:/<run id>[/folder]")
    p.add_argument("--out", default="depth.html", help="HTML file to write (default: depth.html)")
    p.add_argument("--prompts", type=int, default=6, help="validation prompts (default 6)")
    p.add_argument("--length", type=int, default=48, help="tokens per validation prompt (default 48)")
    p.add_argument("--text", action="append", default=[], help="an extra prompt of your own (repeatable)")
    p.add_argument("--data", action="append", default=[], metavar="KEY=VALUE", help="override a data setting (repeatable)")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--tokenizer", choices=("bytes", "gpt2"), default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-log", action="store_true", help="do not log the page into the MLflow run")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompts < 0 or args.length < 2:
        return _fail("--prompts must be ≥ 0 and --length ≥ 2", 2)
    # The evaluation command's check: torch's own errors here were "AssertionError: Torch not
    # compiled with CUDA enabled" or a list of twenty device types, with nothing allowed named.
    from .cli import device_problem, output_problem

    problem = device_problem(args.device)
    if problem:
        return _fail(f"--device {args.device}: {problem}", 2)
    problem = output_problem(Path(args.out))
    if problem:
        return _fail(f"--out {args.out}: {problem}", 2)
    try:
        from attnres.io import CheckpointError

        from .source import open_source
        from .tokenizer import TokenizerError, tokenizer_for

        source = open_source(args.source, device=args.device, tracking_uri=args.tracking_uri)
        tokenizer = tokenizer_for(source.model.config.vocab_size, args.tokenizer)
        check_variant(source.model)
        prompts = validation_prompts(source, tokenizer, args.prompts, args.length, args.data) if args.prompts else []
        max_len = source.model.config.max_seq_len
        prompts += [(f"text: {t[:40]!r}", tokenizer.encode(t)[:max_len]) for t in args.text if t]
        if not prompts:
            raise ValueError("no prompts: give --prompts > 0 or --text")
    except (CheckpointError, TokenizerError, ValueError) as e:
        return _fail(str(e), 2)
    except Exception as e:
        return _fail(f"{args.source}: {type(e).__name__}: {' '.join(str(e).split())[:300]}", 2)

    name = Path(args.source).name if Path(args.source).exists() else args.source
    html = page(source.model, prompts, tokenizer, name, source.run_id)
    out = Path(args.out)
    try:
        from harness.checkpoint import atomic_write

        out.parent.mkdir(parents=True, exist_ok=True)
        # Through a temporary file: a full disk mid-write left a truncated page that opens blank.
        atomic_write(out, lambda tmp: tmp.write_text(html, encoding="utf-8"))
    except OSError as e:
        return _fail(f"{out}: cannot write ({e.strerror or e})", 1)
    print(f"wrote {out} ({out.stat().st_size // 1024} KB, {len(prompts)} prompts)")
    if source.run_id and not args.no_log:
        import shutil
        import tempfile

        from .source import store_gone

        if store_gone(source):  # the page stays; nothing is made where the store was
            return _fail(f"not logged to run {source.run_id}: {store_gone(source)}; the page is {out}", 1)

        from .mlflow_results import log_file

        with tempfile.TemporaryDirectory() as tmp:
            # The artifact is always named depth.html, whatever --out was.
            staged = shutil.copy(out, Path(tmp) / "depth.html")
            try:
                log_file(source.run_id, source.tracking_uri, staged, "explorer")
            except Exception as e:
                return _fail(f"could not log to run {source.run_id}: {' '.join(str(e).split())[:300]}", 1)
        print(f"logged explorer/depth.html to run {source.run_id}")
    return 0


def _fail(message: str, code: int) -> int:
    print(f"explorer: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
