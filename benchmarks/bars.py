"""The GPU bars from run_gpu.sh's outputs: one line each, with the figure, the bar and whether
it is met, "not measured" (and why) where a stage did not produce it.

    python benchmarks/bars.py benchmarks/results      # the folder run_gpu.sh wrote (OUT)

Exits 0 whatever the verdicts: the figures are the output, the verdicts a reading of them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BLOCK_STEP, FULL_STEP, BLOCK_MEMORY, DECODE = 1.05, 1.10, 1.10, 1.02


def _load(folder: Path, name: str):
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None


def _verdict(value, bar) -> str:
    return "met" if value <= bar else "NOT met"


def bars(folder: Path) -> list[tuple[str, str]]:
    """(bar, the line that says where it stands) for each GPU bar."""
    out = []
    rc = (folder / "gpu_check.rc").read_text().strip() if (folder / "gpu_check.rc").exists() else None
    check = ("not measured (the device check did not run)" if rc is None else
             "met: every read matches the float64 reference, fp32 and bf16, gradients too" if rc == "0" else
             "not measured: gpu_check stopped at its time limit" if rc == "124" else
             f"NOT met: gpu_check exited {rc} (its output above names the reads that differ)")
    out.append(("device check", check))

    op = _load(folder, "op_bench.json")
    ms = {r["impl"]: r["ms"] for r in (op or {}).get("rows", [])}
    ours = {k: ms[k] for k in ("fused per read", "fused two-phase") if k in ms}
    if not ours:
        line = "not measured (op_bench did not time our fused Block read)"
    elif "fla fused_attnres" not in ms:
        line = (f"ours {', '.join(f'{k} {v:.2f} ms' for k, v in ours.items())}; fla-core not measured "
                "(not installed: fill .whl, see RESULTS.md's GPU runbook)")
    else:
        best = min(ours, key=ours.get)
        line = (f"ours {', '.join(f'{k} {v:.2f} ms' for k, v in ours.items())} vs fla-core {ms['fla fused_attnres']:.2f} ms "
                f"({ours[best] / ms['fla fused_attnres']:.2f}×): {_verdict(ours[best], ms['fla fused_attnres'])}")
    if op:
        line += f" [{op['sublayers']} sublayers, S={op['block_size']}, {op['tokens']} tokens, d={op['d']}, {op['dtype']}]"
    out.append(("op level: Block read fwd+bwd ≤ fla-core fused_attnres", line))

    model = _load(folder, "model_bench.json")
    rows = {r["variant"]: r for r in (model or {}).get("rows", [])}
    where = (f" [{model['preset']}, compile={model['compile']}, {model['rounds']} rounds, block size "
             f"{model['block_size']}]") if model else ""
    for variant, bar in (("block", BLOCK_STEP), ("full", FULL_STEP)):
        r = rows.get(variant)
        line = (f"not measured (model_bench has no {variant} row)" if r is None else
                f"{r['ratio']:.3f}× (IQR {r['ratio_q1']:.3f}–{r['ratio_q3']:.3f}; {r['step_ms']:.1f} vs "
                f"{rows['baseline']['step_ms']:.1f} ms): {_verdict(r['ratio'], bar)}")
        out.append((f"model level: {variant} step ≤ {bar}× baseline", line + where))
    r = rows.get("block")
    line = ("not measured (no memory pass)" if r is None or "memory_ratio" not in r else
            f"{r['memory_ratio']:.3f}× ({r['peak_mib']:.0f} vs {rows['baseline']['peak_mib']:.0f} MiB): "
            f"{_verdict(r['memory_ratio'], BLOCK_MEMORY)}")
    out.append((f"model level: block peak memory ≤ {BLOCK_MEMORY}× baseline", line + where))

    dec = _load(folder, "decode_bench.json")
    r = {x["variant"]: x for x in (dec or {}).get("rows", [])}.get("block")
    line = ("not measured (decode_bench has no block row)" if r is None else
            f"{r['token_ratio']:.3f}× per token (IQR {r['token_ratio_q1']:.3f}–{r['token_ratio_q3']:.3f}; "
            f"{r['token_ms']:.2f} ms; prefill {r['prefill_ratio']:.3f}×): {_verdict(r['token_ratio'], DECODE)} "
            f"[{dec['preset']}, {dec['dtype']}, prompt {dec['prompt']}, {dec['new']} tokens, {dec['rounds']} rounds]")
    out.append((f"inference: block decode latency per token ≤ {DECODE}× baseline", line))
    return out


def main(argv=None) -> list[tuple[str, str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="run_gpu.sh's output folder")
    args = ap.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        ap.error(f"{folder}: not a folder; allowed: the folder run_gpu.sh wrote (OUT)")
    found = [_load(folder, n) for n in ("op_bench.json", "model_bench.json", "decode_bench.json")]
    info = next((f["machine"] for f in found if f), None)
    if info:
        print(f"# machine: {info.get('gpu', 'no GPU')}; {info['cpu']} ({info['cpu_count']} CPUs); torch {info['torch']}, "
              f"triton {info.get('triton')}, Python {info['python']}")
    result = bars(folder)
    for bar, line in result:
        print(f"BAR {bar}: {line}")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
