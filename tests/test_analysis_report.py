"""End to end: a tiny MLflow SQLite database written the way docs/RUN_SCHEMA.md says run.py
writes it → ``python -m analysis report`` → tables, figures, REPORT.md; then the same from an
exported snapshot, which must give identical tables and report. Also the CLI's bad-input paths."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("mlflow")
from mlflow.entities import Metric, Param  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from analysis.__main__ import main  # noqa: E402
from analysis.runs import import_snapshot, load_runs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FLOPS_PER_TOKEN = 6.0e6
# Ablation offsets from the baseline, in the paper's direction (Table 4).
OFFSET = {"baseline": 0.0, "full": -0.030, "block": -0.020, "mhc": -0.015}


def _log_run(client, exp_id, *, variant, sweep, seed, loss, tokens, d_model=64, layers=4,
             n_heads=2, block_size=None, status="FINISHED", parent=None, instrument=False,
             extra=None):
    tags = {"attnres.variant": variant, "attnres.sweep": sweep, "attnres.seed": str(seed),
            "attnres.model": "tiny", "attnres.status": status, "attnres.role": "job"}
    if parent:
        tags["mlflow.parentRunId"] = parent
    if status == "FAILED":
        tags["attnres.failure"] = "FloatingPointError: loss became NaN at step 7\n| at line 3"
    run = client.create_run(exp_id, tags=tags)
    rid = run.info.run_id
    params = {"residual.name": variant, "model.name": "tiny", "model.d_model": d_model,
              "model.layers": layers, "model.n_heads": n_heads, "train.seed": seed,
              "train.tokens": tokens, "sweep.name": sweep, "residual.block_size": block_size,
              "count.flops_per_token": FLOPS_PER_TOKEN, "count.params_total": 12345,
              **(extra or {})}
    metrics, ts = [], 0
    steps = np.arange(1, 6)
    if status == "FINISHED":
        curve = loss + 0.5 / steps
        for s, v in zip(steps, curve):
            metrics += [Metric("val/loss", float(v), ts, int(s)),
                        Metric("val/loss_by_tokens", float(v), ts, int(s * tokens // 5)),
                        Metric("train/loss", float(v + 0.01), ts, int(s))]
        metrics += [Metric("final/val_loss", float(loss), ts, 5),
                    Metric("final/val_loss_best", float(loss), ts, 5),
                    Metric("final/tokens", float(tokens), ts, 5),
                    Metric("final/flops", float(tokens * FLOPS_PER_TOKEN), ts, 5)]
        for b in range(layers):
            growth = 1.5 ** b if variant == "baseline" else 1.0 + 0.1 * (b % 2)
            metrics += [Metric(f"depth/output_rms/block_{b:02d}", growth, ts, 5),
                        Metric(f"depth/grad_norm/block_{b:02d}", 1.0 / (1 + b), ts, 5)]
    else:
        metrics += [Metric("val/loss", 3.0, ts, 1)]
    client.log_batch(rid, metrics=metrics,
                     params=[Param(k, str(v)) for k, v in params.items()])
    if instrument:
        n_sub = 2 * layers
        W = np.full((n_sub + 1, n_sub + 1), np.nan)
        for r in range(n_sub + 1):
            w = np.full(r + 1, 0.1)
            w[-1] += 0.6
            W[r, : r + 1] = w / w.sum()
        payload = {"step": 5, "depth_weights": [[None if np.isnan(x) else x for x in row]
                                                for row in W.tolist()],
                   "sublayer_kind": ["attn", "mlp"] * layers + ["out"],
                   "output_rms_sublayer": [1.0] * n_sub,
                   "output_rms_block": [1.0 + 0.1 * (b % 2) for b in range(layers)],
                   "grad_norm_block": [1.0] * layers}
        client.log_text(rid, json.dumps(payload), "instrumentation/step_0000005.json")
    client.set_terminated(rid, "FINISHED" if status == "FINISHED" else "FAILED")
    return rid


@pytest.fixture(scope="module")
def tiny_db(tmp_path_factory):
    """Four sweeps, 40 training runs (one FAILED), one parent run and an empty experiment."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    rng = np.random.default_rng(0)
    exps = {s: client.create_experiment(s, artifact_location=(root / "art" / s).as_uri())
            for s in ("ablation", "scaling", "block_size", "arch", "multihop")}
    client.create_experiment("empty", artifact_location=(root / "art" / "empty").as_uri())
    parent = client.create_run(exps["ablation"], tags={"attnres.role": "parent"}).info.run_id
    for v, off in OFFSET.items():
        for seed in (0, 1, 2):
            _log_run(client, exps["ablation"], variant=v, sweep="ablation", seed=seed,
                     loss=2.0 + off + rng.normal(0, 0.002), tokens=10_000, parent=parent,
                     instrument=v in ("full", "block") and seed == 0)
    failed = _log_run(client, exps["ablation"], variant="hc", sweep="ablation", seed=0, loss=np.nan,
                      tokens=10_000, status="FAILED", parent=parent)
    for v, A in (("baseline", 1.0), ("block", 0.97)):
        for tokens in (20_000, 60_000, 200_000, 600_000):  # 4 sizes: the fewest with an interval
            C = tokens * FLOPS_PER_TOKEN / 8.64e19
            _log_run(client, exps["scaling"], variant=v, sweep="scaling", seed=0,
                     loss=A * C ** -0.05 * np.exp(rng.normal(0, 0.002)), tokens=tokens)
    for S, v in ((1, "full"), (2, "block"), (4, "block"), (8, "block")):
        _log_run(client, exps["block_size"], variant=v, sweep="block_size", seed=0,
                 loss=1.97 + 0.002 * S, tokens=10_000, block_size=S)
    _log_run(client, exps["block_size"], variant="baseline", sweep="block_size", seed=0,
             loss=2.0, tokens=10_000)
    for v, best in (("baseline", 32), ("block", 16)):
        for dpl in (8, 16, 32, 64):  # d_model = 128 throughout: layers = 128 / dpl
            for hpl in (0.5, 1.0):
                layers = 128 // dpl
                loss = (2.0 - (0.02 if v == "block" else 0) + 0.05 * np.log(dpl / best) ** 2
                        + 0.01 * hpl)
                _log_run(client, exps["arch"], variant=v, sweep="arch", seed=0, loss=loss,
                         tokens=10_000, d_model=128, layers=layers, n_heads=int(hpl * layers),
                         extra={"sweep.arch.d_model_per_layer": dpl,
                                "sweep.arch.heads_per_layer": hpl})
    for v, gain in (("baseline", 0.0), ("block", 0.1)):
        for seed in (0, 1):
            rid = _log_run(client, exps["multihop"], variant=v, sweep="multihop", seed=seed,
                           loss=1.5, tokens=10_000)
            for k in (1, 2, 3):
                client.log_metric(rid, f"probe/acc_hop_{k}", 0.9 / k + gain + 0.01 * seed, step=5)
    return {"uri": uri, "root": root, "failed": failed, "parent": parent}


