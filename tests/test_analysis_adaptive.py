"""Adaptive seeds (analysis.adaptive): the stopping rule on given runs, which seeds it asks for,
and one end-to-end study at a tiny budget that trains through run.py, resumes without training
again, and leaves its verdict in MLflow."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis.adaptive import Plan, evaluate, jobs
from harness_testing import ROOT, TINY


def _runs(pairs: dict[str, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"variant": v, "seed": float(s), "final_val_loss": x}
                         for v, xs in pairs.items() for s, x in enumerate(xs)])


def test_looks_are_bonferroni_adjusted_and_each_interval_uses_its_look_level():
    plan = Plan((("block", "baseline"),), start=3, step=2, max_seeds=8)
    assert plan.looks == [3, 5, 7, 8]
    assert plan.look_level == pytest.approx(1 - 0.05 / 4, abs=1e-15)
    # Three seeds, differences −0.10, −0.11, −0.09: mean −0.10, sd 0.01; half-width at the
    # look's level is t_{1 − 0.0125/2, 2} · 0.01/√3 = 8.86 · 0.00577 = 0.051 (0.025 at 95%).
    runs = _runs({"block": [1.9, 1.89, 1.91], "baseline": [2.0, 2.0, 2.0]})
    (st,) = evaluate(runs, plan)
    half = stats.t.ppf(1 - 0.05 / 4 / 2, 2) * 0.01 / np.sqrt(3)
    assert st.n == 3 and st.diff == pytest.approx(-0.10, abs=1e-12)
    assert st.half == pytest.approx(half, rel=1e-9)
    assert st.resolved and st.verdict == "block < baseline"  # −0.10 + 0.051 < 0


def test_an_unresolved_comparison_asks_for_the_next_looks_seeds_only():
    plan = Plan((("block", "baseline"), ("full", "baseline")), start=2, step=2, max_seeds=6,
                half_width=0.001, stop="width")
    runs = _runs({"block": [1.9, 2.1], "baseline": [2.0, 2.0], "full": [2.3, 1.7, 2.0]})
    sts = evaluate(runs, plan)
    assert [s.resolved for s in sts] == [False, False]
    assert sts[0].need == [2, 3] and sts[1].need == [2, 3]
    # full has seed 2 already; the baseline is trained once for both comparisons.
    assert jobs(sts, runs) == {2: ["baseline", "block"], 3: ["baseline", "block", "full"]}


def test_a_resolved_comparison_asks_for_nothing_and_the_last_look_ends_the_study():
    plan = Plan((("block", "baseline"),), start=2, max_seeds=3, half_width=1e-6, stop="width")
    runs = _runs({"block": [1.9, 2.1, 2.0], "baseline": [2.0, 2.0, 2.0]})
    (st,) = evaluate(runs, plan)
    assert not st.resolved and st.verdict.startswith("not resolved") and st.n == 3
    assert jobs([st], runs) == {}
    wide = Plan((("block", "baseline"),), start=2, max_seeds=3, half_width=10.0)
    (st,) = evaluate(runs, wide)
    assert st.resolved and st.n == 2 and jobs([st], runs) == {}


def test_bad_options_exit_2_before_any_training(tmp_path):
    done = subprocess.run([sys.executable, "-m", "analysis.adaptive", "--compare", "block:baseline",
                           "--start-seeds", "1", "--tracking-uri", f"sqlite:///{tmp_path}/m.db"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m.db").exists()


@pytest.mark.slow
def test_adaptive_study_end_to_end_at_a_tiny_budget_resumes_without_training(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "analysis.adaptive", "--compare", "block:baseline",
           "--start-seeds", "2", "--max-seeds", "3", "--half-width", "1e-9", "--stop", "width",
           "--tracking-uri", uri, "--experiment", "adaptive_test", "--out", str(tmp_path / "out"),
           "--", *TINY, f"train.checkpoint_dir={tmp_path / 'ckpt'}",
           f"hydra.sweep.dir={tmp_path / 'multirun'}"]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "6 runs trained" in first.stdout  # block and baseline at seeds 0, 1, then seed 2
    verdict = json.loads((tmp_path / "out" / "adaptive.json").read_text())
    (c,) = verdict["comparisons"]
    assert c["n"] == 3 and not c["resolved"] and c["verdict"] == "not resolved at 3 seeds"
    assert np.isfinite(c["diff"]) and c["half"] > 1e-9
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 runs trained" in again.stdout
    assert json.loads((tmp_path / "out" / "adaptive.json").read_text())["comparisons"] == [c]

    import mlflow

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("adaptive_test")
    runs = client.search_runs([exp.experiment_id])
    roles = [r.data.tags.get("attnres.role") for r in runs]
    assert roles.count("job") == 6 and roles.count("study") == 2
    study = next(r for r in runs if r.data.tags.get("attnres.role") == "study")
    assert study.data.tags["verdict.block_vs_baseline"] == "not resolved at 3 seeds"
    assert study.data.metrics["block_vs_baseline.seeds"] == 3


def test_the_report_quotes_the_stopping_rule_beside_a_snapshot(tmp_path):
    """adaptive.json beside a snapshot (python -m analysis.adaptive --out that folder): the
    ablation section states the rule and the intervals at the looks where comparisons stopped."""
    from analysis import sections as sec
    from analysis.adaptive import Status
    from analysis.paper import load_paper

    plan = Plan((("block", "baseline"),), start=2, max_seeds=4)
    runs = _runs({"block": [1.9, 1.89, 1.91], "baseline": [2.0, 2.0, 2.0]})
    adaptive = {"rule": plan.rule(), "comparisons": [
        Status("block", "baseline", 3, -0.1, 0.05, True, "block < baseline").__dict__]}
    section = sec.ablation_section(runs.assign(run_id=[f"r{i}" for i in range(6)]),
                                   load_paper(None), tmp_path, adaptive=adaptive)
    assert plan.rule() in section.text and "Bonferroni over the 3 looks" in section.text
    # the verdict names run-given variants, so its `<` is written as Markdown's &lt;
    assert "| block − baseline | 3 | -0.1000 | 0.0500 | block &lt; baseline |" in section.text
    assert "Seeds chosen adaptively" not in sec.ablation_section(
        runs.assign(run_id=[f"r{i}" for i in range(6)]), load_paper(None), tmp_path).text
