"""Seed statistics, the Table-4 layout and rank agreement — analysis/ablation.py."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis import ablation as abl
from analysis.paper import TABLE4_ORDER, load_paper
from analysis.significance import holm, t_interval, welch_interval


def test_t_interval_matches_scipy():
    v = np.array([1.80, 1.83, 1.79, 1.81])
    mean, half, n = t_interval(v)
    lo, hi = stats.t.interval(0.95, len(v) - 1, loc=v.mean(), scale=stats.sem(v))
    assert (mean - half, mean + half) == pytest.approx((lo, hi), rel=1e-12)
    assert n == 4
    assert np.isnan(t_interval([1.8])[1])  # one seed: no interval, not zero width


def test_welch_interval_matches_scipy():
    a, b = np.array([1.70, 1.72, 1.71]), np.array([1.76, 1.80, 1.77, 1.75])
    d, h = welch_interval(a, b)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (d - h, d + h) == pytest.approx((ci.low, ci.high), rel=1e-10)


def test_holm_adjustment_by_hand():
    """Holm (1979) on [0.01, 0.04, 0.03, NaN]: sorted 0.01·3, 0.03·2, 0.04·1 = 0.03, 0.06, 0.04,
    made monotone: 0.03, 0.06, 0.06; NaN is not one of the m tests."""
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03, np.nan]), [0.03, 0.06, 0.06, np.nan], rtol=1e-12)
    np.testing.assert_allclose(holm([0.6, 0.9]), [1.0, 1.0])  # capped at 1


def test_table_p_values_are_welch_and_holm_over_the_variants():
    """p: Welch's test against the baseline (scipy, 1e-12); p_holm: those p-values with Holm's
    correction over the compared variants (the baseline is not one of them)."""
    runs = _runs({"baseline": [1.80, 1.82, 1.81], "full": [1.70, 1.72, 1.71], "block": [1.79, 1.83, 1.80]})
    t = abl.ablation_table(runs).table.set_index("variant")
    assert np.isnan(t.loc["baseline", "p"]) and np.isnan(t.loc["baseline", "p_holm"])
    p_full = stats.ttest_ind([1.70, 1.72, 1.71], [1.80, 1.82, 1.81], equal_var=False).pvalue
    assert t.loc["full", "p"] == pytest.approx(p_full, rel=1e-12)
    np.testing.assert_allclose(t.loc[["full", "block"], "p_holm"], holm(t.loc[["full", "block"], "p"]), rtol=1e-12)
    assert t.loc["full", "p_holm"] == pytest.approx(2 * p_full, rel=1e-12)  # the smaller of 2 tests


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
    assert r"full\_sigmoid" in tex and r"\begin{tabular}{lrrrrrrrr}" in tex and "$\\pm$" in tex
    assert tex.isascii() and r"Kendall $\tau$ = " in tex  # pdflatex refuses a raw τ
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


def test_block_size_table_derives_N_when_only_S_is_logged():
    """The block_size sweep logs residual.block_size but not num_blocks: N = 2·layers / S
    (Fig. 6's second axis), S = 1 (Full) being N = L."""
    runs = pd.DataFrame({
        "variant": ["block", "block", "block", "baseline"], "block_size": [1, 4, 32, 4],
        "layers": [16, 16, 16, 16], "num_blocks": [np.nan] * 4,
        "final_val_loss": [1.9, 1.92, 1.95, 2.0]})
    t = abl.block_size_table(runs).set_index("label")
    assert t.loc["1", "N"] == 32 and t.loc["4", "N"] == 8 and t.loc["32", "N"] == 1
    assert np.isnan(t.loc["baseline", "N"])


def test_block_size_of_takes_num_blocks_first_as_the_model_does():
    """A run that set residual.num_blocks still logs block_size at its default 4; the model's S
    is then 2·layers / num_blocks (attnres.residuals.resolve_block_size), here 32 / 2 = 16."""
    runs = pd.DataFrame({"variant": ["block", "block", "full"], "block_size": [4, 4, 4],
                         "layers": [16, 16, 16], "num_blocks": [2, np.nan, np.nan],
                         "final_val_loss": [1.9, 1.92, 1.95]})
    assert list(abl.block_size_of(runs)) == [16.0, 4.0, 1.0]
    t = abl.block_size_table(runs).set_index("label")
    assert t.loc["16", "N"] == 2 and t.loc["4", "n"] == 1
