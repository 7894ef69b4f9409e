"""Every figure of the paper that our runs can redraw, ours beside the paper's where it has one.

Each function takes data already reduced by the other modules and writes ``<stem>.png`` and
``<stem>.pdf`` into a folder; with nothing of ours to draw, the paper's panel is still drawn with
a note, so a partial study gives a complete set of files. Agg backend: no display needed.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import matplotlib.ticker as mticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from . import architecture  # noqa: E402
from .paper import KNOWN_VARIANTS, PAPER_MULTIPLIER_AT  # noqa: E402
from .scaling import compute_multiplier, multiplier_curve  # noqa: E402

_TAB = plt.get_cmap("tab20").colors


def color(variant: str):
    """Stable colour of a variant, the same in every figure so a reader can follow it."""
    if variant in KNOWN_VARIANTS:
        return _TAB[KNOWN_VARIANTS.index(variant) % len(_TAB)]
    return _TAB[(len(KNOWN_VARIANTS) + sum(map(ord, variant))) % len(_TAB)]


def save(fig, folder, stem: str) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{stem}.png", folder / f"{stem}.pdf"]
    # No dates or software tags: identical input gives byte-identical files.
    fig.savefig(paths[0], dpi=130, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(paths[1], bbox_inches="tight", metadata={"CreationDate": None, "Creator": None,
                                                          "Producer": None})
    plt.close(fig)
    return paths


def _log(ax, which="both"):
    """Log scale with plain numbers at 1, 2, 5 × 10^k: loss ranges span less than a decade, where
    matplotlib's default labels (3×10^0 on minor ticks) are unreadable."""
    for name in ("x", "y") if which == "both" else (which,):
        getattr(ax, f"set_{name}scale")("log")
        axis = getattr(ax, f"{name}axis")
        axis.set_major_locator(mticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_locator(mticker.LogLocator(subs=np.arange(1, 10)))
        axis.set_minor_formatter(mticker.NullFormatter())


def _empty(ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4",
            wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


# --------------------------------------------------------------------------------------------
# Fig. 4: scaling curves and compute multiplier
# --------------------------------------------------------------------------------------------
def _span(cmin, cmax, n=100):
    return np.geomspace(cmin / 1.5, cmax * 1.5, n)


def scaling(fits: dict, points: pd.DataFrame, paper_laws: dict, paper_points, out,
            base: str = "baseline", level: float = 0.95) -> list[Path]:
    """2×2: our points, fits and bootstrap bands | the paper's; our multiplier vs C | the paper's.

    ``points``: variant, compute_pfd, loss (our finished runs); ``fits``: variant → Fit (pure).
    """
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    ax = axes[0, 0]
    if fits:
        for v, f in fits.items():
            p = points[points["variant"] == v]
            ax.scatter(p["compute_pfd"], p["loss"], s=18, color=color(v), zorder=3)
            C = _span(*f.compute_range)
            lo, hi = f.band(C, level)
            ax.fill_between(C, lo, hi, color=color(v), alpha=0.2, lw=0)
            ax.plot(C, f.law(C), color=color(v), label=f"{v}: {f.law.label()}")
        _log(ax)
        ax.legend(fontsize=7)
        ax.set_xlabel("compute C (PFLOP/s-days)")
        ax.set_ylabel("validation loss")
    else:
        _empty(ax, "no scaling runs")
    ax.set_title(f"Ours: L = A·C^-α, {int(level * 100)}% bootstrap bands")

    ax = axes[0, 1]
    if paper_laws:
        pp = paper_points if paper_points is not None else pd.DataFrame(columns=["variant"])
        C = _span(0.67, PAPER_MULTIPLIER_AT)
        for v, law in paper_laws.items():
            p = pp[pp["variant"] == v]
            ax.scatter(p["compute_pfd"], p["loss"], s=18, color=color(v), zorder=3)
            ax.plot(C, law(C), color=color(v), label=f"{v}: {law.label()}")
        _log(ax)
        ax.legend(fontsize=7)
        ax.set_xlabel("compute C (PFLOP/s-days; points: C ∝ N·D, largest = 5.6)")
    else:
        _empty(ax, "paper data not found")
    ax.set_title("Paper (Table 2 / Fig. 4)")

    ax = axes[1, 0]
    others = [v for v in fits if v != base]
    if base in fits and others:
        for v in others:
            lo_c = max(fits[v].compute_range[0], fits[base].compute_range[0])
            hi_c = min(fits[v].compute_range[1], fits[base].compute_range[1])
            C = _span(lo_c, hi_c)
            m, lo, hi = multiplier_curve(fits[base], fits[v], C, level)
            ax.fill_between(C, lo, hi, color=color(v), alpha=0.2, lw=0)
            ax.plot(C, m, color=color(v), label=v)
        ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
        _log(ax, "x")
        ax.legend(fontsize=7)
        ax.set_xlabel("compute C of the variant (PFLOP/s-days)")
        ax.set_ylabel(f"C_{base}(L) / C_variant(L)")
    else:
        _empty(ax, f"needs fits of {base} and another variant")
    ax.set_title("Ours: compute multiplier over the baseline")

    ax = axes[1, 1]
    if base in paper_laws and len(paper_laws) > 1:
        C = _span(0.67, PAPER_MULTIPLIER_AT)
        for v, law in paper_laws.items():
            if v != base:
                ax.plot(C, compute_multiplier(paper_laws[base], law, C), color=color(v), label=v)
        ax.axvline(PAPER_MULTIPLIER_AT, color="0.5", lw=0.8, ls=":")
        ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
        _log(ax, "x")
        ax.legend(fontsize=7)
        ax.set_xlabel("compute C (PFLOP/s-days)")
    else:
        _empty(ax, "paper data not found")
    ax.set_title("Paper: multiplier from its fitted laws (1.25× at 5.6 for Block)")
    fig.tight_layout()
    return save(fig, out, "fig4_scaling")


# --------------------------------------------------------------------------------------------
# Fig. 6: loss vs block size
# --------------------------------------------------------------------------------------------
def _block_panel(ax, table, title, ci=True):
    s = table.dropna(subset=["S"]).sort_values("S")
    if s.empty:
        _empty(ax, "no block-size runs")
        ax.set_title(title)
        return
    err = s["loss_ci"].fillna(0).to_numpy() if ci and "loss_ci" in s else None
    ax.errorbar(s["S"], s["loss"], yerr=err, marker="o", color=color("block"), capsize=3,
                label="Block AttnRes (S = 1: Full)")
    base = table[table["label"] == "baseline"]
    if len(base):
        b = float(base["loss"].iloc[0])
        ax.axhline(b, color=color("baseline"), ls="--", label="baseline")
        h = float(base["loss_ci"].iloc[0]) if ci and "loss_ci" in base else np.nan
        if np.isfinite(h):
            ax.axhspan(b - h, b + h, color=color("baseline"), alpha=0.15, lw=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(s["S"], [str(int(x)) for x in s["S"]])
    ax.set_xlabel("block size S (sublayers per block)")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=8)
    ax.set_title(title)


def block_size(ours: pd.DataFrame, paper_fig6, out) -> list[Path]:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    _block_panel(axes[0], ours, "Ours (mean ± 95% t-interval over seeds)")
    if paper_fig6 is not None:
        _block_panel(axes[1], paper_fig6.assign(loss_ci=np.nan), "Paper (Fig. 6)", ci=False)
    else:
        _empty(axes[1], "paper data not found")
    fig.tight_layout()
    return save(fig, out, "fig6_block_size")


# --------------------------------------------------------------------------------------------
# Fig. 7: architecture heat maps
# --------------------------------------------------------------------------------------------
def _heat(ax, grid, variant, title):
    pv = architecture.pivot(grid, variant)
    if pv.empty:
        _empty(ax, f"no {variant} cells")
        ax.set_title(title)
        return
    # One colour range per grid (ours / paper), so the variants' panels compare cell by cell.
    lo, hi = grid["loss"].min(), grid["loss"].max()
    sns.heatmap(pv, ax=ax, annot=True, fmt=".3f", cmap="viridis_r", vmin=lo, vmax=hi,
                cbar_kws={"label": "validation loss (lighter = lower)"}, annot_kws={"fontsize": 7}, xticklabels=[f"{c:g}" for c in pv.columns],
                yticklabels=[f"{r:g}" for r in pv.index])
    ax.set_xlabel("d_model / L_b")
    ax.set_ylabel("heads / L_b")
    rows = list(pv.index)
    # Per row: the best cell (white box); overall: the refined optimum in the title.
    for r, h in enumerate(rows):
        vals = pv.loc[h].to_numpy(float)
        if np.isfinite(vals).any():
            c = int(np.nanargmin(vals))
            ax.add_patch(plt.Rectangle((c, r), 1, 1, fill=False, ec="white", lw=1.5))
    opt = architecture.find_optimum(grid, variant)
    where = "at the grid's edge" if opt.at_edge else f"refined {opt.refined:.1f}"
    ax.set_title(f"{title}\nopt. d/L_b = {opt.grid_optimum:g} ({where}) "
                 f"at heads/L_b = {opt.heads_per_layer:g}", fontsize=9)


def arch(ours, paper_grid, out, variants=("baseline", "block")) -> list[Path]:
    fig, axes = plt.subplots(2, len(variants), figsize=(5.2 * len(variants), 8))
    axes = np.atleast_2d(axes)
    for j, v in enumerate(variants):
        if ours is not None and len(ours):
            _heat(axes[0, j], ours, v, f"Ours: {v}")
        else:
            _empty(axes[0, j], "no architecture-sweep runs")
            axes[0, j].set_title(f"Ours: {v}")
        if paper_grid is not None:
            _heat(axes[1, j], paper_grid, v, f"Paper (Fig. 7): {'AttnRes' if v == 'block' else v}")
        else:
            _empty(axes[1, j], "paper data not found")
    fig.tight_layout()
    return save(fig, out, "fig7_arch")


# --------------------------------------------------------------------------------------------
# Fig. 5: output magnitude and gradient norm per block
# --------------------------------------------------------------------------------------------
def dynamics(profiles: dict[str, dict[str, np.ndarray]], out, boundaries=(),
             boundary_label: str = "") -> list[Path]:
    """``profiles``: variant → {"output_rms": (L_b,), "grad_norm": (L_b,)} (mean over seeds).
    ``boundaries``: where AttnRes blocks start, in Transformer blocks from the first (sublayer
    k·S is at k·S/2; a half marks a block starting at an MLP), drawn as vertical lines."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in ((axes[0], "output_rms", "Output magnitude (RMS) per block"),
                           (axes[1], "grad_norm", "Gradient norm per block")):
        drawn = False
        for v, prof in profiles.items():
            y = prof.get(key)
            if y is not None and len(y) and np.isfinite(y).any():
                ax.plot(np.arange(1, len(y) + 1), y, marker=".", color=color(v), label=v)
                drawn = True
        if drawn:
            _log(ax, "y")
            for i, x in enumerate(boundaries):  # points sit at 1, 2, …: block b spans b ± 0.5
                ax.axvline(x + 0.5, color=color("block"), ls=":", lw=0.8,
                           label=boundary_label if i == 0 else None)
            ax.xaxis.set_major_locator(mticker.MaxNLocator(integer=True))
            ax.set_xlabel("Transformer block")
            ax.legend(fontsize=7)
        else:
            _empty(ax, "no instrumentation recorded")
        ax.set_title(f"Ours: {title}")
    fig.tight_layout()
    return save(fig, out, "fig5_dynamics")


# --------------------------------------------------------------------------------------------
# Multi-hop probe: accuracy per hop count (no paper counterpart: its reasoning claims are downstream)
# --------------------------------------------------------------------------------------------
def multihop(table: pd.DataFrame, hops: list[int], out) -> list[Path]:
    """``table``: one row per variant with columns ``hop k`` and ``hop k ±`` (mean, half-width)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for row in table.itertuples(index=False):
        r = dict(zip(table.columns, row))
        y = [r[f"hop {k}"] for k in hops]
        err = [0 if not np.isfinite(r[f"hop {k} ±"]) else r[f"hop {k} ±"] for k in hops]
        ax.errorbar(hops, y, yerr=err, marker="o", capsize=3, color=color(r["variant"]),
                    label=r["variant"])
    ax.axhline(0.1, color="0.5", ls=":", lw=1, label="chance (1 of 10 digits)")
    ax.set_xticks(hops)
    ax.set_xlabel("hops to the answer")
    ax.set_ylabel("accuracy (held out)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    ax.set_title("Ours: multi-hop probe (mean ± 95% t-interval over seeds)")
    fig.tight_layout()
    return save(fig, out, "multihop_probe")


def depth_entropy(curve: pd.DataFrame, out) -> list[Path]:
    """``curve``: variant, step, mean, min, max of `depth/entropy` over a variant's runs."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for variant, g in curve.groupby("variant"):
        ax.plot(g["step"], g["mean"], color=color(variant), label=f"{variant} ({int(g['count'].max())} runs)")
        ax.fill_between(g["step"], g["min"], g["max"], color=color(variant), alpha=0.2, lw=0)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("entropy / log(sources seen)")
    ax.legend(fontsize=7)
    ax.set_title("Ours: how sharply depth weights choose (mean and range over runs)")
    fig.tight_layout()
    return save(fig, out, "depth_entropy")


# --------------------------------------------------------------------------------------------
# Fig. 8: depth-weight heat maps
# --------------------------------------------------------------------------------------------
def depth_weights(payloads: dict[str, dict], out) -> list[Path]:
    """``payloads``: variant → instrumentation JSON of one run (see docs/RUN_SCHEMA.md)."""
    shown = {v: p for v, p in payloads.items() if p.get("depth_weights")}
    fig, axes = plt.subplots(max(len(shown), 1), 2, figsize=(10, 3.2 * max(len(shown), 1)),
                             squeeze=False)
    if not shown:
        _empty(axes[0, 0], "no depth weights recorded")
        _empty(axes[0, 1], "")
    for i, (v, p) in enumerate(shown.items()):
        W = np.array(p["depth_weights"], dtype=float)
        kinds = np.array(p.get("sublayer_kind", ["?"] * len(W)))
        for j, kind in enumerate(("attn", "mlp")):
            ax = axes[i, j]
            rows = np.flatnonzero(kinds == kind)
            if not len(rows):
                _empty(ax, f"no {kind} rows")
                continue
            im = ax.imshow(np.ma.masked_invalid(W[rows]), aspect="auto", cmap="magma_r",
                           vmin=0, interpolation="nearest")
            ax.set_yticks(range(len(rows)), [str(r) for r in rows], fontsize=6)
            ax.set_ylabel(f"{kind} sublayer (reader)")
            ax.set_xlabel("source (0 = embedding)")
            ax.xaxis.set_major_locator(mticker.MaxNLocator(integer=True))
            fig.colorbar(im, ax=ax, fraction=0.04)
            ax.set_title(f"{v}: {kind} rows (step {p.get('step', '?')})", fontsize=9)
    fig.tight_layout()
    return save(fig, out, "fig8_depth_weights")


# --------------------------------------------------------------------------------------------
# Training curves
# --------------------------------------------------------------------------------------------
def training_curves(histories: pd.DataFrame, runs: pd.DataFrame, out) -> list[Path]:
    """Validation loss against tokens (``val/loss_by_tokens``; against steps, ``val/loss``, in a
    panel where no run logged it), one panel per sweep, one line per run, coloured by variant;
    unfinished runs dashed; runs with fewer than three evaluations marked point by point."""
    sweeps = sorted(runs["sweep"].dropna().unique())
    n = max(len(sweeps), 1)
    cols = min(n, 2)
    nrows = int(np.ceil(n / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4 * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    by_run = {rid: g for rid, g in histories.groupby("run_id")} if len(histories) else {}
    for ax, sweep in zip(axes.flat, sweeps or [None]):
        sub = runs[runs["sweep"] == sweep] if sweep is not None else runs.iloc[:0]
        # One x axis per panel: tokens when any run has val/loss_by_tokens, else steps.
        hs = {r.run_id: by_run[r.run_id] for r in sub.itertuples() if r.run_id in by_run}
        key = ("val/loss_by_tokens" if any((h["key"] == "val/loss_by_tokens").any()
                                          for h in hs.values()) else "val/loss")
        xlabel = "tokens" if key == "val/loss_by_tokens" else "step"
        seen = set()
        for r in sub.itertuples():
            curve = hs[r.run_id] if r.run_id in hs else None
            curve = curve[curve["key"] == key] if curve is not None else None
            if curve is None or curve.empty:
                continue
            # a short run's one or two evaluations are a point, not a line: a marker shows them
            ax.plot(curve["step"], curve["value"], color=color(r.variant), lw=1, alpha=0.8,
                    ls="-" if r.status == "FINISHED" else "--", marker="o" if len(curve) < 3 else None,
                    ms=3, label=r.variant if r.variant not in seen else None)
            seen.add(r.variant)
        if seen:
            ax.set_xlabel(xlabel)
            ax.set_ylabel("validation loss")
            ax.legend(fontsize=7, ncol=2)
        else:
            _empty(ax, "no validation-loss histories")
        ax.set_title(f"Training curves: {sweep}")
    fig.tight_layout()
    return save(fig, out, "training_curves")
