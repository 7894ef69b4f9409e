"""What the models do across depth: output magnitude and gradient spread per block (Fig. 5), and
the learned depth weights (Fig. 8)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .. import ablation as abl
from ..significance import compare, log_t_interval, t_interval, t_p, welch_interval, welch_p
from .. import figures
from .section import Claim, Section, _f, _img, _md, _verdict, _write


def _run_profile(rid, instrumentation, runs, key):
    """Per-block profile of one run at its latest instrumentation step: from the artifact, or
    from the latest depth/* metrics when the run has no artifact (e.g. a snapshot without one)."""
    p = instrumentation.get(rid, {}).get(f"{key}_block")
    if p and all(x is not None for x in p):
        return np.asarray(p, float)
    prefix = {"output_rms": "output_rms_block_", "grad_norm": "grad_norm_block_"}[key]
    cols = sorted(c for c in runs.columns if c.startswith(prefix))
    vals = runs.loc[runs["run_id"] == rid, cols].to_numpy(float).ravel()
    vals = vals[np.isfinite(vals)]
    return vals if len(vals) else None


# Variants whose depth sources are block sums (sources="block" in attnres/residuals/__init__.py);
# named here because analysis reads runs, not the model.
BLOCK_FAMILY = ("block", "block_multihead", "block_no_rmsnorm")


def block_starts(n_blocks: int, S: int) -> list[int]:
    """First sublayer of every AttnRes block after the first, for a model of ``n_blocks``
    Transformer blocks (L = 2·n_blocks sublayers) and S sublayers per AttnRes block; the last
    block takes any remainder (the model's rule), so the starts are S, 2S, … below L. The
    embedding is a source of its own (b_0), not a block: nothing starts before sublayer 0."""
    return list(range(S, 2 * n_blocks, S))


def block_transitions(n_blocks: int, S: int) -> tuple[np.ndarray, np.ndarray]:
    """Transitions b−1 → b (b = 1 … n_blocks−1) of a per-Transformer-block profile that cross an
    AttnRes block boundary, and those that lie within one AttnRes block.

    Transformer block b holds sublayers 2b (attention) and 2b+1 (MLP). A transition crosses a
    boundary when an AttnRes block starts exactly at block b (2b = kS); it lies within one when
    all four sublayers 2b−2 … 2b+1 share an AttnRes block. When S is odd some blocks start at an
    MLP (2b±1 = kS): the Transformer block around it writes into two AttnRes blocks, so the
    transitions into and out of it are neither and are left out. S = 1 or 2 leaves no transition
    within a block, S = 3 none either (every other block straddles a boundary)."""
    starts = set(block_starts(n_blocks, S))
    b = np.arange(1, n_blocks)
    boundary = np.array([i for i in b if 2 * i in starts], int)
    within = np.array([i for i in b if not {2 * i - 1, 2 * i, 2 * i + 1} & starts], int)
    return boundary, within


def boundary_drop(profile, S: int, first: int = 0) -> float:
    """Mean log(p[b]/p[b−1]) over the transitions that cross an AttnRes block boundary minus the
    mean over those within a block (:func:`block_transitions`), using entries from ``first`` on.
    A profile that resets at the boundaries (rising within blocks, falling across) gives a clearly
    negative number; one that changes smoothly with depth, whatever its trend, about 0. NaN when
    either kind of transition is missing or an entry it needs is not positive and finite."""
    p = np.asarray(profile, float)
    boundary, within = block_transitions(len(p), int(S))
    boundary, within = boundary[boundary > first], within[within > first]
    if not len(boundary) or not len(within):
        return np.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.log(p[1:] / p[:-1])  # step[b − 1]: the transition b − 1 → b
    d = step[boundary - 1].mean() - step[within - 1].mean()
    return float(d) if np.isfinite(d) else np.nan


def _block_sizes(runs: pd.DataFrame) -> pd.Series:
    """S per run (index: run_id) for the block family, NaN for other variants or when the runs do
    not record block_size / num_blocks / layers."""
    cols = {c: runs[c] if c in runs else np.nan for c in ("block_size", "num_blocks", "layers")}
    S = abl.block_size_of(runs.assign(**cols)).astype(float)
    S = S.where(runs["variant"].isin(BLOCK_FAMILY))
    return pd.Series(S.to_numpy(), index=runs["run_id"].to_numpy())


def _mean_profile(profiles):
    profiles = [p for p in profiles if p is not None]
    if not profiles:
        return None
    n = min(len(p) for p in profiles)
    return np.mean([p[:n] for p in profiles], axis=0)


RESET_CLAIM = ("Output magnitude resets at block boundaries with block (falls across a boundary "
               "relative to within a block)")


def _reset_claim(runs: pd.DataFrame, S_of: pd.Series, drops: dict) -> Claim:
    """The paper's "bounded and periodic, resetting at block boundaries" for Block AttnRes: its
    runs' boundary_drop of the output RMS against the baseline's at the same positions (Welch),
    or *not tested* with the reason the runs cannot speak to it."""
    def untested(why):
        return Claim(RESET_CLAIM, why, "not tested")

    block = runs[runs["variant"] == "block"]
    if block.empty:
        return untested("no Block AttnRes runs")
    sizes = sorted({int(x) for x in S_of[block["run_id"]] if np.isfinite(x)})
    if not sizes:
        return untested("the Block runs record no block_size / num_blocks and layers")
    if len(sizes) > 1:
        return untested(f"the Block runs differ in S ({', '.join(map(str, sizes))}): no one set of "
                        "boundary positions")
    S, n = sizes[0], _transformer_blocks(block)
    if n is not None and S >= 2 * n:
        return untested(f"S = {S} at {2 * n} sublayers: one block, no boundary inside the model")
    if n is not None and not all(map(len, block_transitions(n, S))):
        return untested(f"S = {S}: no Transformer-block transition lies within one block")
    a, b = (np.asarray(drops.get(v, ([], []))[0], float) for v in ("block", "baseline"))
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if not (runs["variant"] == "baseline").any():
        return untested("no baseline runs to give the null at the same positions")
    if len(a) < 2 or len(b) < 2:
        return untested(f"{len(a)} Block and {len(b)} baseline runs with a per-block output RMS "
                        "profile; the interval needs 2 on each side")
    d, h = welch_interval(a, b)
    nb, nw = (len(t) for t in block_transitions(n, S)) if n is not None else ("?", "?")
    return Claim(RESET_CLAIM, f"boundary drop {b.mean():.3g} (baseline, at Block's boundaries) vs "
                 f"{a.mean():.3g}; Δ = {_f(d, 3)} ± {_f(h, 3)}; S = {S}: {nb} boundary and {nw} "
                 "within-block transitions", _verdict(d - h, d + h), welch_p(a, b))


def _transformer_blocks(g: pd.DataFrame):
    """The runs' number of Transformer blocks L_b when they share one, else None."""
    if "layers" not in g:
        return None
    n = {int(x) for x in g["layers"] if np.isfinite(x)}
    return n.pop() if len(n) == 1 else None


def _drop(p, S, layers, first=0) -> float:
    """boundary_drop of one run's profile, NaN without a profile of the run's depth or an S."""
    if p is None or S is None or not np.isfinite(S) or len(p) < 2:
        return np.nan
    if layers is not None and np.isfinite(layers) and len(p) != int(layers):
        return np.nan  # e.g. a metrics fallback with a block missing: positions would shift
    return boundary_drop(p, int(S), first)


def dynamics_section(runs: pd.DataFrame, instrumentation: dict, out: Path) -> Section:
    """Per run: growth of the output RMS from the first block to the last, the spread (max/min)
    of per-block gradient norms, and for the block family (BLOCK_FAMILY) how much the output RMS
    falls across AttnRes block boundaries relative to within blocks (:func:`boundary_drop`; the
    baseline's at the same positions is the null). Variants are compared on these per-run numbers
    over seeds (paired where seeds pair), so seeds give the verdict its uncertainty."""
    title = "Training dynamics (paper Fig. 5)"
    S_of = _block_sizes(runs)
    block_S = {int(x) for x in S_of[runs.loc[runs["variant"] == "block", "run_id"]] if np.isfinite(x)}
    null_S = block_S.pop() if len(block_S) == 1 else np.nan  # the baseline at Block's positions
    d = _Dynamics()
    for v, g in runs.groupby("variant"):
        _add_variant(d, v, g, runs, instrumentation, S_of, null_S)
    n_fig = _transformer_blocks(runs[runs["variant"] == "block"])
    starts = block_starts(n_fig, int(null_S)) if n_fig and np.isfinite(null_S) else []
    files = figures.dynamics(d.profiles, out / "figures", boundaries=[k / 2 for k in starts],
                             boundary_label=f"Block AttnRes boundaries (S = {null_S:.0f})")
    if not d.rows:
        return Section(title, "No instrumentation (depth/* metrics or instrumentation artifacts) "
                       "in these runs.\n\n", [Claim("Output magnitude grows with depth for the "
                                                    "baseline, stays bounded with Block AttnRes",
                                                    "no instrumentation", "not tested"),
                                              Claim(RESET_CLAIM, "no instrumentation", "not tested")],
                       files)
    t = pd.DataFrame(d.rows)
    for c in ("hidden_growth", "S", "boundary_drop", "hidden_boundary_drop"):
        if t[c].map(lambda x: isinstance(x, float) and not np.isfinite(x)).all():
            t = t.drop(columns=c)
    files += _write(t, out, "fig5_dynamics")
    text = _md(t) + _dynamics_legend(t)
    claims = _ratio_claims(d.per_run, d.per_run_seeds) + [_reset_claim(runs, S_of, d.drops)]
    return Section(title, text + _img(files, out, "Fig. 5"), claims, files)


@dataclass
class _Dynamics:
    profiles: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    per_run: dict = field(default_factory=dict)  # variant -> (growth, spread) per run
    per_run_seeds: dict = field(default_factory=dict)  # variant -> their seeds
    drops: dict = field(default_factory=dict)  # variant -> (boundary drop, hidden) per run


def _add_variant(d: _Dynamics, v, g, runs, instrumentation, S_of, null_S) -> None:
    layers = (runs.set_index("run_id")["layers"].astype(float) if "layers" in runs
              else pd.Series(np.nan, index=runs["run_id"].to_numpy()))
    o = [_run_profile(r, instrumentation, runs, "output_rms") for r in g["run_id"]]
    gr = [_run_profile(r, instrumentation, runs, "grad_norm") for r in g["run_id"]]
    if all(p is None for p in o + gr):
        return
    d.profiles[v] = {"output_rms": _mean_profile(o), "grad_norm": _mean_profile(gr)}
    seeds = g["seed"].to_numpy(float) if "seed" in g else np.full(len(g), np.nan)
    growth = np.array([p[-1] / p[0] for p in o if p is not None and len(p)])
    spread = np.array([p.max() / p.min() for p in gr if p is not None and len(p)])
    d.per_run[v] = (growth, spread)
    d.per_run_seeds[v] = (np.array([s for p, s in zip(o, seeds) if p is not None and len(p)]),
                          np.array([s for p, s in zip(gr, seeds) if p is not None and len(p)]))
    # The state entering each block (artifact only): the residual stream for the baseline,
    # the depth read for AttnRes variants; the output RMS above is what the blocks write.
    hidden = [np.asarray(instrumentation.get(r, {}).get("hidden_rms_block") or [], float)
              for r in g["run_id"]]
    S = [S_of[r] if v in BLOCK_FAMILY else null_S if v == "baseline" else np.nan
         for r in g["run_id"]]
    # The hidden profile's first entry is the embedding (source b_0, not a block's), the same
    # for every variant: its step into the first block is left out.
    d.drops[v] = (np.array([_drop(p, s, layers[r]) for p, s, r in zip(o, S, g["run_id"])]),
                  np.array([_drop(h if len(h) else None, s, layers[r], first=1)
                            for h, s, r in zip(hidden, S, g["run_id"])]))
    hidden = np.array([h[-1] / h[0] for h in hidden if len(h) > 1 and np.isfinite(h).all() and h[0] > 0])
    mo = d.profiles[v]["output_rms"]
    d.rows.append({"variant": v, "runs": len(g), "blocks": len(mo) if mo is not None else np.nan,
                   "rms_growth": growth.mean() if len(growth) else np.nan,
                   "hidden_growth": hidden.mean() if len(hidden) else np.nan,
                   "grad_max_over_min": spread.mean() if len(spread) else np.nan,
                   "S": _same_or_range(S_of[g["run_id"]]) if v in BLOCK_FAMILY else np.nan,
                   "boundary_drop": _nanmean(d.drops[v][0]),
                   "hidden_boundary_drop": _nanmean(d.drops[v][1])})


def _dynamics_legend(t: pd.DataFrame) -> str:
    text = ("\nrms_growth: output RMS of the last block over the first (RMS of what the block's "
             "sublayers write, f_l(h_l)); grad_max_over_min: "
             "spread of per-block gradient norms (1 = uniform). Means over the runs of each "
             "variant at their latest instrumentation step. Both are ratios, so the verdicts "
             "compare them on the log scale: geometric means, and the ratio of a variant's to the "
             "baseline's with a 95% interval from same-seed pairs (Welch where seeds do not pair).")
    if "hidden_growth" in t:
        text += (" hidden_growth: RMS of the state entering the last block over that entering the "
                 "first (the embedding): the residual stream for the baseline, whose growth is "
                 "what PreNorm dilution is about; for the other variants what their residual "
                 "hands the block's first sublayer (for AttnRes, the depth read; "
                 "`docs/RUN_SCHEMA.md`). Shown, not judged.")
    if "boundary_drop" in t:
        text += (" S: sublayers per AttnRes block of the block family (block, block_multihead, "
                 "block_no_rmsnorm); the paper's claim is about Block AttnRes, so only block is "
                 "judged. boundary_drop: per run, the mean log-ratio of the output RMS of "
                 "consecutive Transformer blocks over the steps that cross an AttnRes block "
                 "boundary, minus that over the steps within a block (negative: the magnitude "
                 "falls at boundaries, the paper's reset; about 0 for a profile without them). "
                 "A boundary crosses a step when a block starts at a Transformer block's attention "
                 "sublayer; with an odd S some start at an MLP, and the steps into and out of that "
                 "Transformer block are left out. The baseline's row is at block's positions, the "
                 "null the claim compares with; the figure's vertical lines mark them. The "
                 "claim is tested on the output RMS, what the blocks write: the quantity of the "
                 "paper's figure (\"output magnitude per Transformer block\") and of this "
                 "section's other claims.")
        if "hidden_boundary_drop" in t:
            text += (" hidden_boundary_drop: the same on the state entering each block (the embedding's "
                     "step into the first block left out), where the restart of the partial "
                     "block sum acts on what a block reads. Shown, not judged.")
    return text + "\n\n"


def _ratio_claims(per_run: dict, per_run_seeds: dict) -> list[Claim]:
    claims = []
    # Growth and max/min are ratios: their scatter is multiplicative, so they are tested on the
    # log scale (a geometric mean and ratios of them), where a linear interval could cross 0.
    if "baseline" in per_run:  # the paper's premise, tested on its own: growth above 1
        gm, lo, hi, p = log_t_interval(per_run["baseline"][0])
        claims.append(Claim("Output magnitude grows with depth for the baseline (PreNorm dilution)",
                            f"growth {_f(gm, 3)} [{_f(lo, 3)}, {_f(hi, 3)}] (geometric mean, "
                            f"{len(per_run['baseline'][0])} runs; 1 = no growth)",
                            _verdict(np.log(lo), np.log(hi), better_is_negative=False)
                            if np.isfinite(lo) else "inconclusive", p))
    for v in ("block", "full"):
        if {"baseline", v} <= set(per_run):
            for i, (what, stat) in enumerate((
                    (f"Output magnitude grows less with depth with {v} than with the baseline",
                     "growth"),
                    (f"Gradient norms are more uniform across blocks with {v}", "max/min"))):
                c = compare(per_run[v][i], per_run["baseline"][i], per_run_seeds[v][i],
                            per_run_seeds["baseline"][i], log=True)
                r, rlo, rhi = c.ratio
                b = np.exp(np.mean(np.log(per_run["baseline"][i])))
                a = np.exp(np.mean(np.log(per_run[v][i])))
                design = f"paired over {c.n} seeds" if c.design == "paired" else "Welch"
                claims.append(Claim(what, f"{stat} {b:.3g} (baseline) vs {a:.3g} (geometric "
                                    f"means); ratio {r:.3g} [{rlo:.3g}, {rhi:.3g}], log scale, "
                                    f"{design}", _verdict(c.lo, c.hi), c.p))
    return claims


def _nanmean(x) -> float:
    x = np.asarray(x, float)
    x = x[np.isfinite(x)]
    return float(x.mean()) if len(x) else np.nan


def _diagonal(W) -> dict:
    """The Fig. 8 numbers of one run's depth-weight matrix (readers × sources, NaN where a source
    is not visible): mean weight on the embedding (source 0) over all readers, and over readers
    with a real choice (2+ sources) the mean weight on the most recent visible source, the mean
    share a uniform average would give it, and their difference, the excess. Also, closer to the
    paper's wording ("each sublayer reads its predecessor most"), the share of sublayer readers
    (the output read left out) with a choice whose largest weight is on the most recent source."""
    W = np.array(W, dtype=float)
    visible = np.isfinite(W)
    n_vis = visible.sum(axis=1)
    recent_col = np.array([np.flatnonzero(visible[i])[-1] if visible[i].any() else -1 for i in range(len(W))])
    last = np.array([W[i, c] if c >= 0 else np.nan for i, c in enumerate(recent_col)])
    choice = n_vis >= 2
    if not choice.any():
        return {"readers": len(W), "embedding_weight": float(np.nanmean(W[:, 0])),
                "recent_weight": np.nan, "uniform_share": np.nan, "excess": np.nan, "recent_is_largest": np.nan}
    recent, uniform = float(np.mean(last[choice])), float(np.mean(1.0 / n_vis[choice]))
    sublayers = [i for i in range(len(W) - 1) if choice[i]]  # the last row is the output read
    largest = [np.nanargmax(W[i]) == recent_col[i] for i in sublayers]
    return {"readers": len(W), "embedding_weight": float(np.nanmean(W[:, 0])),
            "recent_weight": recent, "uniform_share": uniform, "excess": recent - uniform,
            "recent_is_largest": float(np.mean(largest)) if largest else np.nan}


def _same_or_range(values):
    v = sorted({int(x) for x in values if x is not None and np.isfinite(x)})
    return np.nan if not v else float(v[0]) if len(v) == 1 else f"{v[0]}–{v[-1]}"


def depth_section(runs: pd.DataFrame, instrumentation: dict, out: Path) -> Section:
    """Fig. 8: does each sublayer weight its most recent source above a uniform share?

    The excess (recent weight − uniform share, over readers with 2+ sources) is one number per
    run, and the interval is a t-interval over runs, i.e. seeds. The ~30 reader rows of one run
    are not replicates: they are read off one trained model, so their scatter says nothing about
    what another seed would give, and an interval over them would be pseudo-replication, far too
    narrow. With one run there is no interval and no verdict. The
    figure draws one run per variant, the lowest seed."""
    title = "Depth weights (paper Fig. 8)"
    chosen, rows = {}, []
    for v, g in runs.sort_values(["seed", "run_id"]).groupby("variant", sort=True):
        per_run = []
        for rid in g["run_id"]:
            p = instrumentation.get(rid, {})
            if p.get("depth_weights"):
                chosen.setdefault(v, p)
                per_run.append({"run_id": rid, "step": p.get("step"),
                                **_diagonal(p["depth_weights"])})
        if not per_run:
            continue
        d = pd.DataFrame(per_run)
        m, h, n = t_interval(d["excess"])
        rows.append({"variant": v, "runs": n, "figure_run": d["run_id"].iloc[0],
                     "step": _same_or_range(d["step"]), "readers": _same_or_range(d["readers"]),
                     "embedding_weight": float(d["embedding_weight"].mean()),
                     "recent_weight": float(d["recent_weight"].mean()),
                     "uniform_share": float(d["uniform_share"].mean()),
                     "excess": m, "excess_ci": h, "recent_is_largest": float(d["recent_is_largest"].mean())})
    files = figures.depth_weights(chosen, out / "figures")
    if not rows:
        return Section(title, "No depth weights recorded in these runs (instrumentation artifacts "
                       "with `depth_weights`).\n\n", [], files)
    t = pd.DataFrame(rows)
    files += _write(t, out, "fig8_depth_weights")
    text = _md(t)
    text += ("\nEvery run of each variant with depth weights (runs), each at its latest step. Per "
             "run: embedding_weight, the mean weight on source 0 over all readers; recent_weight "
             "and uniform_share, the mean weight on the most recent visible source and the share "
             "a uniform average would give it, over readers with two or more sources; excess, "
             "their difference; recent_is_largest, the share of sublayer readers with a choice "
             "whose largest weight is on the most recent source (the paper's \"reads its "
             "predecessor most\"; for Block that source is the partial sum, or at a block's first "
             "sublayer the block just completed). The table gives means over runs, and excess ± "
             "its 95% t-interval "
             "over runs (seeds): the readers of one run come from one trained model and are not "
             "replicates, so one run gives no interval. figure_run: the run the figure draws (the "
             "lowest seed); each of its panels has its own colour scale, from 0.\n\n")
    claims = []
    excess = {v: [_diagonal(instrumentation[rid]["depth_weights"])["excess"]
                  for rid in g["run_id"] if instrumentation.get(rid, {}).get("depth_weights")]
              for v, g in runs.groupby("variant")}
    for r in rows:
        if r["variant"] in ("full", "block"):
            lo, hi = r["excess"] - r["excess_ci"], r["excess"] + r["excess_ci"]
            spread = (f"excess {_f(r['excess'], 3)} ± {_f(r['excess_ci'], 3)} over {r['runs']} "
                      "runs" if r["runs"] >= 2 else "one run, no interval")
            claims.append(Claim(f"{r['variant']}: each sublayer weights its most recent source "
                                "above a uniform share (strong diagonal)",
                                f"{r['recent_weight']:.3f} vs uniform {r['uniform_share']:.3f}; "
                                + spread + f"; the recent source is the largest in "
                                f"{100 * r['recent_is_largest']:.0f}% of sublayer rows",
                                _verdict(lo, hi, better_is_negative=False),
                                t_p(excess[r["variant"]])))
    return Section(title, text + _img(files, out, "Fig. 8"), claims, files)