def test_loader_reads_schema(tiny_db):
    runs = load_runs(tiny_db["uri"])
    assert len(runs) == 13 + 8 + 5 + 16 + 4  # ablation (one FAILED), scaling, block size, arch, probe
    probe = runs[runs["sweep"] == "multihop"].set_index(["variant", "seed"])
    assert probe.loc[("block", 1), "probe_acc_hop_3"] == pytest.approx(0.3 + 0.1 + 0.01)
    assert tiny_db["parent"] not in set(runs["run_id"])  # parent runs hold no training
    failed = runs.set_index("run_id").loc[tiny_db["failed"]]
    assert failed["status"] == "FAILED" and "NaN" in failed["failure"]
    fin = runs[runs["status"] == "FINISHED"]
    assert np.allclose(fin["flops"], fin["tokens"] * FLOPS_PER_TOKEN)
    assert np.allclose(fin["compute_pfd"], fin["flops"] / 8.64e19)
    assert fin["output_rms_block_00"].notna().all()
    only = load_runs(tiny_db["uri"], ["scaling"], "tags.attnres.variant = 'block'")
    assert set(only["variant"]) == {"block"} and len(only) == 4


def _files(folder: Path):
    return {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}


def test_report_end_to_end_and_from_snapshot(tiny_db, tmp_path):
    out_db, out_snap = tmp_path / "from_db", tmp_path / "from_snapshot"
    assert main(["report", "--tracking-uri", tiny_db["uri"], "--out", str(out_db),
                 "--n-boot", "200"]) == 0
    report = (out_db / "REPORT.md").read_text()
    for fig in ("fig4_scaling", "fig5_dynamics", "fig6_block_size", "fig7_arch",
                "fig8_depth_weights", "training_curves", "multihop_probe"):
        for ext in ("png", "pdf"):
            assert (out_db / "figures" / f"{fig}.{ext}").stat().st_size > 1000, fig
    assert tiny_db["failed"][:12] in report and "FAILED" in report  # listed, not dropped
    assert "loss became NaN at step 7 \\| at line 3 |" in report  # one table row, pipe escaped
    assert "section failed" not in report.lower()

    table = pd.read_csv(out_db / "tables" / "table4_ablation.csv").set_index("variant")
    assert list(table.index) == ["baseline", "mhc", "full", "block"]  # paper's Table-4 order
    assert (table["n"] == 3).all()
    assert table.loc["full", "delta"] == pytest.approx(-0.030, abs=0.005)
    assert (table.loc[["full", "block", "mhc"], "verdict"] == "better").all()
    assert table.loc["block", "paper_loss"] == pytest.approx(1.746)
    for ext in ("md", "tex"):
        assert (out_db / "tables" / f"table4_ablation.{ext}").read_text().count("full") >= 1

    fits = pd.read_csv(out_db / "tables" / "scaling_fits.csv")
    pure = fits[fits["form"] == "A·C^-α"].set_index("variant")
    assert pure.loc["baseline", "alpha"] == pytest.approx(0.05, abs=0.01)
    mult = pd.read_csv(out_db / "tables" / "compute_multiplier.csv")
    ours = mult[(mult["variant"] == "block") & (mult["form"] == "A·C^-α")].iloc[0]
    # (1/0.97)^(1/0.05) = 1.84 with a shared exponent; noise moves it a little.
    assert 1.3 < ours["multiplier"] < 2.5 and ours["lo"] <= ours["multiplier"] <= ours["hi"]
    optima = pd.read_csv(out_db / "tables" / "fig7_optima.csv")
    o = optima[optima["source"] == "ours"].set_index("variant")
    assert o.loc["baseline", "grid_optimum"] == 32 and o.loc["block", "grid_optimum"] == 16
    assert (o["heads_per_layer"] == 0.5).all()
    # The synthetic loss is exactly quadratic in log(d/L), so the refinement finds its vertex.
    assert o.loc["baseline", "refined"] == pytest.approx(32, rel=1e-6)
    assert o.loc["block", "refined"] == pytest.approx(16, rel=1e-6)
    verdicts = {line.split(" | ")[1]: line.split(" | ")[-1].rstrip(" |")
                for line in report.splitlines() if line.startswith("| ") and " | " in line}
    assert verdicts["Block AttnRes reaches the baseline's loss with less compute (paper 1.25× at "
                    "5.6 PFLOP/s-days)"] == "agrees"
    assert verdicts["Full AttnRes beats the baseline (paper Δ -0.029)"] == "agrees"
    # 4 of 8 cells by point estimate, but one seed per cell and no replicate: no noise level.
    assert verdicts["AttnRes wins in every cell (25 of 25)"] == "inconclusive"
    assert verdicts["full: each sublayer weights its most recent source above a uniform share "
                    "(strong diagonal)"] == "inconclusive"  # one instrumented run per variant
    assert verdicts["block answers multi-hop chains better than the baseline (mean over hop "
                    "counts)"] == "agrees"
    assert "What it would take to tell" in report
    probe = pd.read_csv(out_db / "tables" / "multihop_probe.csv").set_index("variant")
    assert probe.loc["block", "hop 2"] == pytest.approx(0.45 + 0.1 + 0.005)

    # Export a snapshot with the CLI, then regenerate from it: tables and report must match.
    snap = tmp_path / "snap" / "runs.csv"
    assert main(["export", "--tracking-uri", tiny_db["uri"], "--out", str(snap)]) == 0
    assert (snap.parent / "runs.history.csv").is_file()
    assert len(import_snapshot(snap).instrumentation) == 2
    assert main(["report", "--snapshot", str(snap), "--out", str(out_snap), "--n-boot", "200"]) == 0
    a, b = _files(out_db / "tables"), _files(out_snap / "tables")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes(), name

    def strip(text):
        return [line for line in text.splitlines() if not line.startswith("Source:")]

    assert strip(report) == strip((out_snap / "REPORT.md").read_text())


