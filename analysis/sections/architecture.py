"""The architecture section: the d_model/layers × heads/layers grid at a fixed budget (Fig. 7)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from .. import architecture, figures
from ..paper import Paper
from .scaling import _block_count_note
from ..significance import t_interval, t_p
from .section import Claim, Section, _img, _md, _verdict, _write

NOMINAL_TOLERANCE = 0.05  # an actual ratio more than 5% off its nominal column is reported


def _actual_ratios(grid: pd.DataFrame) -> dict[float, tuple[float, float]]:
    """Nominal d_model/L_b column -> (min, max) of the trained shapes' actual d_model/L_b in it."""
    col = "actual_" + architecture.X
    if col not in grid:
        return {}
    return {float(x): (float(g[col].min()), float(g[col].max()))
            for x, g in grid.groupby(architecture.X)}


def _span(lo: float, hi: float) -> str:
    return f"{lo:.3g}" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}–{hi:.3g}"


def _actual_note(grid: pd.DataFrame) -> str:
    """One sentence when the sweep's nominal d_model/L_b columns are not the ratios it trained
    (whole layers and heads, d_model solved from the budget): the optima and the figure's axis
    are nominal, and a reader comparing them with the paper's 45 and 60 needs the actual ones."""
    spans = _actual_ratios(grid)
    off = {x: r for x, r in spans.items()
           if max(abs(r[0] - x), abs(r[1] - x)) > NOMINAL_TOLERANCE * x}
    if not off:
        return ""
    return ("The grid's d_model/L_b columns (and the figure's axis, and the optima above) are the "
            "sweep's nominal values; the trained shapes' actual d_model/L_b per column: "
            + ", ".join(f"{x:g} → {_span(*r)}" for x, r in sorted(spans.items()))
            + " (`tables/fig7_arch_grid.md`, actual_d_model_per_layer).\n\n")


def arch_section(runs: pd.DataFrame, paper: Paper, out: Path) -> Section:
    title = "Architecture (paper Fig. 7)"
    ours = architecture.grid_from_runs(runs) if len(runs) else None
    pgrid = paper.fig7_grid()
    ours_ok = ours is not None and len(ours) > 0
    files = figures.arch(ours if ours_ok else None, pgrid, out / "figures")
    rows = []
    if pgrid is not None:
        rows += [dict(source="paper", **r)
                 for r in architecture.optima_table(pgrid).to_dict("records")]
    if ours_ok:
        rows += [dict(source="ours", **r)
                 for r in architecture.optima_table(ours).to_dict("records")]
        files += _write(ours, out, "fig7_arch_grid")
    # An optimum at the grid's edge has no neighbour on one side to refine it by: shown as such.
    rows = [dict(r, refined=np.nan if r["at_edge"] else r["refined"],
                 refined_loss=np.nan if r["at_edge"] else r["refined_loss"]) for r in rows]
    if rows:
        files += _write(pd.DataFrame(rows), out, "fig7_optima")
    if not ours_ok:
        return Section(title, "No architecture sweep among these runs (sweep `arch`); the figure "
                       "shows the paper's grids only.\n\n" + _img(files, out, "Fig. 7"),
                       [Claim("AttnRes prefers deeper, narrower models", "no runs", "not tested")],
                       files)
    opt = pd.DataFrame(rows)
    text = _md(opt[["source", "variant", "heads_per_layer", "grid_optimum", "grid_loss",
                    "refined", "at_edge"]])
    text += ("\nOptimum: best grid cell, refined by the vertex of a parabola in log(d_model/L_b) "
             "through it and its two neighbours in the same heads/L_b row; at the grid's edge "
             "(at_edge) there is no neighbour on one side, so it is not refined (–) and the true "
             "optimum may lie beyond the grid.\n\n")
    text += _actual_note(ours) + _block_count_note(runs)
    claims = []
    o = opt[opt["source"] == "ours"].set_index("variant")
    if {"baseline", "block"} <= set(o.index):
        sigma, dof = architecture.seed_noise(runs)
        cmp = architecture.compare_cells(ours, "block", sigma=sigma, dof=dof)
        claims.append(_optimum_claim(ours, o.loc["block"], o.loc["baseline"], sigma, dof))
        cell_text, cell_claims = _cells(cmp, sigma, dof)
        text += cell_text
        claims += cell_claims
    return Section(title, text + _img(files, out, "Fig. 7"), claims, files)


