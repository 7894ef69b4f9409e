"""Statistics over a handful of seeds: intervals, p-values, a family's correction, seed noise
and how many seeds a difference needs. Every verdict of the report is made with these.

Design decisions:

* **Intervals are Student-t intervals over seeds** (mean ± t_{0.975, n−1}·s/√n): with 2-5 seeds a
  normal interval would be far too narrow. One seed gives no interval (NaN, shown as "n=1"), not
  zero.
* **Differences come with a Welch interval** (unequal variances, Welch–Satterthwaite degrees of
  freedom); each interval has its test's two-sided p-value beside it (:func:`t_p`,
  :func:`welch_p`), and a family of verdicts gets Holm's correction (:func:`holm`).
* **Seeds needed** (:func:`seeds_needed`) come from the power of the t test itself (noncentral
  t, df = 2n − 2), not the normal approximation, which is optimistic at the few seeds it
  answers for us: its "3 seeds" for Block give Welch's test 48% power, not 80%.
"""
from __future__ import annotations

import warnings

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

    Sized with the noncentral t, not the normal approximation n = 2·((z_{1−α/2} + z_power)·σ/Δ)²:
    the report's comparisons are t/Welch intervals over a handful of seeds, where the t critical
    value is far above 1.96 (4.30 at 2 seeds per arm) and the normal formula promises power the
    test does not have (its "3 seeds" for σ = 0.060, Δ = 0.14 give 48% power with Welch's test;
    this gives 5). Equal n and σ per arm make the pooled t the reference test; Welch's interval,
    which the ablation table uses, has the same df in the limit and a little less power at the
    smallest n (0.88 instead of 0.90 in that example), which the rounding up usually absorbs.
    Power grows with n (both the noncentrality and the df do), so the n is found by doubling and
    bisection: a few dozen noncentral-t evaluations even for the 10⁵ seeds a tiny Δ needs."""
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