def test_report_with_missing_sections(tiny_db, tmp_path):
    """Only the ablation sweep, and no paper CSVs: the other sections say they have no runs and
    the paper columns are empty, instead of failing."""
    out = tmp_path / "ab"
    (tmp_path / "no_paper").mkdir()
    assert main(["report", "--tracking-uri", tiny_db["uri"], "--experiment", "ablation",
                 "--out", str(out), "--n-boot", "50",
                 "--paper-dir", str(tmp_path / "no_paper")]) == 0
    report = (out / "REPORT.md").read_text()
    assert "The paper's numbers were not found" in report
    assert pd.read_csv(out / "tables" / "table4_ablation.csv")["paper_loss"].isna().all()
    assert "No variant has runs at two or more compute values" in report
    assert "No architecture sweep" in report and "No block-size sweep" in report
    assert (out / "figures" / "fig4_scaling.png").is_file()  # paper panel still drawn


def test_report_on_ad_hoc_runs(tmp_path, monkeypatch):
    """Runs of `python run.py -m residual=...` (experiment `default`, no sweep param, one run still
    RUNNING): the ablation table falls back to them and the unfinished run is listed."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'adhoc.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("default", artifact_location=(tmp_path / "art").as_uri())
    for v, loss in (("baseline", 2.0), ("block", 1.97), ("mhc", 1.98)):
        for seed in (0, 1):
            rid = client.create_run(exp, tags={"attnres.variant": v}).info.run_id
            client.log_batch(rid, metrics=[Metric("final/val_loss", loss + 0.001 * seed, 0, 1)],
                             params=[Param("train.seed", str(seed))])
            client.set_terminated(rid)
    stuck = client.create_run(exp, tags={"attnres.variant": "full"}).info.run_id
    out = tmp_path / "out"
    assert main(["report", "--tracking-uri", uri, "--out", str(out), "--n-boot", "20"]) == 0
    report = (out / "REPORT.md").read_text()
    assert "No `ablation` sweep: this table compares the finished runs of other sweeps (default)" \
        in report
    assert stuck[:12] in report and "RUNNING" in report
    table = pd.read_csv(out / "tables" / "table4_ablation.csv")
    assert list(table["variant"]) == ["baseline", "mhc", "block"]
    assert table["n"].tolist() == [2, 2, 2]
    assert "no validation-loss histories" not in report  # the curves section degrades in words
    assert "No metric histories in the input." in report


def test_a_config_trained_again_counts_once(tmp_path, monkeypatch):
    """A config and seed trained twice into one store (`train.resume=false`, or another checkpoint
    folder: the same `attnres.run_key`) is one sample, not two seeds: the later run counts, the
    earlier is listed as left out. Runs without the tag all count."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'again.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("default", artifact_location=(tmp_path / "art").as_uri())

    def run(variant, seed, loss, start, key="auto"):
        tags = {"attnres.variant": variant}
        if key:
            tags["attnres.run_key"] = f"{variant}{seed}" if key == "auto" else key
        rid = client.create_run(exp, start_time=start, tags=tags).info.run_id
        client.log_batch(rid, metrics=[Metric("final/val_loss", loss, 0, 1)], params=[Param("train.seed", str(seed))])
        client.set_terminated(rid)
        return rid

    first = run("baseline", 0, 2.50, start=1000)
    run("baseline", 0, 2.00, start=2000)  # the same config and seed, trained again later
    run("baseline", 1, 2.02, start=1500)
    for seed in (0, 1):
        run("block", seed, 1.97 + 0.01 * seed, start=1100 + seed)
    for seed in (0, 0):  # older runs without the tag: both kept
        run("mhc", seed, 1.98, start=1200, key=None)
    out = tmp_path / "out"
    assert main(["report", "--tracking-uri", uri, "--out", str(out), "--n-boot", "20"]) == 0
    table = pd.read_csv(out / "tables" / "table4_ablation.csv").set_index("variant")
    assert table.loc["baseline", "n"] == 2 and table.loc["block", "n"] == 2 and table.loc["mhc", "n"] == 2
    assert table.loc["baseline", "loss"] == pytest.approx(2.01)  # the later seed-0 run, not 2.50
    report = (out / "REPORT.md").read_text()
    assert "1 finished run(s) repeat the config and seed of a later run" in report and first[:12] in report


