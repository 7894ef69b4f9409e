"""What the models do across depth: output magnitude and gradient spread per block (Fig. 5), and
the learned depth weights (Fig. 8)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .. import ablation as abl
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


def _mean_profile(profiles):
    profiles = [p for p in profiles if p is not None]
    if not profiles:
        return None
    n = min(len(p) for p in profiles)
    return np.mean([p[:n] for p in profiles], axis=0)


def dynamics_section(runs: pd.DataFrame, instrumentation: dict, out: Path) -> Section:
    """Per run: growth of the output RMS from the first block to the last, and the spread
    (max/min) of per-block gradient norms. Variants are compared on these per-run numbers with a
    Welch interval, so seeds give the verdict its uncertainty."""
    title = "Training dynamics (paper Fig. 5)"
    profiles, rows, per_run = {}, [], {}
    for v, g in runs.groupby("variant"):
        o = [_run_profile(r, instrumentation, runs, "output_rms") for r in g["run_id"]]
        gr = [_run_profile(r, instrumentation, runs, "grad_norm") for r in g["run_id"]]
        if all(p is None for p in o + gr):
            continue
        profiles[v] = {"output_rms": _mean_profile(o), "grad_norm": _mean_profile(gr)}
        growth = np.array([p[-1] / p[0] for p in o if p is not None and len(p)])
        spread = np.array([p.max() / p.min() for p in gr if p is not None and len(p)])
        per_run[v] = (growth, spread)
        # The state entering each block (artifact only): the residual stream for the baseline,
        # the depth read for AttnRes variants; the output RMS above is what the blocks write.
        hidden = [np.asarray(instrumentation.get(r, {}).get("hidden_rms_block") or [], float)
                  for r in g["run_id"]]
        hidden = np.array([h[-1] / h[0] for h in hidden if len(h) > 1 and np.isfinite(h).all() and h[0] > 0])
        mo = profiles[v]["output_rms"]
        rows.append({"variant": v, "runs": len(g), "blocks": len(mo) if mo is not None else np.nan,
                     "rms_growth": growth.mean() if len(growth) else np.nan,
                     "hidden_growth": hidden.mean() if len(hidden) else np.nan,
                     "grad_max_over_min": spread.mean() if len(spread) else np.nan})
    files = figures.dynamics(profiles, out / "figures")
    if not rows:
        return Section(title, "No instrumentation (depth/* metrics or instrumentation artifacts) "
                       "in these runs.\n\n", [Claim("Output magnitude grows with depth for the "
                                                    "baseline, stays bounded with Block AttnRes",
                                                    "no instrumentation", "not tested")], files)
    t = pd.DataFrame(rows)
    if t["hidden_growth"].isna().all():
        t = t.drop(columns="hidden_growth")
    files += _write(t, out, "fig5_dynamics")
    text = _md(t)
    text += ("\nrms_growth: output RMS of the last block over the first (RMS of what the block's "
             "sublayers write, f_l(h_l)); grad_max_over_min: "
             "spread of per-block gradient norms (1 = uniform). Means over the runs of each "
             "variant at their latest instrumentation step; the verdicts compare variants with a "
             "95% Welch interval over runs.")
    if "hidden_growth" in t:
        text += (" hidden_growth: RMS of the state entering the last block over that entering the "
                 "first (the embedding): the residual stream for the baseline, whose growth is "
                 "what PreNorm dilution is about; for the other variants what their residual "
                 "hands the block's first sublayer (for AttnRes, the depth read; "
                 "`docs/RUN_SCHEMA.md`). Shown, not judged.")
    text += "\n\n"
    claims = []
    if "baseline" in per_run:  # the paper's premise, tested on its own: growth above 1
        m, h, n = abl.t_interval(per_run["baseline"][0])
        claims.append(Claim("Output magnitude grows with depth for the baseline (PreNorm dilution)",
                            f"growth {_f(m, 3)} ± {_f(h, 3)} over {n} runs (1 = no growth)",
                            _verdict(m - 1 - h, m - 1 + h, better_is_negative=False),
                            abl.t_p(per_run["baseline"][0], 1.0)))
    for v in ("block", "full"):
        if {"baseline", v} <= set(per_run):
            for i, (what, stat) in enumerate((
                    (f"Output magnitude grows less with depth with {v} than with the baseline",
                     "growth"),
                    (f"Gradient norms are more uniform across blocks with {v}", "max/min"))):
                d, h = abl.welch_interval(per_run[v][i], per_run["baseline"][i])
                b, a = per_run["baseline"][i].mean(), per_run[v][i].mean()
                claims.append(Claim(what, f"{stat} {b:.3g} (baseline) vs {a:.3g}; "
                                    f"Δ = {_f(d, 3)} ± {_f(h, 3)}", _verdict(d - h, d + h),
                                    abl.welch_p(per_run[v][i], per_run["baseline"][i])))
    return Section(title, text + _img(files, out, "Fig. 5"), claims, files)


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
        m, h, n = abl.t_interval(d["excess"])
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
                                abl.t_p(excess[r["variant"]])))
    return Section(title, text + _img(files, out, "Fig. 8"), claims, files)
