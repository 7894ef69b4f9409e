"""Training dynamics of a run (paper Figs. 5 and 8): records, metrics and the two end-of-run plots.

A record is `model.inspect` on a fixed held-out batch plus the per-block gradient norms before
clipping, laid out as docs/RUN_SCHEMA.md's `instrumentation/step_XXXXXXX.json`. Records are small,
so the whole history rides in the checkpoint and a resumed run still plots every step.
"""
from __future__ import annotations

import math
from typing import Any

import torch

Record = dict[str, Any]


@torch.no_grad()
def record(model, idx: torch.Tensor, step: int, grad_norms: list[float] | None) -> Record:
    info = model.inspect(idx)
    return {
        "step": int(step),
        "depth_weights": info["depth_weights"],
        "depth_entropy": info["depth_entropy"],
        "sublayer_kind": info["sublayer_kind"],
        "output_rms_sublayer": info["output_rms_sublayer"],
        "output_rms_block": info["output_rms_block"],
        "hidden_rms_sublayer": info["hidden_rms_sublayer"],
        "hidden_rms_block": info["hidden_rms_block"],
        "grad_norm_block": grad_norms,
    }


def metrics(rec: Record) -> dict[str, float]:
    out = {f"depth/output_rms/block_{i:02d}": v for i, v in enumerate(rec["output_rms_block"])}
    for i, v in enumerate(rec["grad_norm_block"] or []):
        out[f"depth/grad_norm/block_{i:02d}"] = v
    entropy = relative_entropy(rec)
    if entropy is not None:
        out["depth/entropy"] = entropy
    return out


def relative_entropy(rec: Record) -> float | None:
    """Mean over readers that see more than one source of their per-token depth-weight entropy
    divided by log(sources seen): 1 is the uniform mean a zero query starts from, 0 one source."""
    entropy, weights = rec.get("depth_entropy"), rec.get("depth_weights")
    if entropy is None or weights is None:
        return None
    seen = [sum(1 for w in row if w == w) for row in weights]  # NaN marks a source not visible
    ratios = [h / math.log(n) for h, n in zip(entropy, seen) if n > 1]
    return sum(ratios) / len(ratios) if ratios else None


def artifact_name(step: int) -> str:
    return f"instrumentation/step_{step:07d}.json"


def _row_labels(kinds: list[str]) -> list[str]:
    labels, counts = [], {"attn": 0, "mlp": 0}
    for kind in kinds:
        if kind == "out":
            labels.append("out")
        else:
            labels.append(f"{kind}{counts[kind]}")
            counts[kind] += 1
    return labels


def depth_weights_figure(rec: Record, title: str):
    """Heat map of the depth weights: rows = readers (sublayers, then the output read), columns =
    sources (embedding, then sublayer outputs or blocks), blank where a source is not visible."""
    from matplotlib.figure import Figure  # no pyplot: no global state, safe for many jobs in one process

    weights = rec["depth_weights"]
    fig = Figure(figsize=(7.5, 6.5), dpi=110)
    ax = fig.add_subplot()
    if weights is None:
        ax.axis("off")
        ax.text(0.5, 0.5, f"{title}\nthis variant has no depth weights\n(no softmax over depth)",
                ha="center", va="center", fontsize=12, parse_math=False)
        return fig
    w = torch.tensor(weights, dtype=torch.float64)
    im = ax.imshow(w.numpy(), cmap="viridis", aspect="auto", interpolation="nearest", vmin=0.0)
    rows = _row_labels(rec["sublayer_kind"][: w.shape[0]])
    step = max(1, len(rows) // 24)
    ax.set_yticks(range(0, len(rows), step), rows[::step], fontsize=7)
    ax.set_xlabel("source (0 = embedding)")
    ax.set_ylabel("reader")
    ax.set_title(f"{title}: depth weights α at step {rec['step']}", parse_math=False)  # a run name is text, not mathtext
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    return fig


def magnitudes_figure(history: list[Record], title: str):
    """Output RMS and gradient norm per Transformer block, one line per instrumentation step
    (darker = later), the end of training in black (paper Fig. 5)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=110)
    axes = fig.subplots(1, 2)
    shown = history[-8:]  # the last few records keep the plot readable
    cmap = colormaps["Blues"]
    for panel, key, label in ((0, "output_rms_block", "output RMS"), (1, "grad_norm_block", "gradient norm")):
        ax = axes[panel]
        for j, rec in enumerate(shown):
            values = rec.get(key)
            if not values:
                continue
            last = j == len(shown) - 1
            ax.plot(range(len(values)), values, marker="o", ms=3,
                    color="black" if last else cmap(0.3 + 0.6 * j / max(1, len(shown) - 1)),
                    lw=2 if last else 1, label=f"step {rec['step']}")
        ax.set_xlabel("Transformer block")
        ax.set_ylabel(label)
        if any(v and min(v) > 0 and max(v) / min(v) > 20 for v in (r.get(key) for r in shown)):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title}: magnitudes per block", parse_math=False)
    fig.tight_layout()
    return fig