AGGREGATE_CLAIM = "AttnRes has the lower loss over the grid (mean difference over its cells)"


def _cells(cmp: pd.DataFrame, sigma: float, dof: int) -> tuple[str, list[Claim]]:
    """The cell-by-cell claim (each cell against the seed noise) and, beside it, the aggregate
    over cells (:func:`_aggregate`)."""
    text, claims = "", []
    k, n = int((cmp["delta"] < 0).sum()), len(cmp)
    won, lost = int((cmp["outcome"] == "win").sum()), int((cmp["outcome"] == "loss").sum())
    repeats = cmp[cmp["nominal"] > 1]
    collapsed = int((repeats["nominal"] - 1).sum())
    same = (f"; {collapsed} nominal cell{'s repeat' if collapsed > 1 else ' repeats'} "
            "another's shape, counted once" if collapsed else "")
    if not n:
        claims.append(Claim("AttnRes wins in every cell (25 of 25)", "no shared cells",
                            "not tested"))
    elif not dof:
        claims.append(Claim("AttnRes wins in every cell (25 of 25)",
                            f"{k} of {n} cells lower by point estimate, one run each and no "
                            f"seed-noise estimate{same}", "inconclusive"))
    else:
        claims.append(Claim("AttnRes wins in every cell (25 of 25)",
                            f"{won} of {n} cells lower and {lost} higher beyond seed noise "
                            f"({k} lower by point estimate){same}",
                            "agrees" if won == n else "does not agree" if lost
                            else "inconclusive"))
    text += (f"Block AttnRes has the lower loss in {k} of {n} distinct model shapes both "
             f"variants have")
    if collapsed:
        # Two nominal cells that trained one model are one comparison, not two.
        text += (f" ({n + collapsed} nominal cells: rounding to whole layers and heads made "
                 + "; ".join(f"cells {r.cells} (d_model/L_b / heads/L_b) one model, "
                             f"{r.shape}" for r in repeats.itertuples())
                 + ", counted once)")
    text += ".\n\n"
    if n and dof:
        text += (f"Seed noise from the shapes trained with two or more seeds: σ = "
                 f"{sigma:.4f} ({dof} degrees of freedom). A cell is a win or a loss only "
                 "when its difference exceeds the 95% interval t·σ·√(1/n_block + "
                 f"1/n_baseline): {won} wins, {lost} losses, {n - won - lost} within noise. "
                 "An optimum is resolved only when each variant's own best cell beats its "
                 "loss at the other variant's best cell by more than that interval.\n\n")
    elif n:
        d = cmp["delta"].abs()
        text += (f"Every cell is one run (one seed), and no shape among these runs was trained "
                 f"with two or more seeds, so they carry no estimate of seed noise: the "
                 f"differences (|Δ| {d.min():.3f} to {d.max():.3f}) and the optima are point "
                 "estimates, and both verdicts are *inconclusive*. A few cells run with more "
                 "seeds would give the grid its noise floor.\n\n")
    agg_text, agg_claim = _aggregate(cmp)
    return text + agg_text, claims + ([agg_claim] if agg_claim else [])


