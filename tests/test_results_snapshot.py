"""The committed study (results/): REPORT.md regenerates identically from the committed snapshot
with the documented command and every table within RTOL (another numpy/scipy/pandas release moves a
fit in its sixth digit), every figure is regenerated, and every run in the snapshot is accounted
for (finished, or listed in the report with its failure). On a mismatch the library versions the
study was made with (results/versions.json) are printed beside those installed."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.report import assign_roles, versions

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
# Numbers in a table may differ by this relative amount (or, as printed, by one unit in the last
# digit shown: a value at a rounding edge); everything else in a table must be identical.
RTOL = 1e-4
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _last_digit(token: str) -> float:
    """One unit in the last digit `token` shows (0.2814 → 1e-4, 1.2e-07 → 1e-08)."""
    mantissa, _, exp = token.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exp or 0) - decimals)


def _close(a: str, b: str) -> bool:
    x, y = float(a), float(b)
    if math.isnan(x) or math.isnan(y) or math.isinf(x) or math.isinf(y):
        return a == b
    return abs(x - y) <= max(RTOL * max(abs(x), abs(y)), _last_digit(a), _last_digit(b))


def _table_differences(new: str, old: str) -> list[str]:
    """Where two versions of a table differ beyond RTOL: its text between numbers must be
    identical, each number within tolerance (a CSV cell, or a number printed in .md/.tex)."""
    out = []
    for i, (a, b) in enumerate(zip(new.splitlines(), old.splitlines()), 1):
        if a == b:
            continue
        if NUMBER.split(a) != NUMBER.split(b):
            out.append(f"line {i}: {a!r} != {b!r}")
            continue
        bad = [(x, y) for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)) if not _close(x, y)]
        if bad:
            out.append(f"line {i}: " + ", ".join(f"{x} vs {y}" for x, y in bad[:5]))
    if len(new.splitlines()) != len(old.splitlines()):
        out.append(f"{len(new.splitlines())} lines vs {len(old.splitlines())}")
    return out


def _versions_note() -> str:
    made = RESULTS / "versions.json"
    recorded = json.loads(made.read_text()) if made.is_file() else "not recorded"
    return f"\nresults/ was made with {recorded}; installed: {versions()}"


def test_the_committed_report_regenerates_from_the_snapshot(tmp_path):
    results = RESULTS
    snapshot = results / "runs.csv"
    assert snapshot.is_file(), "results/runs.csv is missing: run results/reproduce.sh"
    out = tmp_path / "results"
    # The command README's "Reproduce" section gives, into a fresh folder.
    done = subprocess.run([sys.executable, "-m", "analysis", "report", "--snapshot", str(snapshot),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "REPORT.md").read_text() == (results / "REPORT.md").read_text(), _versions_note()
    committed = sorted(p.relative_to(results) for p in (results / "tables").rglob("*") if p.is_file())
    regenerated = sorted(p.relative_to(out) for p in (out / "tables").rglob("*") if p.is_file())
    assert committed == regenerated
    differ = {str(rel): d for rel in committed
              if (d := _table_differences((out / rel).read_text(), (results / rel).read_text()))}
    assert not differ, f"tables differ beyond a relative {RTOL:g}: {differ}" + _versions_note()
    assert (out / "versions.json").is_file() and (results / "versions.json").is_file()
    # Figures: the same set, each non-trivial (their bytes may differ in metadata only).
    figs = sorted(p.name for p in (results / "figures").glob("*.png"))
    assert figs == sorted(p.name for p in (out / "figures").glob("*.png"))
    assert all((out / "figures" / f).stat().st_size > 5_000 for f in figs)


def test_every_run_in_the_snapshot_is_finished_or_reported():
    runs = pd.read_csv(RESULTS / "runs.csv", dtype={"run_id": str})
    report = (RESULTS / "REPORT.md").read_text()
    for run in runs[runs["status"] != "FINISHED"].itertuples():
        assert run.run_id[:12] in report, f"run {run.run_id} ({run.status}) is not in REPORT.md"
    # The study's sections are all there (ablation, block size, scaling, arch, probe), each
    # sweep in the section the report gives it (the study recipe's sweep is the ablation).
    roles = assign_roles(runs)
    assert set(roles) >= {"ablation", "block_size", "scaling", "arch", "multihop"}
    ablation = runs[(roles == "ablation") & (runs["status"] == "FINISHED")].groupby("variant")["seed"]
    assert ablation.nunique().size == 13 and (ablation.nunique() >= 2).all()
    assert "Kendall τ" in report


@pytest.mark.parametrize("new, old, same", [
    ("full,0.28138,1", "full,0.281381,1", True),  # another release's sixth digit
    ("| 0.2814 | x |", "| 0.2813 | x |", True),  # printed at a rounding edge: one unit shown
    ("full,0.2820,1", "full,0.281381,1", False),
    ("| 0.2816 | x |", "| 0.2813 | x |", False),
    ("full,0.28138,1", "block,0.28138,1", False),  # text exactly
    ("a,nan,1", "a,nan,1", True),
    ("a,nan,1", "a,0.5,1", False),
])
def test_tables_compare_numbers_within_a_tolerance_and_text_exactly(new, old, same):
    assert (not _table_differences(new, old)) is same
