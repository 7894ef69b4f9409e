"""The committed study (results/): REPORT.md and every table regenerate identically from
the committed snapshot with the documented command, every figure is regenerated, and every run in
the snapshot is accounted for (finished, or listed in the report with its failure)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd

from analysis.report import assign_roles

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"


def test_the_committed_report_regenerates_from_the_snapshot(tmp_path):
    results = RESULTS
    snapshot = results / "runs.csv"
    assert snapshot.is_file(), "results/runs.csv is missing: run results/reproduce.sh"
    out = tmp_path / "results"
    # The command README's "Reproduce" section gives, into a fresh folder.
    done = subprocess.run([sys.executable, "-m", "analysis", "report", "--snapshot", str(snapshot),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "REPORT.md").read_text() == (results / "REPORT.md").read_text()
    committed = sorted(p.relative_to(results) for p in (results / "tables").rglob("*") if p.is_file())
    regenerated = sorted(p.relative_to(out) for p in (out / "tables").rglob("*") if p.is_file())
    assert committed == regenerated
    for rel in committed:
        assert (out / rel).read_bytes() == (results / rel).read_bytes(), rel
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
