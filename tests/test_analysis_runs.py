"""Snapshot CSVs (analysis/runs.py) without MLflow, and the notebook run on a snapshot."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.__main__ import main as analysis_main
from analysis.runs import AnalysisInputError, RunSet, _tidy, export_snapshot, import_snapshot

REPO = Path(__file__).resolve().parents[1]


def _runset(n_sizes=4) -> RunSet:
    rows = []
    for v, A in (("baseline", 1.0), ("block", 0.97)):
        for i, tokens in enumerate(np.geomspace(1e4, 1e5, n_sizes)):
            for seed in (0, 1):
                rows.append({"run_id": f"{v}-{i}-{seed}", "experiment": "scaling", "variant": v,
                             "sweep": "scaling", "seed": seed, "status": "FINISHED",
                             "tokens": tokens, "flops_per_token": 6e6,
                             "final_val_loss": A * (tokens * 6e6 / 8.64e19) ** -0.05 + 0.001 * seed,
                             "d_model": 64, "layers": 4, "n_heads": 2})
    rows.append({"run_id": "dead", "experiment": "scaling", "variant": "full", "status": "FAILED",
                 "failure": "out of memory", "final_val_loss": None})
    hist = pd.DataFrame({"run_id": ["dead", "dead"], "key": ["val/loss", "val/loss"],
                         "step": [1, 2], "value": [3.0, 2.5]})
    return RunSet(_tidy(rows), hist, {"baseline-0-0": {"step": 1, "grad_norm_block": [1.0, 0.5]}})


def test_snapshot_round_trip_is_exact(tmp_path):
    rs = _runset()
    paths = export_snapshot(rs, tmp_path / "runs.csv")
    assert [p.name for p in paths] == ["runs.csv", "runs.history.csv", "runs.instrumentation.json"]
    back = import_snapshot(tmp_path / "runs.csv")
    pd.testing.assert_frame_equal(back.runs, rs.runs)
    pd.testing.assert_frame_equal(back.histories, rs.histories)
    assert back.instrumentation == rs.instrumentation
    assert back.runs.set_index("run_id").loc["dead", "status"] == "FAILED"
    assert back.runs["compute_pfd"].notna().sum() == 16  # derived from tokens × FLOPs per token


def test_merged_snapshots_equal_the_snapshot_of_one_store(tmp_path):
    """A committed study snapshot cut in two by run (as if from two stores) and merged back, in the
    other order, gives the same three files byte for byte; a run in both is refused."""
    whole = REPO / "results" / "runs.csv"
    rs = import_snapshot(whole)
    ids = sorted(rs.runs["run_id"])
    halves = {"a": set(ids[::2]), "b": set(ids[1::2])}
    for name, part in halves.items():
        export_snapshot(rs.only(part), tmp_path / f"{name}.csv")
    assert analysis_main(["merge", str(tmp_path / "b.csv"), str(tmp_path / "a.csv"),
                          "--out", str(tmp_path / "merged.csv")]) == 0
    for suffix in (".csv", ".history.csv", ".instrumentation.json"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == whole.with_name(f"runs{suffix}").read_bytes()
    assert analysis_main(["merge", str(tmp_path / "a.csv"), str(tmp_path / "merged.csv"),
                          "--out", str(tmp_path / "twice.csv")]) == 2
    assert not (tmp_path / "twice.csv").exists()


def test_a_sweep_left_out_of_a_merge_is_what_a_rerun_of_it_replaces(tmp_path):
    """`merge --without-sweep multihop` drops that sweep's runs, histories and instrumentation and
    nothing else; merging the rest with a snapshot of those runs alone gives back the committed
    snapshot byte for byte (what the study did when the probe was re-run)."""
    whole = REPO / "results" / "runs.csv"
    rs = import_snapshot(whole)
    probe = set(rs.runs.loc[rs.runs["sweep"] == "multihop", "run_id"])
    assert probe and len(probe) < len(rs.runs)
    export_snapshot(rs.only(probe), tmp_path / "probe.csv")
    assert analysis_main(["merge", str(whole), "--without-sweep", "multihop", "--out", str(tmp_path / "rest.csv")]) == 0
    rest = import_snapshot(tmp_path / "rest.csv")
    assert set(rest.runs["run_id"]) == set(rs.runs["run_id"]) - probe
    assert not probe & set(rest.histories["run_id"]) and not probe & set(rest.instrumentation)
    assert analysis_main(["merge", str(tmp_path / "rest.csv"), str(tmp_path / "probe.csv"),
                          "--out", str(tmp_path / "merged.csv")]) == 0
    for suffix in (".csv", ".history.csv", ".instrumentation.json"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == whole.with_name(f"runs{suffix}").read_bytes()


@pytest.mark.parametrize("content, needle", [
    ("", "is not a run CSV"),
    ("run_id,variant\nx,baseline\n", "lacks columns: status, final_val_loss"),
    ("run_id,variant,status,final_val_loss\n", "holds no runs"),
])
def test_bad_snapshots(tmp_path, content, needle):
    p = tmp_path / "runs.csv"
    p.write_text(content)
    with pytest.raises(AnalysisInputError, match=needle):
        import_snapshot(p)
    with pytest.raises(AnalysisInputError, match="snapshot not found"):
        import_snapshot(tmp_path / "nope.csv")


NOTEBOOK = REPO / "analysis" / "notebooks" / "scaling_fits.py"

# Appended to the notebook by the kernel test: what the figure drew, and with which backend.
FIGURE_PROBE = """
import json, matplotlib, matplotlib.colors as mc
from matplotlib.collections import PathCollection
dots = [c for c in ax.collections if isinstance(c, PathCollection)]
bands = [c for c in ax.collections if not isinstance(c, PathCollection)]
print("FIGURE " + json.dumps({"backend": matplotlib.get_backend(),
    "lines": [mc.to_hex(l.get_color()) for l in ax.lines],
    "dots": [sorted({mc.to_hex(c) for c in d.get_facecolors()}) for d in dots],
    "bands": [sorted({mc.to_hex(c) for c in b.get_facecolors()}) for b in bands]}))