def _aggregate(cmp: pd.DataFrame) -> tuple[str, Claim | None]:
    """Block − baseline over the distinct shapes both have: the mean with a t interval over cells
    and a sign test. One cell alone is within seed noise; an effect shared by most cells is not.
    Cells trained with one seed share it, so their differences may move together, which an
    interval over cells treats as independent: the text says so."""
    d = cmp["delta"].to_numpy(float)
    d = d[np.isfinite(d)]
    if len(d) < 2:
        return "", None
    m, h, n = t_interval(d)
    p = t_p(d)
    lower = int((d < 0).sum())
    sign_p = float(stats.binomtest(lower, n, 0.5).pvalue)
    ours = (f"Δ = {m:+.4f} ± {h:.4f} over {n} cells (t over cells); lower in {lower} of {n}, "
            f"sign test p = {sign_p:.2g}")
    text = (f"**Over the grid.** Block − baseline averaged over the {n} distinct shapes: {ours}. "
            "The cells share seeds (the same seed trains every cell), so their differences are not "
            "fully independent and this interval may be too narrow by as much as they move "
            "together; the cell-by-cell verdict above judges each cell alone.\n\n")
    return text, Claim(AGGREGATE_CLAIM, ours, _verdict(m - h, m + h), p)


def _optimum_claim(grid: pd.DataFrame, a, b, sigma: float, dof: int) -> Claim:
    """Block's optimum (``a``) against the baseline's (``b``), each one cell of a grid.

    The location of an optimum is only as sure as its margin: the claim needs each variant's own
    best cell to beat that variant's loss at the *other* variant's best cell by more than the
    seed-noise interval t·σ·√(1/n₁ + 1/n₂); otherwise either optimum could sit in the other's
    cell and the direction is *inconclusive*, as it is without a noise estimate at all."""
    name = "AttnRes prefers deeper, narrower models (optimum d_model/L_b 45 vs 60)"
    def at(o):
        return "at the grid's edge, not refined" if o.at_edge else f"refined {o.refined:.1f}"

    where = f"block {a.grid_optimum:g} ({at(a)}) vs baseline {b.grid_optimum:g} ({at(b)})"
    spans = _actual_ratios(grid)
    actual = [spans.get(float(x)) for x in sorted({a.grid_optimum, b.grid_optimum})]
    if all(actual) and any(max(abs(lo - x), abs(hi - x)) > NOMINAL_TOLERANCE * x
                           for x, (lo, hi) in zip(sorted({a.grid_optimum, b.grid_optimum}), actual)):
        where += (" nominal, trained at d_model/L_b "
                  + " and ".join(_span(*r) for r in actual))
    if a.grid_optimum == b.grid_optimum:
        return Claim(name, where + "; the same grid column", "inconclusive")
    if not dof:
        return Claim(name, where + "; grid point estimates, one run per cell and no seed-noise "
                     "estimate", "inconclusive")
    X, Y = architecture.X, architecture.Y
    t = stats.t.ppf(0.975, dof)

    def cell(v, opt):
        c = grid[(grid["variant"] == v) & np.isclose(grid[Y], opt.heads_per_layer)
                 & np.isclose(grid[X], opt.grid_optimum)]
        return (float(c["loss"].iloc[0]), float(c["seeds"].iloc[0] if "seeds" in c
                                                else c["n"].iloc[0])) if len(c) else None

    gaps = []
    for v, own, other in (("block", a, b), ("baseline", b, a)):
        mine, theirs = cell(v, own), cell(v, other)
        if mine is None or theirs is None:
            return Claim(name, where + f"; {v} has no run in the other optimum's cell",
                         "inconclusive")
        gaps.append((v, theirs[0] - mine[0], t * sigma * np.sqrt(1 / mine[1] + 1 / theirs[1])))
    clear = all(g > h for _, g, h in gaps)
    verdict = (("agrees" if a.grid_optimum < b.grid_optimum else "does not agree") if clear
               else "inconclusive")
    margins = ", ".join(f"{v} {g:.4f} ± {h:.4f}" for v, g, h in gaps)
    return Claim(name, f"{where}; margin of each optimum over the other's cell: {margins}"
                 + ("" if clear else " (within seed noise)"), verdict)
