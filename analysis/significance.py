"""Statistics over a handful of seeds: intervals, p-values, a family's correction, seed noise
and how many seeds a difference needs. Every verdict of the report is made with these.

Intervals are Student-t over seeds (one seed gives NaN, not zero width); differences get Welch's
interval and p-value, a family gets Holm's correction, and seeds needed come from the t test's
own power (noncentral t), not the normal approximation.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

LEVEL = 0.95


def t_interval(values, level: float = LEVEL) -> tuple[float, float, int]:
    """(mean, half-width, n) of a Student-t interval; half-width NaN for n < 2."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    n = len(v)
    if n == 0:
        return np.nan, np.nan, 0
    if n == 1:
        return float(v[0]), np.nan, 1
    half = stats.t.ppf((1 + level) / 2, n - 1) * v.std(ddof=1) / np.sqrt(n)
    return float(v.mean()), float(half), n


def t_p(values, null: float = 0.0) -> float:
    """Two-sided p-value of the one-sample t test of mean = ``null`` (the test behind
    :func:`t_interval`); NaN with fewer than 2 finite values or no spread."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if len(v) < 2 or not v.std(ddof=1) > 0:
        return np.nan
    return float(stats.ttest_1samp(v, null).pvalue)


def welch_interval(a, b, level: float = LEVEL) -> tuple[float, float]:
    """(mean(a) − mean(b), half-width) with Welch's degrees of freedom; NaN half-width if either
    side has fewer than 2 values."""
    a = np.asarray(a, float)
    b = np.asarray(b, float)
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if not len(a) or not len(b):
        return np.nan, np.nan
    diff = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return diff, np.nan
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = np.sqrt(va + vb)
    if se == 0:
        return diff, 0.0
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return diff, float(stats.t.ppf((1 + level) / 2, df) * se)


def welch_p(a, b) -> float:
    """Two-sided p-value of Welch's t test of mean(a) = mean(b) (the test behind
    :func:`welch_interval`); NaN with fewer than 2 finite values on a side or no spread."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if len(a) < 2 or len(b) < 2:
        return np.nan
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        # scipy warns of "catastrophic cancellation" when a side's values are (nearly) equal,
        # e.g. two seeds with the same probe accuracy: their variance is then 0, which is right.
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def holm(p) -> np.ndarray:
    """Holm's step-down adjustment of p-values for the family-wise error rate (Holm 1979): the
    i-th smallest of m is multiplied by m − i + 1, made monotone, capped at 1. NaN entries stay
    NaN and do not count in m."""
    p = np.asarray(p, float)
    out = np.full_like(p, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    order = idx[np.argsort(p[idx])]
    m = len(order)
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out[order] = adjusted
    return out


def pooled_seed_sd(runs: pd.DataFrame, metric: str = "final_val_loss",
                   by: str | list[str] = "variant") -> tuple[float, int]:
    """(σ, degrees of freedom): the seed-to-seed standard deviation pooled over every group of
    runs (`by`: a variant, or a variant at one shape) with two or more values, i.e. the noise
    floor one more seed of any of them would have; (NaN, 0) when no group has two."""
    ss, dof = 0.0, 0
    for _, g in runs.groupby(by):
        v = g[metric].to_numpy(float)
        v = v[np.isfinite(v)]
        if len(v) >= 2:
            ss += float(((v - v.mean()) ** 2).sum())
            dof += len(v) - 1
    return (float(np.sqrt(ss / dof)), dof) if dof else (np.nan, 0)


# A run is set apart as diverging when its modified z-score (Iglewicz & Hoaglin) exceeds this: the
# conventional cut for "far from the rest" under a normal core, robust to the outlier itself.
DIVERGING_Z = 3.5


def diverging(values, groups, z: float = DIVERGING_Z) -> np.ndarray:
    """Which runs diverge: |value − its group's median| / (1.4826·MAD) > ``z``, the MAD taken over
    the deviations of every run of a group with two or more runs (one scale for all groups: a
    group of two cannot measure its own). With two runs the two deviations are equal, so both
    are flagged: which of them is off cannot be told."""
    v = pd.Series(np.asarray(values, float))
    g = pd.Series(np.asarray(groups, dtype=object))
    dev = v - v.groupby(g).transform("median")
    pooled = dev[g.map(g.value_counts()) >= 2].abs().dropna()
    scale = 1.4826 * float(pooled.median()) if len(pooled) else np.nan
    if not np.isfinite(scale) or scale <= 0:
        return np.zeros(len(v), bool)
    return (dev.abs() / scale > z).fillna(False).to_numpy(bool)


def steady(runs: pd.DataFrame, metric: str = "final_val_loss") -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs kept, runs set apart as diverging within their variant, :func:`diverging`)."""
    if runs.empty:
        return runs, runs
    flag = diverging(runs[metric], runs["variant"])
    return runs[~flag], runs[flag]


def pooled_diff_sd(diffs) -> tuple[float, int]:
    """(σ, degrees of freedom) of same-seed differences pooled over comparisons: each Series of
    ``diffs`` (one comparison's differences) contributes its squared deviations from its own mean
    and n − 1 degrees of freedom; (NaN, 0) when none has two."""
    ss, dof = 0.0, 0
    for d in diffs:
        d = np.asarray(d, float)
        d = d[np.isfinite(d)]
        if len(d) >= 2:
            ss += float(((d - d.mean()) ** 2).sum())
            dof += len(d) - 1
    return (float(np.sqrt(ss / dof)), dof) if dof else (np.nan, 0)


def t_test_power(n: int, effect: float, level: float = LEVEL) -> float:
    """Power of a two-sided two-sample Student t test at ``level`` with ``n`` seeds per arm, equal
    seed noise σ and a true difference of ``effect`` = Δ/σ: under the alternative the statistic
    follows a noncentral t with df = 2n − 2 and noncentrality Δ/(σ·√(2/n))."""
    df = 2 * n - 2
    ncp = abs(effect) / np.sqrt(2.0 / n)
    crit = stats.t.ppf((1 + level) / 2, df)
    return float(stats.nct.sf(crit, df, ncp) + stats.nct.cdf(-crit, df, ncp))


def seeds_needed(sigma: float, delta: float, level: float = LEVEL, power: float = 0.8) -> float:
    """Seeds per variant for a two-sided two-sample test at ``level`` to detect a true difference
    ``delta`` with probability ``power`` when seeds scatter with ``sigma``: the smallest n ≥ 2 at
    which :func:`t_test_power` reaches ``power``.

    Sized with the noncentral t, since at a handful of seeds the normal approximation promises
    power the test does not have; the pooled t (equal n and σ per arm) is the reference test, a
    little stronger than Welch's at the smallest n. NaN when σ or Δ is not finite, Δ is 0 or σ < 0.
    Power grows with n, so n is found by doubling and bisection."""
    if not (np.isfinite(sigma) and np.isfinite(delta)) or delta == 0 or sigma < 0:
        return np.nan
    if sigma == 0:
        return 2.0
    effect = abs(delta) / sigma
    lo, hi = 1, 2  # invariant once the loop ends: power(lo) < target ≤ power(hi), or hi == 2
    while t_test_power(hi, effect, level) < power:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if t_test_power(mid, effect, level) < power:
            lo = mid
        else:
            hi = mid
    return float(hi)


# --------------------------------------------------------------------------------------------
# Paired designs: runs that share `train.seed` share data order and initial weights outside the
# residual, so their difference cancels most of the seed noise the Welch interval carries.
# --------------------------------------------------------------------------------------------
def by_seed(values, seeds) -> pd.Series:
    """Finite ``values`` indexed by seed, one per seed (the mean where a seed repeats)."""
    s = pd.Series(np.asarray(values, float), index=pd.Index(np.asarray(seeds, float), name="seed"))
    s = s[np.isfinite(s.to_numpy()) & np.isfinite(s.index.to_numpy())]
    return s.groupby(level=0).mean()


@dataclass(frozen=True)
class Comparison:
    """a − b over runs. ``diff ± half`` (``p``) is the primary interval: paired (same-seed
    differences, a one-sample t interval) when two or more seeds are shared, else Welch's. The
    Welch interval over all runs is always beside it. With ``log`` the values were compared on
    the log scale: ``diff`` is log(a/b), and :attr:`ratio` with its interval is exp of it."""
    diff: float
    half: float
    p: float
    n: int  # pairs for a paired interval, else the smaller side's runs
    design: str  # "paired" | "welch"
    welch_diff: float
    welch_half: float
    welch_p: float
    log: bool = False
    sd_from: str = "own"  # "own": the pairs' own σ; "pooled": σ of same-seed differences pooled over comparisons
    dof: int = 0  # degrees of freedom of the primary interval

    @property
    def lo(self) -> float:
        return self.diff - self.half

    @property
    def hi(self) -> float:
        return self.diff + self.half

    @property
    def ratio(self) -> tuple[float, float, float]:
        """(exp(diff), exp(lo), exp(hi)): the ratio a/b and its interval, for ``log``."""
        return float(np.exp(self.diff)), float(np.exp(self.lo)), float(np.exp(self.hi))


def paired_t(a: pd.Series, b: pd.Series, level: float = LEVEL) -> tuple[float, float, float, int]:
    """(mean of a − b over shared seeds, t half-width, two-sided p, pairs): scipy's paired t test
    on the seeds both Series (indexed by seed, :func:`by_seed`) have; NaN below two pairs, and a
    zero half-width with a NaN p when every difference is the same."""
    common = a.index.intersection(b.index)
    d = (a[common] - b[common]).to_numpy(float)
    n = len(d)
    if n == 0:
        return np.nan, np.nan, np.nan, 0
    if n == 1:
        return float(d[0]), np.nan, np.nan, 1
    if not d.std(ddof=1) > 0:
        return float(d.mean()), 0.0, np.nan, n
    res = stats.ttest_rel(a[common].to_numpy(float), b[common].to_numpy(float))
    lo, hi = res.confidence_interval(level)
    return float(d.mean()), float((hi - lo) / 2), float(res.pvalue), n


# Below this many pairs a comparison's own σ (n − 1 degrees of freedom) is too unsure to judge by:
# with two pairs its t interval rests on one degree of freedom and on how alike two numbers are.
MIN_OWN_PAIRS = 4


def pooled_t(d: float, n: int, sd: float, dof: int, level: float = LEVEL) -> tuple[float, float]:
    """(half-width, two-sided p) of the mean ``d`` of n same-seed differences when their σ is
    ``sd`` pooled over comparisons with ``dof`` degrees of freedom."""
    if not (dof and np.isfinite(sd) and n) or sd < 0:
        return np.nan, np.nan
    if sd == 0:  # every difference alike: no width, and no test (as paired_t)
        return 0.0, np.nan
    se = sd / np.sqrt(n)
    return float(stats.t.ppf((1 + level) / 2, dof) * se), float(2 * stats.t.sf(abs(d) / se, dof))


def compare(a, b, seeds_a=None, seeds_b=None, log: bool = False,
            level: float = LEVEL, pooled: tuple[float, int] | None = None) -> Comparison:
    """a − b (values of runs; seeds_* their `train.seed`, None when they do not pair). Ratios
    (anything multiplicative: growth, max/min) go with ``log=True``: a ratio's scatter is
    multiplicative and its linear interval can cross 0, a value it cannot take. ``pooled``:
    (σ, dof) of same-seed differences pooled over comparisons, used instead of the pairs' own σ
    when they are fewer than MIN_OWN_PAIRS."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if log:
        with np.errstate(divide="ignore", invalid="ignore"):
            a, b = np.log(np.where(a > 0, a, np.nan)), np.log(np.where(b > 0, b, np.nan))
    wd, wh = welch_interval(a, b, level)
    wp = welch_p(a, b)
    if seeds_a is not None and seeds_b is not None:
        d, h, p, n = paired_t(by_seed(a, seeds_a), by_seed(b, seeds_b), level)
        if n >= 2 and n < MIN_OWN_PAIRS and pooled is not None and pooled[1]:
            h, p = pooled_t(d, n, pooled[0], pooled[1], level)
            return Comparison(d, h, p, n, "paired", wd, wh, wp, log, "pooled", int(pooled[1]))
        if n >= 2:
            return Comparison(d, h, p, n, "paired", wd, wh, wp, log, "own", n - 1)
    n = int(min(np.isfinite(a).sum(), np.isfinite(b).sum()))
    return Comparison(wd, wh, wp, n, "welch", wd, wh, wp, log)


def same_seed_diffs(a: pd.DataFrame, b: pd.DataFrame, metric: str = "final_val_loss") -> pd.Series:
    """a − b at the seeds both runs sets have (one value per seed)."""
    d = by_seed(a[metric], a["seed"]) - by_seed(b[metric], b["seed"])
    return d.dropna()


def tost(d: float, se: float, dof: int, margin: float, level: float = LEVEL) -> tuple[float, bool]:
    """Two one-sided tests of |true difference| < ``margin`` for an estimate ``d`` with standard
    error ``se`` on ``dof`` degrees of freedom: (p, equivalent at 1 − level). The p is the larger
    of the two one-sided p-values; equivalence is shown when the (2·level − 1) interval lies
    inside ±margin."""
    if not (np.isfinite(d) and np.isfinite(se) and dof) or se < 0:
        return np.nan, False
    if se == 0:
        return (0.0, True) if abs(d) < margin else (1.0, False)
    p = max(stats.t.sf((d + margin) / se, dof), stats.t.cdf((d - margin) / se, dof))
    return float(p), bool(p < 1 - level)


def log_t_interval(values, level: float = LEVEL) -> tuple[float, float, float, float]:
    """(geometric mean, its interval low, high, two-sided p of "ratio = 1") of positive ratios:
    the t interval of their logs, exponentiated."""
    v = np.asarray(values, float)
    v = np.log(v[np.isfinite(v) & (v > 0)])
    m, h, _ = t_interval(v, level)
    return float(np.exp(m)), float(np.exp(m - h)), float(np.exp(m + h)), t_p(v, 0.0)


# --------------------------------------------------------------------------------------------
# Power from a stated target effect (never from the observed one: that answers nothing).
# --------------------------------------------------------------------------------------------
def mde(sigma: float, n: int, paired: bool, level: float = LEVEL, power: float = 0.8) -> float:
    """Minimum detectable effect of a two-sided test at ``level`` with ``power``: ``paired``, a
    one-sample t test over n same-seed differences of scatter ``sigma``; else a two-sample t
    test with n seeds per arm and seed scatter ``sigma`` (statsmodels' power solvers)."""
    from statsmodels.stats.power import TTestIndPower, TTestPower

    if not np.isfinite(sigma) or sigma < 0 or n < 2:
        return np.nan
    solver = TTestPower() if paired else TTestIndPower()
    size = {"nobs": n} if paired else {"nobs1": n, "ratio": 1.0}
    d = solver.solve_power(effect_size=None, alpha=1 - level, power=power,
                           alternative="two-sided", **size)
    return float(d) * sigma


def paired_power(sd_diff: float, n: int, delta: float, level: float = LEVEL) -> float:
    """Power of a two-sided paired t test at ``level`` over n same-seed differences of scatter
    ``sd_diff`` to detect a true difference ``delta`` (statsmodels); NaN when undefined."""
    from statsmodels.stats.power import TTestPower

    if not (np.isfinite(sd_diff) and np.isfinite(delta)) or sd_diff <= 0 or n < 2 or delta == 0:
        return np.nan
    return float(TTestPower().power(effect_size=abs(delta) / sd_diff, nobs=n, alpha=1 - level,
                                    alternative="two-sided"))


def seeds_for_half_width(sd_diff: float, half: float, level: float = LEVEL, most: int = 10_000) -> float:
    """Seeds (pairs) whose paired t interval at ``level`` has half-width ≤ ``half`` when same-seed
    differences scatter with ``sd_diff``: the smallest n ≥ 2 with t(n − 1)·sd_diff/√n ≤ half (the
    expected width, taking ``sd_diff`` as known); NaN when undefined or beyond ``most``."""
    if not (np.isfinite(sd_diff) and np.isfinite(half)) or half <= 0 or sd_diff < 0:
        return np.nan
    q = (1 + level) / 2
    for n in range(2, most + 1):
        if stats.t.ppf(q, n - 1) * sd_diff / np.sqrt(n) <= half:
            return float(n)
    return np.nan


def seeds_needed_paired(sd_diff: float, delta: float, level: float = LEVEL,
                        power: float = 0.8) -> float:
    """Seeds (pairs) for a paired t test at ``level`` to detect a true difference ``delta`` with
    ``power``, when same-seed differences scatter with ``sd_diff``: the smallest n ≥ 2 whose
    statsmodels power reaches ``power``."""
    from statsmodels.stats.power import TTestPower

    if not (np.isfinite(sd_diff) and np.isfinite(delta)) or delta == 0 or sd_diff < 0:
        return np.nan
    if sd_diff <= 1e-9 * abs(delta):  # differences all but constant; statsmodels' power is NaN there
        return 2.0
    calc, effect = TTestPower(), abs(delta) / sd_diff

    def enough(n):
        return calc.power(effect_size=effect, nobs=n, alpha=1 - level,
                          alternative="two-sided") >= power

    # Start from the normal approximation (close, and never far below the t answer), then step
    # to the first whole n whose t-test power reaches the target.
    z = stats.norm.ppf((1 + level) / 2) + stats.norm.ppf(power)
    n = max(2, int(np.ceil((z / effect) ** 2)))
    while n > 2 and enough(n - 1):
        n -= 1
    while not enough(n):
        n += 1
    return float(n)


# --------------------------------------------------------------------------------------------
# Could the data order the variants at all?
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankResolution:
    """F test of "all variants have the same mean loss" in a variant + seed model (seeds as
    blocks where they pair runs), over the runs that did not diverge; and Kendall's τ against a
    reference ordering judged at one noise level, the seed σ pooled over variants (diverging runs
    apart, :func:`steady`; a variant with diverging runs keeps its own), each mean blurred by σ/√n: ``power``, the chance that τ's
    test finds the reference's order at 5% were our variants spaced exactly as the reference's,
    and a parametric bootstrap interval of τ around our means (a variant's own σ from two seeds
    is too unsure for either). ``resolvable``: that power reaches 80%."""
    f: float
    f_p: float
    tau_lo: float
    tau_hi: float
    median_se: float  # standard error of a variant's mean from the pooled σ, median over variants
    spread: float  # range of the variants' mean losses
    power: float  # of Kendall's test at 5%, were the true means the reference's
    reference_spread: float  # range of the reference's values
    sigma: float = np.nan  # the pooled seed σ behind every standard error
    dof: int = 0

    @property
    def resolvable(self) -> bool:
        return bool(np.isfinite(self.power) and self.power >= 0.8)


def _variant_f_test(d: pd.DataFrame) -> tuple[float, float]:
    import statsmodels.formula.api as smf
    from statsmodels.stats.anova import anova_lm

    if d["variant"].nunique() < 2 or len(d) <= d["variant"].nunique():
        return np.nan, np.nan
    paired = ("seed" in d and d["seed"].notna().all()
              and d.groupby("seed")["variant"].nunique().max() > 1)
    formula = "y ~ C(variant) + C(seed)" if paired else "y ~ C(variant)"
    data = d.assign(seed=d["seed"].astype(str)) if paired else d
    table = anova_lm(smf.ols(formula, data=data).fit())
    return float(table.loc["C(variant)", "F"]), float(table.loc["C(variant)", "PR(>F)"])


def rank_resolution(runs: pd.DataFrame, reference: dict, metric: str = "final_val_loss",
                    n_boot: int = 1000, seed: int = 0, level: float = LEVEL) -> RankResolution:
    cols = ["variant", metric] + (["seed"] if "seed" in runs else [])
    everything = runs[cols].dropna(subset=[metric])
    kept, apart = steady(everything, metric)
    sigma, dof = pooled_seed_sd(kept, metric)
    groups = {v: g[metric].to_numpy(float) for v, g in everything.groupby("variant")}
    means = {v: g.mean() for v, g in groups.items()}
    spread = float(max(means.values()) - min(means.values())) if means else np.nan
    f, fp = _variant_f_test(kept.rename(columns={metric: "y"}))
    common = [v for v in groups if v in reference and np.isfinite(reference[v])]
    lo = hi = power = ref_spread = np.nan
    # A variant with diverging runs keeps its own scatter; the pooled σ would understate it.
    own = set(apart["variant"])
    se = np.array([(groups[v].std(ddof=1) if v in own else sigma) / np.sqrt(len(groups[v]))
                   for v in common])
    if len(common) >= 2:
        ref = np.array([reference[v] for v in common])
        ref_spread = float(ref.max() - ref.min())
    if len(common) >= 2 and n_boot > 0 and np.isfinite(se).all():
        rng = np.random.default_rng(seed)
        hits = [stats.kendalltau(ref + rng.normal(0.0, se), ref) for _ in range(n_boot)]
        power = float(np.mean([h.pvalue < 1 - level and h.statistic > 0 for h in hits]))
        ours = np.array([means[v] for v in common])
        taus = [stats.kendalltau(ours + rng.normal(0.0, se), ref).statistic for _ in range(n_boot)]
        taus = [t for t in taus if np.isfinite(t)]
        if taus:
            lo, hi = np.quantile(taus, [(1 - level) / 2, (1 + level) / 2])
    return RankResolution(f, fp, float(lo), float(hi),
                          float(np.median(se)) if len(se) else np.nan, spread, power, ref_spread,
                          sigma, dof)
