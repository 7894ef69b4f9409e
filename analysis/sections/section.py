"""What every section of REPORT.md is made of: a Section (its Markdown, files and the Claims of the
paper it checks), the verdict rule, and the writers of its tables and figure links.

A claim *agrees* when a 95% interval (or a 5%-level test) excludes the opposite direction, *does
not agree* when it excludes the paper's, and is *inconclusive* otherwise, including wherever only
a point estimate exists.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .. import ablation as abl


@dataclass
class Claim:
    claim: str
    ours: str
    verdict: str  # agrees | does not agree | inconclusive | not tested
    p: float = float("nan")  # two-sided p-value of the test behind the verdict; NaN if none (bootstrap, counts)
    against_baseline: str | None = None  # the variant a claim compares with the baseline at the ablation's settings


@dataclass
class Section:
    title: str
    text: str
    claims: list[Claim] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)


def _rel(paths, out: Path):
    return [Path(p).relative_to(out).as_posix() for p in paths]


def _img(paths, out, alt):
    png = [p for p in _rel(paths, out) if p.endswith(".png")]
    return f"![{alt}]({png[0]})\n\n" if png else ""


def _f(x, d=4):
    return "–" if x is None or not np.isfinite(x) else f"{x:.{d}f}"


def _verdict(lo, hi, better_is_negative=True):
    """Agreement from an interval of a quantity whose expected sign is negative (or positive)."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "inconclusive"
    if better_is_negative:
        return "agrees" if hi < 0 else "does not agree" if lo > 0 else "inconclusive"
    return "agrees" if lo > 0 else "does not agree" if hi < 0 else "inconclusive"


def held_after_holm(verdict: str, p_holm: float, level: float = 0.05) -> str:
    """The verdict of a check in the report's family: *agrees* / *does not agree* stand only where
    the Holm-adjusted p is below ``level``, else *inconclusive*; a check without a p-value (a
    bootstrap interval, a count) keeps its own verdict, outside the family."""
    if verdict in ("agrees", "does not agree") and np.isfinite(p_holm) and p_holm >= level:
        return "inconclusive"
    return verdict


def _md(df: pd.DataFrame) -> str:
    """Markdown with floats at 4 significant digits and missing values as a dash."""
    def cell(x):
        if isinstance(x, float):
            return "–" if not np.isfinite(x) else f"{x:.4g}"
        return "–" if x is None else x

    return abl.to_markdown(df.apply(lambda c: c.map(cell)))


def _write(df: pd.DataFrame, out: Path, stem: str) -> list[Path]:
    """A section's table as CSV (6 significant digits) and Markdown, under out/tables/."""
    paths = [out / "tables" / f"{stem}.csv", out / "tables" / f"{stem}.md"]
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(paths[0], index=False, float_format="%.6g")
    paths[1].write_text(_md(df))
    return paths
