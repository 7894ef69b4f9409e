"""Summaries over seeds: the ablation table (paper Table 4) and the block-size sweep (Fig. 6).

Design decisions:

* **Intervals are Student-t intervals over seeds** (mean ± t_{0.975, n−1}·s/√n): with 2-5 seeds a
  normal interval would be far too narrow. One seed gives no interval (shown as "n=1"), not zero.
* **Δ vs our baseline** comes with a Welch interval (unequal variances, Welch–Satterthwaite
  degrees of freedom), so "beats the baseline" means the interval lies below 0.
* **Rank agreement** with the paper is Kendall's τ-b (scipy) between our mean losses and the
  paper's, over the variants both have, with its two-sided p-value. With 12 rows the paper's own
  spreads (1.731-1.767) are a few thousandths apart, so τ is reported whatever it is.
* **Seeds needed** (:func:`seeds_needed`) come from the power of the t test itself (noncentral
  t, df = 2n − 2), not the normal approximation, which is optimistic at the few seeds it
  answers for us: its "3 seeds" for Block give Welch's test 48% power, not 80%.
* Table order follows the paper's Table 4; variants the paper lacks come last.
* Markdown and LaTeX are written here (no tabulate / jinja2 dependency) so the files are stable.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from .paper import KNOWN_VARIANTS

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


def _order(variants) -> list[str]:
    known = [v for v in KNOWN_VARIANTS if v in variants]
    return known + sorted(v for v in variants if v not in KNOWN_VARIANTS)


@dataclass
class AblationResult:
    table: pd.DataFrame
    tau: float
    p_value: float
    n_common: int


def ablation_table(runs: pd.DataFrame, paper_loss: dict[str, float] | None = None,
                   baseline: str = "baseline", metric: str = "final_val_loss") -> AblationResult:
    """Table 4 from finished runs: one row per variant.

    Columns: variant, n, loss, loss_ci (half-width), delta, delta_ci (Welch half-width),
    paper_loss, paper_delta, verdict (``better`` / ``worse`` / ``tie`` by the Welch interval,
    ``n/a`` without one), p (Welch's two-sided p-value against the baseline) and p_holm (p with
    Holm's correction over every variant compared with the baseline: the verdicts are each at
    5%, and a dozen of them at 5% find one "difference" by chance every other time).
    """
    paper_loss = paper_loss or {}
    groups = {v: g[metric].to_numpy(float) for v, g in runs.groupby("variant")}
    base = groups.get(baseline)
    p_base = paper_loss.get(baseline)
    rows = []
    for v in _order(groups):
        mean, half, n = t_interval(groups[v])
        delta, dhalf = welch_interval(groups[v], base) if base is not None else (np.nan, np.nan)
        if v == baseline:
            delta, dhalf = 0.0, np.nan
        if v == baseline or not np.isfinite(dhalf):
            verdict = "n/a"
        elif delta + dhalf < 0:
            verdict = "better"
        elif delta - dhalf > 0:
            verdict = "worse"
        else:
            verdict = "tie"
        pl = paper_loss.get(v, np.nan)
        rows.append({"variant": v, "n": n, "loss": mean, "loss_ci": half, "delta": delta,
                     "delta_ci": dhalf, "paper_loss": pl,
                     "paper_delta": pl - p_base if p_base is not None else np.nan,
                     "verdict": verdict,
                     "p": welch_p(groups[v], base) if base is not None and v != baseline else np.nan})
    table = pd.DataFrame(rows)
    table["p_holm"] = holm(table["p"])
    common = table.dropna(subset=["loss", "paper_loss"])
    if len(common) >= 2:
        res = stats.kendalltau(common["loss"], common["paper_loss"])
        tau, p = float(res.statistic), float(res.pvalue)
    else:
        tau, p = np.nan, np.nan
    return AblationResult(table=table, tau=tau, p_value=p, n_common=len(common))


def pooled_seed_sd(runs: pd.DataFrame, metric: str = "final_val_loss") -> tuple[float, int]:
    """(σ, degrees of freedom): the seed-to-seed standard deviation pooled over every variant with
    two or more seeds, i.e. the noise floor one more seed of any variant would have."""
    ss, dof = 0.0, 0
    for _, g in runs.groupby("variant"):
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


def block_size_of(runs: pd.DataFrame) -> pd.Series:
    """Block size S (sublayers per block) of each run: 2·layers / num_blocks when
    ``residual.num_blocks`` is set, else ``residual.block_size``; Full AttnRes is S = 1 (paper §3:
    S = 1 recovers Full). num_blocks first, as the model resolves them
    (attnres.residuals.resolve_block_size): block_size is logged for every run, at its default 4
    when the run set num_blocks instead."""
    S = runs["block_size"].astype(float)
    derived = 2 * runs["layers"] / runs["num_blocks"]
    S = derived.where(derived.notna(), S)
    return S.where(runs["variant"] != "full", 1.0)


def block_size_table(runs: pd.DataFrame, baseline: str = "baseline",
                     metric: str = "final_val_loss") -> pd.DataFrame:
    """Fig. 6 as a table: one row per block size S (Block and Full runs), plus the baseline."""
    rows = []
    attn = runs[runs["variant"].isin(["block", "full"])].assign(S=block_size_of)
    for S, g in attn.dropna(subset=["S"]).groupby("S"):
        mean, half, n = t_interval(g[metric])
        nb = g["num_blocks"].dropna()
        if not len(nb) and "layers" in g:  # N = L / S (L = 2·layers sublayers; last block may be short)
            nb = np.ceil(2 * g["layers"].astype(float) / S).dropna()
        rows.append({"label": f"{int(S)}", "S": float(S),
                     "N": float(nb.iloc[0]) if len(nb) else np.nan, "n": n, "loss": mean,
                     "loss_ci": half})
    base = runs[runs["variant"] == baseline]
    if len(base):
        mean, half, n = t_interval(base[metric])
        rows.append({"label": "baseline", "S": np.nan, "N": np.nan, "n": n, "loss": mean,
                     "loss_ci": half})
    return pd.DataFrame(rows, columns=["label", "S", "N", "n", "loss", "loss_ci"])


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------
def _fmt(x, digits=4, signed=False):
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "–"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def formatted(table: pd.DataFrame) -> pd.DataFrame:
    """The ablation table as strings, as printed in Markdown and LaTeX."""
    out = pd.DataFrame({
        "Variant": table["variant"],
        "n": table["n"].astype(int).astype(str),
        "Val. loss (ours)": [f"{_fmt(m)} ± {_fmt(h)}" if np.isfinite(h) else _fmt(m)
                             for m, h in zip(table["loss"], table["loss_ci"])],
        "Δ (ours)": [f"{_fmt(d, signed=True)} ± {_fmt(h)}" if np.isfinite(h)
                     else _fmt(d, signed=True) for d, h in zip(table["delta"], table["delta_ci"])],
        "Val. loss (paper)": [_fmt(x, 3) for x in table["paper_loss"]],
        "Δ (paper)": [_fmt(x, 3, signed=True) for x in table["paper_delta"]],
        "vs baseline": table["verdict"],
    })
    return out


def _md_cell(v) -> str:
    # A pipe or a line break inside a cell (failure messages have both) would break the table.
    return " ".join(str(v).split()).replace("|", "\\|")


def to_markdown(df: pd.DataFrame) -> str:
    cols = [_md_cell(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(_md_cell(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def _tex(s: str) -> str:
    s = str(s)
    for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("%", r"\%"), ("&", r"\&"),
                 ("#", r"\#")):
        s = s.replace(a, b)
    return s.replace("±", r"$\pm$").replace("Δ", r"$\Delta$").replace("–", "--")


def to_latex(df: pd.DataFrame, caption: str = "", label: str = "") -> str:
    cols = list(df.columns)
    lines = [r"\begin{table}[t]", r"\centering", r"\begin{tabular}{l" + "r" * (len(cols) - 1) + "}",
             r"\toprule", " & ".join(_tex(c) for c in cols) + r" \\", r"\midrule"]
    for row in df.itertuples(index=False):
        lines.append(" & ".join(_tex(v) for v in row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    if caption:
        lines.append(r"\caption{" + _tex(caption) + "}")
    if label:
        lines.append(r"\label{" + label + "}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


def write_tables(result: AblationResult, folder, stem: str = "table4_ablation") -> list:
    """CSV, Markdown and LaTeX versions of the ablation table."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{stem}.csv", folder / f"{stem}.md", folder / f"{stem}.tex"]
    result.table.to_csv(paths[0], index=False, float_format="%.6g")
    pretty = formatted(result.table)
    tau = (f"Kendall τ = {result.tau:.3f} (p = {result.p_value:.3g}, {result.n_common} variants)"
           if np.isfinite(result.tau) else "Kendall τ: fewer than 2 variants shared with the paper")
    paths[1].write_text(to_markdown(pretty) + "\n" + tau + "\n")
    paths[2].write_text(to_latex(pretty, caption="Ablation (ours vs paper Table 4), mean ± 95% "
                                 "t-interval over seeds. " + tau, label="tab:ablation"))
    return paths
