"""The architecture sweep (paper Fig. 7): loss over d_model/L_b × heads/L_b, and its optimum.

The paper reads off "the baseline is best at d_model/L_b ≈ 60, AttnRes at ≈ 45" from a 5×5 grid.
A grid only resolves the optimum to its spacing, so we refine it the usual way: fit the parabola
through the best grid point and its two neighbours, in log(d_model/L_b) (the grid is roughly
geometric and loss curves over aspect ratio are closer to symmetric in log scale), and take its
vertex. The vertex of a parabola through three points whose middle one is strictly lowest always
lies strictly between the outer two, so the refinement can never leave the bracket the grid
established. At a grid edge there is no bracket and the grid value is returned as is.

The per-variant optimum is taken in the heads/L_b row holding the variant's best cell (the
paper's 1.847 and 1.802 are both grid minima); :func:`find_optimum` also takes a given row.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

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
    """Vertex (x*, y*) of the parabola through three points given in log-x.

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
    if heads_per_layer is None:
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


def grid_from_runs(runs: pd.DataFrame, metric: str = "final_val_loss", digits: int = 2
                   ) -> pd.DataFrame:
    """Average seeds into grid cells.

    A sweep generated from a parameter budget cannot hit its nominal ratios exactly (L_b and
    the head count are integers, the head dimension must be whole), and the rounding differs
    from cell to cell, so actual ratios do not line up in a grid. Cells are therefore keyed by
    the nominal ratios the sweep logged (``sweep.arch.*``) when present, else by the actual
    ratios rounded to ``digits`` decimals; the mean actual ratios are kept beside them.
    """
    r = runs.dropna(subset=["d_model", "layers", "n_heads", metric]).copy()
    actual_x, actual_y = r["d_model"] / r["layers"], r["n_heads"] / r["layers"]
    nom_x = r["arch_d_model_per_layer"] if "arch_d_model_per_layer" in r else actual_x * np.nan
    nom_y = r["arch_heads_per_layer"] if "arch_heads_per_layer" in r else actual_y * np.nan
    r[X] = nom_x.where(nom_x.notna(), actual_x.round(digits))
    r[Y] = nom_y.where(nom_y.notna(), actual_y.round(digits))
    r["actual_" + X], r["actual_" + Y] = actual_x, actual_y
    g = (r.groupby(["variant", Y, X])
         .agg(loss=(metric, "mean"), n=(metric, "count"),
              **{f"actual_{X}": (f"actual_{X}", "mean"), f"actual_{Y}": (f"actual_{Y}", "mean")})
         .reset_index())
    return g


def wins(grid: pd.DataFrame, variant: str, baseline: str = "baseline") -> tuple[int, int]:
    """(cells where ``variant`` has lower loss than the baseline, cells both have)."""
    a = grid[grid["variant"] == variant].set_index([Y, X])[V]
    b = grid[grid["variant"] == baseline].set_index([Y, X])[V]
    both = a.index.intersection(b.index)
    return int((a[both] < b[both]).sum()), int(len(both))


def pivot(grid: pd.DataFrame, variant: str) -> pd.DataFrame:
    """heads/L_b (rows, descending as in the paper's figure) × d_model/L_b (columns)."""
    g = grid[grid["variant"] == variant]
    return g.pivot_table(index=Y, columns=X, values=V).sort_index(ascending=False)
