"""Paired statistics of the analysis (analysis.significance, analysis.noise): same-seed intervals
against hand-computed values, ratios on the log scale, power from a stated effect, whether a
ranking is resolvable, and the noise study on synthetic runs whose σ and correlation are known.
All values float64; tolerances stated per assertion."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis import noise
from analysis.ablation import ablation_table
from analysis.significance import (compare, log_t_interval, mde, rank_resolution,
                                   seeds_needed_paired, t_test_power)


def test_paired_interval_matches_the_hand_computed_t_interval_on_same_seed_differences():
    # differences 0.5, 0.2, 0.9: mean 0.5333, sd 0.35119, se 0.20276; t_{0.975,2} = 4.302653;
    # t = 2.6304 and, for 2 df, P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2)), so p = 0.11924.
    a, b = [3.0, 1.0, 2.0, 9.0], [0.5, 1.8, 2.1]
    c = compare(a, b, seeds_a=[2, 0, 1, 7], seeds_b=[0, 1, 2])  # seed 7 has no partner
    assert c.design == "paired" and c.n == 3
    assert c.diff == pytest.approx(0.533333, abs=1e-6)
    assert c.half == pytest.approx(4.302653 * 0.351188 / np.sqrt(3), abs=1e-5)
    assert c.p == pytest.approx(0.11924, abs=1e-4)
    # Welch beside it uses every run, the unmatched seed too.
    assert c.welch_diff == pytest.approx(np.mean(a) - np.mean(b), abs=1e-12)


def test_pairing_the_committed_block_runs_gives_the_issue_p_value():
    # block − baseline per seed −0.194, −0.089, −0.136 (the first study's runs): paired p 0.044,
    # where Welch over the same runs gives 0.117.
    block = [2.436616, 2.350103, 2.434538]
    base = [2.630416, 2.438613, 2.570749]
    c = compare(block, base, [0, 1, 2], [0, 1, 2])
    assert c.p == pytest.approx(0.0446, abs=5e-4)
    assert c.welch_p == pytest.approx(0.117, abs=1e-3)
    assert c.hi < 0 < c.welch_diff + c.welch_half  # paired excludes 0, Welch does not


def test_without_two_shared_seeds_the_primary_interval_is_welch():
    c = compare([1.0, 1.2, 1.1], [0.9, 1.0], seeds_a=[0, 1, 2], seeds_b=[2, 5])
    assert c.design == "welch" and c.diff == c.welch_diff and c.half == c.welch_half
    c = compare([1.0, 1.2, 1.1], [0.9, 1.0, 0.95])
    assert c.design == "welch"


def test_ratios_are_compared_on_the_log_scale():
    # a/b per seed: 2/1 and 8/2, log ratios log 2 and log 4: mean 1.5 log 2, ratio 2^1.5.
    c = compare([2.0, 8.0], [1.0, 2.0], [0, 1], [0, 1], log=True)
    assert c.ratio[0] == pytest.approx(2 ** 1.5, rel=1e-12)
    assert c.ratio[1] > 0  # a ratio's interval stays positive
    gm, lo, hi, p = log_t_interval([2.0, 8.0])
    assert gm == pytest.approx(4.0, rel=1e-12)
    half = stats.t.ppf(0.975, 1) * np.std(np.log([2.0, 8.0]), ddof=1) / np.sqrt(2)
    assert lo == pytest.approx(4.0 * np.exp(-half), rel=1e-9)
    assert hi == pytest.approx(4.0 * np.exp(half), rel=1e-9)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_minimum_detectable_effect_has_the_stated_power(n):
    sigma = 0.05
    d = mde(sigma, n, paired=True)
    df, ncp = n - 1, d / sigma * np.sqrt(n)  # one-sample t on n differences
    crit = stats.t.ppf(0.975, df)
    power = stats.nct.sf(crit, df, ncp) + stats.nct.cdf(-crit, df, ncp)
    assert power == pytest.approx(0.8, abs=1e-4)
    u = mde(sigma, n, paired=False)
    assert t_test_power(n, u / sigma) == pytest.approx(0.8, abs=1e-4)
    # Independent arms: same-seed differences scatter with σ√2, and the paired test has fewer
    # degrees of freedom (n − 1 against 2n − 2), so it can only do worse than the unpaired one.
    assert u < mde(sigma * np.sqrt(2), n, paired=True)


def test_seeds_needed_paired_matches_textbook_sample_sizes():
    # One-sample two-sided t test, α 5%, power 80%: d = 0.5 → 34, d = 1 → 10, d = 0.8 → 15.
    assert seeds_needed_paired(1.0, 0.5) == 34
    assert seeds_needed_paired(0.04, 0.04) == 10
    assert seeds_needed_paired(1.0, -0.8) == 15
    assert seeds_needed_paired(0.001, 1.0) == 2
    assert np.isnan(seeds_needed_paired(0.03, 0.0)) and np.isnan(seeds_needed_paired(np.nan, 0.1))


def _runs(means: dict, noise_by_seed, seeds=(0, 1, 2)):
    return pd.DataFrame([{"variant": v, "seed": s, "final_val_loss": m + noise_by_seed[i]}
                         for v, m in means.items() for i, s in enumerate(seeds)])


def test_rank_resolution_tells_resolvable_from_noise():
    seed_effect = [0.10, -0.05, 0.02]  # shared by every variant at a seed: the block effect
    apart = _runs({"a": 1.0, "b": 1.1, "c": 1.2}, seed_effect)
    apart.loc[apart.index[::4], "final_val_loss"] += 0.001  # some residual noise
    r = rank_resolution(apart, {"a": 1.0, "b": 1.1, "c": 1.2}, n_boot=200)
    assert r.f_p < 1e-3  # the seed blocks absorb the shared effect; the variants differ
    # SE of a mean ≈ 0.076/√3 ≈ 0.044 against a reference spaced 0.1 apart: 3 variants give τ's
    # exact test p ≥ 1/3 at best, so no spacing can make it significant: power 0.
    assert r.power == 0.0 and not r.resolvable
    many = {f"v{i}": 1.0 + 0.5 * i for i in range(8)}
    r = rank_resolution(_runs(many, [0.0, 0.01, -0.01]), many, n_boot=200)
    assert r.power > 0.95 and r.resolvable  # 8 variants 0.5 apart, SE 0.006: resolvable
    close = {k: 1.0 + 0.001 * i for i, k in enumerate(many)}
    r = rank_resolution(_runs(close, [0.0, 0.01, -0.01]), close, n_boot=200)
    assert r.power < 0.5 and not r.resolvable  # the same runs against a 0.007-wide reference
    same = _runs({"a": 1.0, "b": 1.0, "c": 1.0}, seed_effect)
    same.loc[[0, 4, 8], "final_val_loss"] += [0.01, -0.01, 0.0]
    r = rank_resolution(same, {"a": 1, "b": 2, "c": 3}, n_boot=200)
    assert r.f_p > 0.05
    assert -1 <= r.tau_lo <= r.tau_hi <= 1


def test_ablation_table_primary_interval_is_paired_and_welch_is_beside_it():
    runs = pd.DataFrame({"variant": ["baseline"] * 3 + ["block"] * 3, "seed": [0, 1, 2] * 2,
                         "final_val_loss": [2.630416, 2.438613, 2.570749,
                                            2.436616, 2.350103, 2.434538]})
    t = ablation_table(runs, {"baseline": 1.766, "block": 1.746}, n_boot=0).table.set_index("variant")
    assert t.loc["block", "design"] == "paired" and t.loc["block", "pairs"] == 3
    assert t.loc["block", "verdict"] == "better"
    assert t.loc["block", "p"] == pytest.approx(0.0446, abs=5e-4)
    assert t.loc["block", "welch_p"] == pytest.approx(0.117, abs=1e-3)


def test_noise_table_recovers_known_sigma_and_correlation():
    rng = np.random.default_rng(0)
    n, sa, sb, rho = 4000, 0.05, 0.04, 0.8
    cov = [[sa ** 2, rho * sa * sb], [rho * sa * sb, sb ** 2]]
    x = rng.multivariate_normal([2.0, 2.1], cov, size=n)
    runs = pd.DataFrame({"variant": ["block"] * n + ["baseline"] * n,
                         "seed": np.r_[np.arange(n), np.arange(n)],
                         "final_val_loss": np.r_[x[:, 0], x[:, 1]]})
    row = noise.noise_table(runs, variants=["block"], ns=(4,), target=0.02).iloc[0]
    sd_diff = np.sqrt(sa ** 2 + sb ** 2 - 2 * rho * sa * sb)  # 0.03
    assert row["pairs"] == n
    # 4000 draws: the sample σ's relative error is about 1/sqrt(2·4000) ≈ 1.1%; 5% is 4 SE.
    assert row["sd_variant"] == pytest.approx(sa, rel=0.05)
    assert row["sd_baseline"] == pytest.approx(sb, rel=0.05)
    assert row["sd_diff"] == pytest.approx(sd_diff, rel=0.05)
    assert row["corr"] == pytest.approx(rho, abs=0.03)
    assert row["mde_paired_n4"] == pytest.approx(mde(row["sd_diff"], 4, True), rel=1e-12)
    assert row["seeds_paired"] == seeds_needed_paired(row["sd_diff"], 0.02)
    assert row["seeds_paired"] < row["seeds_unpaired"]  # positive correlation: pairing pays


def test_noise_table_target_is_an_input_not_the_observed_difference():
    runs = _runs({"baseline": 1.0, "block": 0.9}, [0.0, 0.05, -0.03])
    runs.loc[3, "final_val_loss"] += 0.01
    a = noise.noise_table(runs, variants=["block"], target=0.02).iloc[0]
    b = noise.noise_table(runs.assign(final_val_loss=np.where(
        runs["variant"] == "block", runs["final_val_loss"] - 0.5, runs["final_val_loss"])),
        variants=["block"], target=0.02).iloc[0]
    assert a["seeds_paired"] == b["seeds_paired"]  # shifting the observed Δ changes nothing
    assert a["seeds_paired"] != noise.noise_table(runs, variants=["block"], target=0.005).iloc[0]["seeds_paired"]


def test_noise_command_on_the_committed_snapshot(tmp_path):
    import subprocess
    import sys

    from harness_testing import ROOT

    snapshot = ROOT / "results" / "runs.csv"
    cmd = [sys.executable, "-m", "analysis", "noise", "--snapshot", str(snapshot),
           "--sweep", "study_cpu", "--variant", "block", "--variant", "full", "--target", "0.03",
           "--seeds", "3,6", "--out", str(tmp_path / "noise")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    table = pd.read_csv(tmp_path / "noise" / "noise_study.csv").set_index("variant")
    assert list(table.index) == ["block", "full"]
    # The same pairs and σ of same-seed differences computed here from the CSV (float64; the table
    # keeps 6 significant digits, so rel 1e-5).
    runs = pd.read_csv(snapshot)
    runs = runs[(runs["sweep"] == "study_cpu") & (runs["status"] == "FINISHED")]
    loss = runs.pivot_table(index="seed", columns="variant", values="final_val_loss")
    for v in ("block", "full"):
        diff = (loss[v] - loss["baseline"]).dropna()
        assert table.loc[v, "pairs"] == len(diff) >= 12
        assert table.loc[v, "sd_diff"] == pytest.approx(diff.std(ddof=1), rel=1e-5)
    assert {"mde_paired_n3", "mde_unpaired_n6"} <= set(table.columns)
    assert (tmp_path / "noise" / "noise_study.png").stat().st_size > 5_000
    bad = subprocess.run(cmd[:-2] + ["--variant", "nope", "--out", str(tmp_path / "bad")],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


@pytest.mark.parametrize("sd, half", [(0.038, 0.03), (0.059, 0.03), (0.01, 0.03), (0.2, 0.05)])
def test_seeds_for_half_width_is_the_first_n_whose_t_interval_fits(sd, half):
    """The smallest n with t(0.975, n − 1)·sd/√n ≤ half: n fits, n − 1 does not (float64, exact t
    quantiles from scipy)."""
    from analysis.significance import seeds_for_half_width

    n = int(seeds_for_half_width(sd, half))
    width = lambda k: stats.t.ppf(0.975, k - 1) * sd / np.sqrt(k)  # noqa: E731
    assert width(n) <= half and (n == 2 or width(n - 1) > half)
    assert np.isnan(seeds_for_half_width(float("nan"), half)) and np.isnan(seeds_for_half_width(sd, 0.0))


def test_estimators_average_each_runs_last_evaluations_before_pairing():
    """With per-run evaluation noise that averages out over the last evaluations, the mean of the
    last 3 gives a smaller σ of same-seed differences than the last evaluation alone; k = 1 is
    the last evaluation itself."""
    rng = np.random.default_rng(0)
    runs, hist = [], []
    for seed in range(12):
        shift = rng.normal(0, 0.01)  # seed effect shared by both arms
        for variant, delta in (("baseline", 0.0), ("block", -0.05)):
            rid = f"{variant}{seed}"
            evals = 1.7 + delta + shift + rng.normal(0, 0.03, 6)  # evaluation noise, independent
            runs.append({"run_id": rid, "variant": variant, "seed": seed, "final_val_loss": evals[-1]})
            hist += [(rid, "val/loss", 25 * (i + 1), v) for i, v in enumerate(evals)]
    runs, hist = pd.DataFrame(runs), pd.DataFrame(hist, columns=["run_id", "key", "step", "value"])
    est = noise.estimators(runs, hist, variants=["block"], evals=(1, 3)).set_index("estimator")
    last = noise.noise_table(runs, variants=["block"]).iloc[0]
    assert est.loc["last evaluation", "sd_diff"] == pytest.approx(last["sd_diff"], rel=1e-12)
    assert est.loc["mean of the last 3 evaluations", "sd_diff"] < 0.8 * last["sd_diff"]
    assert est["pairs"].eq(12).all()
    assert noise.estimators(runs, hist.iloc[:0], variants=["block"]).empty
