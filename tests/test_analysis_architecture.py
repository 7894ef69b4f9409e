"""Optimum finder for the architecture sweep (paper Fig. 7) — analysis/architecture.py."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis.architecture import (compare_cells, find_optimum, grid_from_runs, optima_table,
                                   refine_vertex, seed_noise, wins)
from analysis.paper import load_paper


@pytest.fixture(scope="module")
def paper_grid():
    return load_paper().fig7_grid()


@pytest.mark.parametrize("variant, grid_opt, left, right", [
    ("baseline", 60, 45, 75),
    ("block", 45, 30, 60),  # the paper's "attnres"
])
def test_paper_grid_optimum_at_heads_0_3(paper_grid, variant, grid_opt, left, right):
    opt = find_optimum(paper_grid, variant, heads_per_layer=0.3)
    assert opt.grid_optimum == grid_opt
    assert (opt.left, opt.right) == (left, right) and not opt.at_edge
    assert left < opt.refined < right
    assert opt.refined_loss <= opt.grid_loss  # the vertex is the parabola's minimum


def test_paper_grid_refined_values(paper_grid):
    """Independent check of the vertex: the parabola through the three baseline points
    (45, 1.851), (60, 1.847), (75, 1.858) in log d/L, solved by hand with numpy.linalg."""
    xs, ys = np.log([45.0, 60.0, 75.0]), np.array([1.851, 1.847, 1.858])
    a, b, _ = np.linalg.solve(np.vander(xs, 3), ys)
    opt = find_optimum(paper_grid, "baseline", 0.3)
    assert opt.refined == pytest.approx(np.exp(-b / (2 * a)), rel=1e-9)


def test_default_row_is_the_best_cell(paper_grid):
    """Without a row, the optimum is taken in the row of the variant's best cell; the paper's
    1.847 (baseline) and 1.802 (AttnRes) both sit at heads/L_b = 0.3."""
    table = optima_table(paper_grid).set_index("variant")
    assert table.loc["baseline", "grid_loss"] == pytest.approx(1.847)
    assert table.loc["block", "grid_loss"] == pytest.approx(1.802)
    assert (table["heads_per_layer"] == 0.3).all()
    # and the paper's reading: AttnRes prefers smaller d_model/L_b (deeper models)
    assert table.loc["block", "refined"] < table.loc["baseline", "refined"]


def test_attnres_wins_every_paper_cell(paper_grid):
    assert wins(paper_grid, "block") == (25, 25)


def test_edge_optimum_is_not_refined():
    grid = pd.DataFrame({"variant": "v", "heads_per_layer": 0.5,
                         "d_model_per_layer": [15, 30, 45], "loss": [1.9, 1.95, 2.0]})
    opt = find_optimum(grid, "v")
    assert opt.at_edge and opt.refined == 15 and opt.left is None


def test_refine_vertex_exact_for_log_parabola():
    xs = np.array([10.0, 20.0, 40.0])
    ys = 3.0 + 0.5 * (np.log(xs) - np.log(25.0)) ** 2
    x, y = refine_vertex(xs, ys)
    assert x == pytest.approx(25.0, rel=1e-9) and y == pytest.approx(3.0, abs=1e-12)


def test_grid_from_runs_averages_seeds_and_rounds_ratios():
    runs = pd.DataFrame({"variant": ["b", "b", "b"], "d_model": [96, 96, 100],
                         "layers": [6, 6, 6], "n_heads": [3, 3, 3],
                         "final_val_loss": [2.0, 2.2, 1.5]})
    g = grid_from_runs(runs)
    assert len(g) == 2
    cell = g[g["d_model_per_layer"] == 16.0].iloc[0]
    assert cell["loss"] == pytest.approx(2.1) and cell["n"] == 2 and cell["heads_per_layer"] == 0.5
    assert 16.67 in set(g["d_model_per_layer"])


def test_grid_uses_nominal_cells_when_logged():
    """A budget-generated sweep rounds shapes differently per cell; the logged nominal ratios
    (sweep.arch.*) key the grid so the cells line up."""
    runs = pd.DataFrame({"variant": "b", "d_model": [90, 96], "layers": [6, 6], "n_heads": [3, 2],
                         "arch_d_model_per_layer": [15.0, 15.0],
                         "arch_heads_per_layer": [0.5, 0.3], "final_val_loss": [2.0, 2.1]})
    g = grid_from_runs(runs)
    assert set(g["d_model_per_layer"]) == {15.0}
    assert sorted(g["actual_d_model_per_layer"]) == [15.0, 16.0]


def _two_cells_one_model(losses_block=(2.0, 2.0), seeds=(0,)):
    """Nominal cells 40/0.25 and 40/0.5 that both rounded to 112×2×1 (as in our sweep), plus a
    distinct 27/0.5 cell, for block and baseline."""
    rows = []
    for v, (l40, l27) in (("baseline", (2.1, 2.1)), ("block", losses_block)):
        for seed in seeds:
            for y in (0.25, 0.5):
                rows.append({"variant": v, "seed": seed, "d_model": 112, "layers": 2,
                             "n_heads": 1, "arch_d_model_per_layer": 40.0,
                             "arch_heads_per_layer": y, "final_val_loss": l40 + 0.01 * seed})
            rows.append({"variant": v, "seed": seed, "d_model": 92, "layers": 3, "n_heads": 2,
                         "arch_d_model_per_layer": 27.0, "arch_heads_per_layer": 0.5,
                         "final_val_loss": l27 + 0.01 * seed})
    return pd.DataFrame(rows)


def test_cells_of_one_actual_shape_count_once():
    g = grid_from_runs(_two_cells_one_model(losses_block=(2.0, 2.2)))
    assert set(g["shape"]) == {"112×2×1", "92×3×2"}
    assert wins(g, "block") == (1, 2)  # not (2, 3): 40/0.25 and 40/0.5 are one model
    c = compare_cells(g, "block").set_index("shape")
    assert c.loc["112×2×1", "nominal"] == 2 and c.loc["112×2×1", "cells"] == "40/0.25, 40/0.5"
    assert (c["outcome"] == "n/a").all() and c["half"].isna().all()  # no seed noise to judge by


def test_seed_noise_counts_distinct_seeds_only():
    # One seed: the two nominal cells of one model are one experiment, not a replicate.
    sigma, dof = seed_noise(_two_cells_one_model())
    assert np.isnan(sigma) and dof == 0
    # Seeds 0 and 1 differ by 0.01 in every (variant, shape): σ = 0.01/√2, one dof per shape.
    sigma, dof = seed_noise(_two_cells_one_model(seeds=(0, 1)))
    assert dof == 4 and sigma == pytest.approx(0.01 / np.sqrt(2), rel=1e-9)
    g = grid_from_runs(_two_cells_one_model(losses_block=(2.0, 2.2), seeds=(0, 1)))
    c = compare_cells(g, "block", sigma=sigma, dof=dof).set_index("shape")
    half = stats.t.ppf(0.975, 4) * sigma * np.sqrt(1 / 2 + 1 / 2)
    assert c["half"].to_numpy() == pytest.approx([half, half])
    assert dict(c["outcome"]) == {"112×2×1": "win", "92×3×2": "loss"}  # |Δ| = 0.1 > 0.0196