@pytest.mark.parametrize("args, needle", [
    (["--tracking-uri", "sqlite:///{root}/nope.db"], "tracking database not found"),
    (["--tracking-uri", "{uri}", "--experiment", "ghost"], "unknown experiment 'ghost'"),
    (["--tracking-uri", "{uri}", "--experiment", "empty"], "no runs found"),
    (["--snapshot", "{root}/missing.csv"], "snapshot not found"),
    (["--tracking-uri", "{uri}", "--filter", "tags.x ==== 3"], "cannot read runs from"),
])
def test_bad_input_exits_with_one_line(tiny_db, tmp_path, capsys, args, needle):
    args = [a.format(root=tiny_db["root"], uri=tiny_db["uri"]) for a in args]
    assert main(["report", *args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x" / "REPORT.md").exists()


def test_module_entry_point(tiny_db, tmp_path):
    """`python -m analysis` as a user types it: a bad URI fails with status 2 and one line."""
    r = subprocess.run([sys.executable, "-m", "analysis", "export", "--tracking-uri",
                        f"sqlite:///{tmp_path}/missing.db", "--out", str(tmp_path / "r.csv")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    expected = f"error: tracking database not found: {tmp_path}/missing.db"
    assert r.stderr.strip().splitlines() == [expected]


def test_out_that_cannot_be_written_is_one_line_before_loading(tiny_db, tmp_path, capsys):
    """--out below a file (or where nothing can be created): status 2, one line, nothing made."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for command, out in (("report", blocker / "sub" / "report"), ("export", blocker / "runs.csv")):
        assert main([command, "--tracking-uri", tiny_db["uri"], "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: --out {out}: {blocker} is a file, not a folder"]
    assert blocker.read_text() == "x"


def test_unreachable_tracking_server_fails_at_once(tmp_path):
    """A tracking server that does not answer: one line naming it, not minutes of MLflow's
    retries (the guard: a 60 s limit on a command that used to take ~4 minutes)."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_HTTP_REQUEST")}
    r = subprocess.run([sys.executable, "-m", "analysis", "export", "--tracking-uri",
                        f"http://127.0.0.1:{port}", "--out", str(tmp_path / "r.csv")],
                       cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot read runs from http://127.0.0.1:{port}: "
                                               "no MLflow server answers there ("), err
    assert not (tmp_path / "r.csv").exists()


def test_dynamics_and_depth_sections_take_one_model_configuration():
    """Without ablation runs the Fig. 5/8 sections fall back to the finished runs: those of one
    model configuration (the most runs), never depths pooled as if they were seeds."""
    import pandas as pd

    from analysis.report import _one_configuration

    runs = pd.DataFrame({"model": ["m"] * 3, "d_model": [64.0] * 3, "layers": [2.0, 4.0, 4.0],
                         "tokens": [1e6] * 3, "run_id": ["a", "b", "c"]})
    assert _one_configuration(runs)["run_id"].tolist() == ["b", "c"]


def test_runs_at_another_learning_rate_or_budget_are_not_pooled_as_seeds():
    """An ad-hoc grid over optim.lr (one seed each), or a short trial of the ablation sweep beside
    the full one, gave Table 4 n = 2 'seeds' per variant mixing two recipes, and a seed noise and
    seed counts computed from the gap between them. Only one configuration is compared."""
    import pandas as pd

    from analysis.report import _ablation_runs

    def runs(section, **varying):
        n = len(next(iter(varying.values())))
        base = {"model": ["default"] * n, "d_model": [64.0] * n, "layers": [4.0] * n,
                "tokens": [20480.0] * n, "lr": [1e-3] * n, "seed": [0.0] * n,
                "variant": ["baseline", "block"] * (n // 2), "sweep": [section] * n,
                "section": ["other" if section == "default" else section] * n,
                "role": ["job"] * n, "run_id": [f"r{i}" for i in range(n)]}
        return pd.DataFrame({**base, **varying})

    grid = runs("default", lr=[1e-3, 1e-3, 3e-2, 3e-2, 3e-2, 3e-2],
                seed=[0.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    chosen, note = _ablation_runs(grid)
    assert chosen["lr"].tolist() == [3e-2] * 4 and chosen.groupby("variant").size().tolist() == [2, 2]
    assert "lr = 0.03" in note and "2 configurations present, 2 runs left out" in note, note

    trial_and_full = runs("ablation", tokens=[30720.0] * 2 + [251904.0] * 4,
                          seed=[0.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    chosen, note = _ablation_runs(trial_and_full)
    assert chosen["tokens"].tolist() == [251904.0] * 4
    assert note.startswith("The ablation runs are restricted") and "tokens = 251904" in note, note

    one = runs("ablation", seed=[0.0, 0.0, 1.0, 1.0])
    chosen, note = _ablation_runs(one)
    assert len(chosen) == 4 and note == ""

    # Two block runs at S = 2 and S = 4 with one seed are two variants, not two seeds of one.
    sizes = runs("ablation", seed=[0.0, 0.0, 1.0, 1.0, 0.0, 0.0],
                 block_size=[float("nan"), 2.0, float("nan"), 2.0, float("nan"), 4.0])
    chosen, note = _ablation_runs(sizes)
    assert chosen["run_id"].tolist() == ["r0", "r1", "r2", "r3", "r4"], note
    assert note == ("Runs compared as seeds share their variant's settings: block at block_size = 2 "
                    "(1 run at other settings left out)."), note


def test_sweeps_go_to_sections_by_name_and_the_optuna_lr_studies_feed_the_tuned_table():
    """`+sweep=lr` (per-variant Optuna studies over the learning rate) was filed under "other" and
    never used; its finished trials are a learning-rate search like the tuned_lr grid. --role wins."""
    import pandas as pd

    from analysis.report import assign_roles

    runs = pd.DataFrame({"sweep": ["ablation", "scaling_gpu", "lr", "lr_wide", "tuned_lr", "mine", "lr", None]})
    roles = assign_roles(runs, {"mine": "arch", "lr_wide": "ablation"})
    assert roles.tolist() == ["ablation", "scaling", "tuned_lr", "ablation", "tuned_lr", "arch", "tuned_lr", "other"]


def test_a_learning_rate_grid_is_extended_by_ablation_runs_of_its_recipe_only():
    """The tuned table adds the ablation's runs at the shared rate to each variant's grid; a grid
    trained for another budget (train.steps=25 against the ablation's 15) pooled them anyway, and
    the 'best' point then compared budgets. Grid points share the recipe but the learning rate."""
    import pandas as pd

    from analysis.report import _tuned_lr_runs

    def runs(section, tokens, lrs):
        n = len(lrs)
        return pd.DataFrame({"model": ["default"] * n, "d_model": [64.0] * n, "layers": [4.0] * n,
                             "tokens": [tokens] * n, "lr": lrs, "seed": [0.0] * n, "variant": ["block"] * n,
                             "section": [section] * n, "run_id": [f"{section}{i}" for i in range(n)]})

    grid, ablation = runs("tuned_lr", 20480.0, [1e-3, 1e-2]), runs("ablation", 20480.0, [3e-3])
    tuned, extra, note = _tuned_lr_runs(pd.concat([grid, ablation]), ablation)
    assert len(tuned) == 2 and extra["run_id"].tolist() == ["ablation0"] and note == ""

    longer = runs("tuned_lr", 34816.0, [1e-3, 1e-2])
    tuned, extra, note = _tuned_lr_runs(pd.concat([longer, ablation]), ablation)
    assert len(tuned) == 2 and extra.empty
    assert note == "the ablation's runs were trained with another recipe than the grid's and do not extend it"

    mixed = pd.concat([grid, longer.iloc[:1].assign(run_id="odd")])
    tuned, extra, note = _tuned_lr_runs(mixed, ablation)
    assert tuned["run_id"].tolist() == ["tuned_lr0", "tuned_lr1"] and len(extra) == 1
    assert "restricted to the recipe with the most runs (tokens = 20480; 1 runs of other recipes left out)" in note, note


def test_a_report_that_stops_half_way_leaves_its_folder_as_it_was(tiny_db, tmp_path, monkeypatch):
    """Runs that ended KILLED without a failure message beside one FAILED with a message (the
    frame then holds NaN, not None) made the report stop with a traceback after its figures
    were written. Now it lists them; and a report that does stop writes nothing into --out."""
    from analysis import report

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    client = MlflowClient(tracking_uri=tiny_db["uri"])
    exp = client.get_experiment_by_name("ablation").experiment_id
    killed = client.create_run(exp, tags={"attnres.variant": "block", "attnres.sweep": "ablation"}).info.run_id
    client.set_terminated(killed, "KILLED")
    try:
        assert main(["report", "--tracking-uri", tiny_db["uri"], "--out", str(out), "--n-boot", "20"]) == 0
        text = (out / "REPORT.md").read_text()
        assert killed[:12] in text and "FloatingPointError: loss became NaN at step 7" in text

        def broken(*args, **kwargs):
            raise RuntimeError("a bug outside the sections")

        fresh = tmp_path / "fresh"
        fresh.mkdir()
        (fresh / "keep.txt").write_text("mine")
        monkeypatch.setattr(report, "_summary", broken)
        with pytest.raises(RuntimeError, match="a bug outside the sections"):
            main(["report", "--tracking-uri", tiny_db["uri"], "--out", str(fresh), "--n-boot", "20"])
        assert sorted(p.name for p in fresh.iterdir()) == ["keep.txt"]  # no figure, no staging folder
    finally:
        client.delete_run(killed)  # the module's store is shared by the other tests


def test_without_a_source_option_the_store_run_py_writes_to_is_read(tiny_db, tmp_path, capsys,
                                                                    monkeypatch):
    """README's environment table: MLFLOW_TRACKING_URI (else <project root>/mlflow.db) is the
    store of run.py, evaluation *and analysis* when no option names one. Analysis required
    --tracking-uri or --snapshot (argparse's usage, exit 2) and ignored the variable."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tiny_db["uri"])
    assert main(["export", "--out", str(tmp_path / "runs.csv")]) == 0
    assert capsys.readouterr().out.startswith("wrote 46 runs to ")  # the fixture's training runs
    missing = tmp_path / "nope.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{missing}")
    assert main(["report", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: tracking database not found: {missing} (the default store; allowed: "
                   "--tracking-uri URI, $MLFLOW_TRACKING_URI or --snapshot CSV)"], err
    assert not missing.exists() and not (tmp_path / "r" / "REPORT.md").exists()
    from analysis.__main__ import _default_tracking_uri
    from harness.config import default_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert _default_tracking_uri() == default_tracking_uri()  # analysis's copy of run.py's rule
