"""Summaries over seeds: the ablation table (paper Table 4) and the block-size sweep (Fig. 6).

Design decisions:

* **Intervals and tests are those of analysis.significance** (Student-t over seeds, Welch for
  differences, Holm over a family): Δ vs our baseline comes with a Welch interval, so "beats the
  baseline" means the interval lies below 0.
* **Rank agreement** with the paper is Kendall's τ-b (scipy) between our mean losses and the
  paper's, over the variants both have, with its two-sided p-value. With 12 rows the paper's own
  spreads (1.731-1.767) are a few thousandths apart, so τ is reported whatever it is.
* Table order follows the paper's Table 4; variants the paper lacks come last.
* Markdown and LaTeX are written here (no tabulate / jinja2 dependency) so the files are stable.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from .paper import KNOWN_VARIANTS
from .significance import holm, t_interval, welch_interval, welch_p


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
    for a, b in _TEX_SYMBOLS.items():
        s = s.replace(a, b)
    return s


# pdflatex (no unicode-math) refuses these characters in text: each as LaTeX's own.
_TEX_SYMBOLS = {"±": r"$\pm$", "Δ": r"$\Delta$", "τ": r"$\tau$", "α": r"$\alpha$", "σ": r"$\sigma$",
                "√": r"$\surd$", "·": r"$\cdot$", "≤": r"$\le$", "≥": r"$\ge$", "≈": r"$\approx$",
                "−": "-", "–": "--", "—": "---"}


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