"""


def test_notebook_runs_in_a_jupyter_kernel(tmp_path, monkeypatch):
    """The notebook, read by jupytext and executed cell by cell in a real IPython kernel (nbclient), as
    Jupyter runs it: its figure is shown inline, each variant's points, line and band in one colour,
    and ANALYSIS_NOTEBOOK_OUT names the figure's file."""
    import jupytext  # the `notebooks` extra, part of `dev`
    import nbclient
    import nbformat

    export_snapshot(_runset(), tmp_path / "runs.csv")
    monkeypatch.setenv("ANALYSIS_SNAPSHOT", str(tmp_path / "runs.csv"))
    monkeypatch.setenv("ANALYSIS_N_BOOT", "50")
    monkeypatch.setenv("ANALYSIS_NOTEBOOK_OUT", str(tmp_path / "figures" / "fits.png"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # what Jupyter's kernel chooses, not ours
    nb = jupytext.read(NOTEBOOK)
    nb.cells.append(nbformat.v4.new_code_cell(FIGURE_PROBE))
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "16 points from snapshot runs.csv" in text
    rich = [o for o in outputs if o.output_type in ("display_data", "execute_result")]
    assert sum("image/png" in o.data for o in rich) == 1  # the figure, inline, once
    assert any("text/html" in o.data and "multiplier" in o.data["text/html"] for o in rich)  # tables rendered
    figure = json.loads(text.split("FIGURE ", 1)[1].splitlines()[0])
    assert "inline" in figure["backend"]
    n = len(figure["lines"])
    assert n == len(figure["dots"]) == len(figure["bands"]) >= 2
    for line, dots, band in zip(figure["lines"], figure["dots"], figure["bands"]):
        assert dots == [line] and band == [line]  # one variant, one colour
    assert len(set(figure["lines"])) == n  # and a different one per variant
    assert (tmp_path / "figures" / "fits.png").is_file()
    assert (tmp_path / "figures" / "fits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_notebook_runs_as_a_script(tmp_path):
    """Run as a plain script (no Jupyter, no display): it prints its tables and writes the figure file."""
    export_snapshot(_runset(), tmp_path / "runs.csv")
    env = {**os.environ, "ANALYSIS_SNAPSHOT": str(tmp_path / "runs.csv"), "ANALYSIS_N_BOOT": "50",
           "ANALYSIS_NOTEBOOK_OUT": str(tmp_path / "fits.png")}
    env.pop("MPLBACKEND", None)
    env.pop("DISPLAY", None)
    r = subprocess.run([sys.executable, str(NOTEBOOK)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "16 points from snapshot runs.csv" in r.stdout
    assert "multiplier" in r.stdout and "separate α" in r.stdout and "C^-" in r.stdout
    assert (tmp_path / "fits.png").is_file() and (tmp_path / "fits.png").stat().st_size > 1000


def test_analysis_never_imports_training_code():
    """analysis/ reads runs through the MLflow schema only (docs/RUN_SCHEMA.md): no module of it
    may import attnres or harness, so it runs where only a snapshot CSV exists."""
    import ast

    for path in (REPO / "analysis").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            assert not [n for n in names if n.split(".")[0] in ("attnres", "harness", "torch")], \
                f"{path.relative_to(REPO)} imports {names}"


def test_a_run_without_token_metrics_has_no_made_up_tokens_or_compute(tmp_path):
    """A run killed before its first log has logged params but no train/* metric. Its tokens,
    FLOPs and compute are unknown (NaN), not the requested budget train.tokens (whose default,
    250000, stays set when train.tokens_per_param or train.flops decides the budget)."""
    pytest.importorskip("mlflow")
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    from analysis.runs import load_runs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("scaling", artifact_location=(tmp_path / "art").as_uri())
    rid = client.create_run(exp, tags={"attnres.role": "job", "attnres.status": "RUNNING"}).info.run_id
    client.log_batch(rid, params=[Param(k, v) for k, v in {
        "residual.name": "baseline", "train.tokens": "250000", "train.tokens_per_param": "2",
        "count.train_tokens": "41344", "count.flops_per_token": "196992"}.items()])
    row = load_runs(uri).iloc[0]
    assert np.isnan(row["tokens"]) and np.isnan(row["flops"]) and np.isnan(row["compute_pfd"])


def test_training_curves_mark_the_evaluations_of_short_runs(tmp_path, monkeypatch):
    """A run with one or two evaluations (a sweep tried small: `train.steps=15`) was drawn as a
    line without markers, that is not at all; its points are now marked, a long run stays a line."""
    from analysis import figures

    runs = pd.DataFrame({"run_id": ["short", "long"], "sweep": ["ablation"] * 2,
                         "variant": ["block", "baseline"], "status": ["FINISHED"] * 2})
    histories = pd.DataFrame({"run_id": ["short"] + ["long"] * 4, "key": ["val/loss_by_tokens"] * 5,
                              "step": [1000, 1000, 2000, 3000, 4000], "value": [3.0, 3.2, 3.0, 2.9, 2.8]})
    drawn = {}

    def keep(fig, folder, stem):
        drawn.update({line.get_label(): line.get_marker() for line in fig.axes[0].get_lines()})
        figures.plt.close(fig)
        return []

    monkeypatch.setattr(figures, "save", keep)
    figures.training_curves(histories, runs, tmp_path)
    assert drawn == {"block": "o", "baseline": "None"}
