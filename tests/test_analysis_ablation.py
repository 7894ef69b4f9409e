"""Seed statistics, the Table-4 layout and rank agreement — analysis/ablation.py."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis import ablation as abl
from analysis.paper import TABLE4_ORDER, load_paper


def test_t_interval_matches_scipy():
    v = np.array([1.80, 1.83, 1.79, 1.81])
    mean, half, n = abl.t_interval(v)
    lo, hi = stats.t.interval(0.95, len(v) - 1, loc=v.mean(), scale=stats.sem(v))
    assert (mean - half, mean + half) == pytest.approx((lo, hi), rel=1e-12)
    assert n == 4
    assert np.isnan(abl.t_interval([1.8])[1])  # one seed: no interval, not zero width


def test_welch_interval_matches_scipy():
    a, b = np.array([1.70, 1.72, 1.71]), np.array([1.76, 1.80, 1.77, 1.75])
    d, h = abl.welch_interval(a, b)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (d - h, d + h) == pytest.approx((ci.low, ci.high), rel=1e-10)


def _runs(losses: dict[str, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"variant": v, "final_val_loss": x}
                         for v, xs in losses.items() for x in xs])


def test_table_on_paper_numbers_reproduces_paper():
    """Fed the paper's own losses (three seeds at ±0.001 around each), the table reproduces its
    deltas and ranks (τ = 1), in the paper's row order, with hc (no paper row) last."""
    paper = load_paper().table4_loss()
    runs = _runs({**{v: [x - 0.001, x, x + 0.001] for v, x in paper.items()}, "hc": [1.75] * 3})
    res = abl.ablation_table(runs, paper)
    t = res.table
    assert list(t["variant"]) == ["baseline", "denseformer", "mhc", "full", "hc"] + TABLE4_ORDER[4:]
    assert t.set_index("variant")["loss"].drop("hc").to_dict() == pytest.approx(paper)
    np.testing.assert_allclose(t["delta"].drop(index=t.index[t.variant == "hc"]),
                               t["paper_delta"].dropna(), atol=1e-12)
    assert res.tau == pytest.approx(1.0) and res.n_common == 12 and res.p_value < 1e-3
    v = t.set_index("variant")["verdict"]
    assert v["full"] == "better" and v["denseformer"] == "tie" and v["baseline"] == "n/a"


def test_reversed_ranking_gives_negative_tau():
    paper = {"baseline": 1.766, "block": 1.746, "full": 1.737}
    res = abl.ablation_table(_runs({"baseline": [1.70], "block": [1.75], "full": [1.80]}), paper)
    assert res.tau == pytest.approx(-1.0)
    assert (res.table["verdict"] == "n/a").all()  # single seeds: no interval, no verdict


def test_writers(tmp_path):
    paper = load_paper().table4_loss()
    res = abl.ablation_table(_runs({"baseline": [2.0, 2.01], "full_sigmoid": [1.98, 1.97]}), paper)
    md, tex = (p.read_text() for p in abl.write_tables(res, tmp_path)[1:])
    assert md.count("\n|") == 3 and "full_sigmoid" in md and "Kendall τ" in md
    assert r"full\_sigmoid" in tex and r"\begin{tabular}{lrrrrrr}" in tex and "$\\pm$" in tex
    back = pd.read_csv(tmp_path / "table4_ablation.csv")
    assert back.loc[1, "delta"] == pytest.approx(-0.03)


def test_block_size_table():
    runs = pd.DataFrame({
        "variant": ["full", "block", "block", "block", "baseline"],
        "block_size": [np.nan, 4, np.nan, 4, np.nan], "layers": [4, 4, 4, 4, 4],
        "num_blocks": [np.nan, 2, 1, 2, np.nan], "final_val_loss": [1.9, 1.92, 1.95, 1.94, 2.0]})
    t = abl.block_size_table(runs).set_index("label")
    assert list(t.index) == ["1", "4", "8", "baseline"]  # S = 8 derived from 2·layers / N
    assert t.loc["4", "loss"] == pytest.approx(1.93) and t.loc["4", "n"] == 2
