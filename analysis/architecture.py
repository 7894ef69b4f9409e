"""The architecture sweep (paper Fig. 7): loss over d_model/L_b × heads/L_b, and its optimum.

The optimum is the best grid cell, refined by the vertex of the parabola through it and its two
neighbours in log(d_model/L_b). Variants are compared per actual shape (d_model × layers × heads),
and a cell's difference counts only beyond the seed noise; see docs/ANALYSIS.md.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
from scipy import stats

from .significance import pooled_seed_sd

X, Y, V = "d_model_per_layer", "heads_per_layer", "loss"


@dataclass(frozen=True)
class Optimum:
    variant: str
    heads_per_layer: float
    grid_optimum: float          # d_model/L_b of the best grid cell in that row
    grid_loss: float
    left: float | None           # neighbours used for the refinement (None at an edge)
    right: float | None
    refined: float               # vertex of the parabola in log(d_model/L_b); = grid at an edge
    refined_loss: float
    at_edge: bool


def refine_vertex(xs, ys) -> tuple[float, float]:
    """Vertex (x*, y*) of the parabola through three points given in log-x (the grid is roughly
    geometric, and loss over aspect ratio is closer to symmetric in log scale). With the middle
    point strictly lowest the vertex lies strictly between the outer two, inside the grid's bracket.

    Returns the middle point itself if the parabola is not convex (then there is no minimum)."""
    lx = np.log(np.asarray(xs, dtype=float))
    a, b, c = np.polyfit(lx, np.asarray(ys, dtype=float), 2)
    if not a > 0:
        return float(xs[1]), float(ys[1])
    v = -b / (2 * a)
    return float(np.exp(v)), float(np.polyval([a, b, c], v))


def find_optimum(grid: pd.DataFrame, variant: str, heads_per_layer: float | None = None) -> Optimum:
    """Optimum d_model/L_b of one variant on a grid with columns variant, heads_per_layer,
    d_model_per_layer, loss (one row per cell; average seeds before calling)."""
    g = grid[grid["variant"] == variant].dropna(subset=[X, Y, V])
    if g.empty:
        raise ValueError(f"no grid cells for variant {variant!r}")
    if heads_per_layer is None:  # the row of the best cell (the paper's optima are grid minima)
        heads_per_layer = float(g.loc[g[V].idxmin(), Y])
    row = g[np.isclose(g[Y], heads_per_layer)].sort_values(X)
    if row.empty:
        raise ValueError(f"no cells for {variant!r} at heads/layers = {heads_per_layer}")
    xs, ys = row[X].to_numpy(float), row[V].to_numpy(float)
    i = int(np.argmin(ys))
    if 0 < i < len(xs) - 1:
        rx, ry = refine_vertex(xs[i - 1:i + 2], ys[i - 1:i + 2])
        left, right, edge = float(xs[i - 1]), float(xs[i + 1]), False
    else:
        rx, ry, left, right, edge = float(xs[i]), float(ys[i]), None, None, True
    return Optimum(variant=variant, heads_per_layer=float(heads_per_layer),
                   grid_optimum=float(xs[i]), grid_loss=float(ys[i]), left=left, right=right,
                   refined=rx, refined_loss=ry, at_edge=edge)


def optima_table(grid: pd.DataFrame, per_row: bool = False) -> pd.DataFrame:
    """Optimum of every variant (``per_row``: of every variant and heads/L_b row)."""
    out = []
    for v in sorted(grid["variant"].unique()):
        rows = sorted(grid.loc[grid["variant"] == v, Y].dropna().unique()) if per_row else [None]
        out += [asdict(find_optimum(grid, v, h)) for h in rows]
    return pd.DataFrame(out)


def shape_of(runs: pd.DataFrame) -> pd.Series:
    """The actual model shape of each run, "d_model×layers×heads" (what was trained, whatever
    nominal cell the sweep meant it for)."""
    return (runs["d_model"].astype(int).astype(str) + "×" + runs["layers"].astype(int).astype(str)
            + "×" + runs["n_heads"].astype(int).astype(str))


def _seed_key(r: pd.DataFrame) -> pd.Series:
    # Runs of one shape and one seed are one experiment, however many nominal cells logged it; a
    # run without a seed cannot be matched to another and counts on its own.
    seed = (pd.to_numeric(r["seed"], errors="coerce") if "seed" in r
            else pd.Series(np.nan, index=r.index))
    own = pd.Series([f"run{i}" for i in range(len(r))], index=r.index)
    return seed.map(lambda x: f"seed{x:g}" if pd.notna(x) else None).fillna(own)


def grid_from_runs(runs: pd.DataFrame, metric: str = "final_val_loss", digits: int = 2
                   ) -> pd.DataFrame:
    """Average seeds into grid cells.

    A sweep generated from a parameter budget cannot hit its nominal ratios exactly (L_b and
    the head count are integers, the head dimension must be whole), and the rounding differs
    from cell to cell, so actual ratios do not line up in a grid. Cells are therefore keyed by
    the nominal ratios the sweep logged (``sweep.arch.*``) when present, else by the actual
    ratios rounded to ``digits`` decimals; the mean actual ratios are kept beside them, with the
    actual ``shape`` (:func:`shape_of`; shapes joined by "," if a cell mixes several) and the
    number of distinct ``seeds`` (``n`` counts runs).
    """
    r = runs.dropna(subset=["d_model", "layers", "n_heads", metric]).copy()
    actual_x, actual_y = r["d_model"] / r["layers"], r["n_heads"] / r["layers"]
    nom_x = r["arch_d_model_per_layer"] if "arch_d_model_per_layer" in r else actual_x * np.nan
    nom_y = r["arch_heads_per_layer"] if "arch_heads_per_layer" in r else actual_y * np.nan
    r[X] = nom_x.where(nom_x.notna(), actual_x.round(digits))
    r[Y] = nom_y.where(nom_y.notna(), actual_y.round(digits))
    r["actual_" + X], r["actual_" + Y] = actual_x, actual_y
    r["shape"], r["_seed"] = shape_of(r), _seed_key(r)
    g = (r.groupby(["variant", Y, X])
         .agg(loss=(metric, "mean"), n=(metric, "count"), seeds=("_seed", "nunique"),
              shape=("shape", lambda s: ",".join(sorted(set(s)))),
              **{f"actual_{X}": (f"actual_{X}", "mean"), f"actual_{Y}": (f"actual_{Y}", "mean")})
         .reset_index())
    return g


def seed_noise(runs: pd.DataFrame, metric: str = "final_val_loss") -> tuple[float, int]:
    """(σ, degrees of freedom): seed-to-seed standard deviation pooled over every (variant, actual
    shape) trained with two or more distinct seeds; (NaN, 0) when there is none.

    A nominal cell's runs are not replicates when they are one shape and one seed logged twice,
    so runs are first averaged per (variant, shape, seed); only distinct seeds give degrees of
    freedom. Seed noise is the only yardstick for a grid with one run per cell, which is why the
    report looks for it among the sweep's own runs rather than borrowing another model size's."""
    r = runs.dropna(subset=["d_model", "layers", "n_heads", metric])
    if r.empty:
        return np.nan, 0
    r = r.assign(shape=shape_of(r), _seed=_seed_key(r))
    per_seed = r.groupby(["variant", "shape", "_seed"])[metric].mean().reset_index()
    return pooled_seed_sd(per_seed, metric, by=["variant", "shape"])


def compare_cells(grid: pd.DataFrame, variant: str, baseline: str = "baseline",
                  sigma: float = np.nan, dof: int = 0, level: float = 0.95) -> pd.DataFrame:
    """``variant`` against ``baseline`` in every cell both have, one row per distinct shape.

    Columns: heads/L_b and d_model/L_b of the (first) nominal cell, shape, ``nominal`` (how many
    nominal cells share that shape) and ``cells`` (them, as d_model/L_b / heads/L_b), both
    losses, delta = loss(variant) − loss(baseline), ``half`` = t_{dof}·σ·√(1/n_variant +
    1/n_baseline) with n the distinct seeds in each cell (the 95% interval of the difference of
    two cell means under the pooled seed noise ``sigma`` with ``dof`` degrees of freedom), and
    ``outcome``: ``win`` / ``loss`` when |delta| exceeds ``half``, ``tie`` within it, ``n/a``
    without a noise estimate (then the sign of delta is all there is, and at one seed per cell
    that is not evidence)."""
    cols = [Y, X, "shape", "nominal", "cells", "loss", "loss_base", "delta", "half", "outcome"]
    a, b = grid[grid["variant"] == variant], grid[grid["variant"] == baseline]
    m = a.merge(b, on=[Y, X], suffixes=("", "_base")).sort_values([Y, X])
    if m.empty:
        return pd.DataFrame(columns=cols)
    m["cells"] = [f"{x:g}/{y:g}" for x, y in zip(m[X], m[Y])]
    if "shape" in m:
        # One row per actual shape, at its first nominal cell in (heads/L_b, d_model/L_b) order.
        by = m.groupby("shape", sort=False)
        m["nominal"] = by["cells"].transform("size")
        m["cells"] = by["cells"].transform(", ".join)
        m = m.drop_duplicates("shape").copy()
    else:  # the paper's grid: its cells are its models
        m["shape"], m["nominal"] = None, 1
    n_col = "seeds" if "seeds" in m else "n"
    na = m[n_col].to_numpy(float) if n_col in m else np.ones(len(m))
    nb = m[n_col + "_base"].to_numpy(float) if n_col + "_base" in m else np.ones(len(m))
    m["delta"] = m["loss"] - m["loss_base"]
    if dof and np.isfinite(sigma):
        m["half"] = stats.t.ppf((1 + level) / 2, dof) * sigma * np.sqrt(1 / na + 1 / nb)
        m["outcome"] = np.where(m["delta"] < -m["half"], "win",
                                np.where(m["delta"] > m["half"], "loss", "tie"))
    else:
        m["half"], m["outcome"] = np.nan, "n/a"
    return m[cols].reset_index(drop=True)


def wins(grid: pd.DataFrame, variant: str, baseline: str = "baseline") -> tuple[int, int]:
    """(cells where ``variant`` has lower loss than the baseline, cells both have), by point
    estimate; cells of one actual shape count once (see :func:`compare_cells`)."""
    c = compare_cells(grid, variant, baseline)
    return int((c["delta"] < 0).sum()), int(len(c))


def pivot(grid: pd.DataFrame, variant: str) -> pd.DataFrame:
    """heads/L_b (rows, descending as in the paper's figure) × d_model/L_b (columns)."""
    g = grid[grid["variant"] == variant]
    return g.pivot_table(index=Y, columns=X, values=V).sort_index(ascending=False)
