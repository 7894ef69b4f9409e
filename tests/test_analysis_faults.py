"""Hostile and damaged input to the analysis: run-given text escaped for Markdown, HTML and LaTeX;
snapshots with one variant, duplicate rows, unusable losses or damaged side files; the adaptive
stage asked for another recipe or given bad arguments; the CLI's bad arguments."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import markup
from analysis.__main__ import main as analysis_main

REPO = Path(__file__).resolve().parents[1]
XSS = "<img src=x onerror=alert(1)>"


def _rows(variants=("baseline", "block", "full"), seeds=(0, 1, 2), sweep="ablation", **extra):
    """FINISHED ablation rows of one recipe, block and full a little below the baseline."""
    off = {"baseline": 0.0, "block": -0.02, "full": -0.03}
    noise = np.random.default_rng(len(variants)).normal(0, 0.003, (len(variants), len(seeds)))
    return [{"run_id": f"{v}-{s}", "experiment": sweep, "sweep": sweep, "variant": v, "seed": s,
             "status": "FINISHED", "final_val_loss": 2.0 + off.get(v, 0.01) + noise[i, j],
             "model": "tiny", "tokens": 40960.0, "run_key": f"k-{v}-{s}", **extra}
            for i, v in enumerate(variants) for j, s in enumerate(seeds)]


def _snapshot(folder: Path, rows) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def _report(snapshot: Path, out: Path) -> int:
    return analysis_main(["report", "--snapshot", str(snapshot), "--out", str(out), "--n-boot", "10"])


# --------------------------------------------------------------------------------------------
# Escaping
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hostile", [XSS, "<script>x</script>", "[click](javascript:alert(1))",
                                     "**bold** `code` $x$ ~~s~~ _em_ a|b"])
def test_markdown_escape_leaves_no_active_markup(hostile):
    out = markup.md(hostile)
    assert "<" not in out and ">" not in out
    assert "](" not in out.replace("\\](", "")  # no link survives
    for ch in "*`$~|":  # each active character is escaped
        assert out.count(ch) == out.count("\\" + ch)
    assert not re.search(r"(?<![\\A-Za-z0-9])_", out)


def test_markdown_escape_keeps_ordinary_names_and_intervals_as_written():
    for name in ("study_cpu", "no_key_norm", "baseline", "[0.715, 1.419]", "0.03", "−0.1 ± 0.2"):
        assert markup.md(name) == name
    assert markup.md_cell("a|b\nc") == "a\\|b c"


def test_html_and_latex_escape():
    assert markup.html(XSS) == "&lt;img src=x onerror=alert(1)&gt;"
    assert markup.html('"\'&') == "&quot;&#x27;&amp;"
    tex = markup.latex("$x} {y\\ 50% a_b #1 ~^ ±")
    assert tex == (r"\$x\} \{y\textbackslash{} 50\% a\_b \#1 \textasciitilde{}\textasciicircum{} "
                   r"$\pm$")
    # every brace left is one of an escape's own (balanced), no bare $ outside the ± macro
    assert tex.count("{") == tex.count("}") and tex.replace(r"\$", "").replace(r"$\pm$", "").count("$") == 0


def test_hostile_names_are_escaped_in_the_report_and_its_tables(tmp_path):
    """A sweep name, a variant and a failure text holding HTML, and a variant with `$` and `}`,
    reach REPORT.md, the .md tables and the .tex table escaped."""
    rows = _rows(sweep=f"ablation{XSS}") + _rows(("x$y}",), sweep=f"ablation{XSS}")
    rows.append({"run_id": "dead", "experiment": "e", "sweep": f"ablation{XSS}", "variant": XSS,
                 "seed": 0, "status": "FAILED", "failure": f"ValueError: {XSS}\n| boom",
                 "final_val_loss": None})
    out = tmp_path / "out"
    assert _report(_snapshot(tmp_path / "snap", rows), out) in (0, 1)
    texts = {p.name: p.read_text() for p in [out / "REPORT.md", *(out / "tables").glob("*.md")]}
    assert "table4_ablation.md" in texts
    for name, text in texts.items():
        assert "<img" not in text and "<script" not in text, name
    assert "&lt;img src=x onerror=alert(1)&gt;" in texts["REPORT.md"]
    tex = (out / "tables" / "table4_ablation.tex").read_text()
    assert r"x\$y\}" in tex and "x$y}" not in tex


# --------------------------------------------------------------------------------------------
# Snapshots: one variant, duplicate rows, unusable losses, damaged side files
# --------------------------------------------------------------------------------------------
def test_a_snapshot_of_one_variant_reports_what_it_can(tmp_path):
    out = tmp_path / "out"
    assert _report(_snapshot(tmp_path / "snap", _rows(("baseline",))), out) == 0
    report = (out / "REPORT.md").read_text()
    assert "This section failed" not in report
    assert pd.read_csv(out / "tables" / "table4_ablation.csv")["n"].tolist() == [3]


def test_duplicate_rows_and_unusable_losses_are_counted_once_and_named(tmp_path):
    """A `cat`-merged snapshot (its header repeated, every run twice) counts each run once, and a
    FINISHED run whose loss is NaN, inf or text is named in REPORT.md, not dropped in silence."""
    snap = _snapshot(tmp_path / "snap", _rows())
    bad = pd.DataFrame(_rows(("block",), seeds=(7, 8, 9)))
    bad["final_val_loss"] = ["nan", "inf", "abc"]
    bad["run_id"] = ["lossnan", "lossinf", "losstext"]
    text = snap.read_text()
    snap.write_text(text + text + bad.to_csv(index=False))  # cat a.csv a.csv bad.csv
    out = tmp_path / "out"
    assert _report(snap, out) == 0
    table = pd.read_csv(out / "tables" / "table4_ablation.csv").set_index("variant")
    assert table["n"].to_dict() == {"baseline": 3, "full": 3, "block": 3}
    report = (out / "REPORT.md").read_text()
    assert "repeated header row" in report and "repeat the run id of a later row" in report
    assert "3 finished run(s) have no finite final validation loss" in report
    for rid in ("lossnan", "lossinf", "losstext"):
        assert f"| {rid} |" in report


def test_one_run_spelled_two_ways_counts_once():
    """`train.steps=20` and `train.tokens=40960` give two run keys for what trained the same
    tokens at the same everything: one sample, the later kept."""
    from analysis.runs import _tidy, latest_per_config

    rows = [{**r, "start_time": 1000 + i} for i, r in enumerate(_rows(("baseline",), seeds=(0, 1)))]
    rows.append({**rows[0], "run_id": "respelled", "run_key": "another-key", "start_time": 5000})
    rows.append({**rows[1], "run_id": "more-tokens", "run_key": "k3", "tokens": 81920.0, "start_time": 6000})
    kept, dropped = latest_per_config(_tidy(rows))
    assert sorted(kept["run_id"]) == ["baseline-1", "more-tokens", "respelled"]
    assert dropped["run_id"].tolist() == ["baseline-0"]


@pytest.mark.parametrize("name, content, needle", [
    ("runs.history.csv", 'run_id,key,step,value\n"x,val/loss,1\n', "not a history CSV"),
    ("runs.history.csv", "a,b\n1,2\n", "lacks columns run_id, key, step, value"),
    ("runs.history.csv", "run_id,key,step,value\nr,val/loss,one,2.0\n", "non-numeric step"),
    ("runs.instrumentation.json", '{"r": [1, 2', "not JSON"),
    ("runs.instrumentation.json", "[1, 2]", "holds a list"),
    ("adaptive.json", "{broken", "not JSON"),
    ("adaptive.json", '{"plan": {}}', "lacks its rule or comparisons"),
])
def test_a_damaged_side_file_is_one_line_and_exit_2(tmp_path, capsys, name, content, needle):
    snap = _snapshot(tmp_path / "snap", _rows())
    (snap.parent / name).write_bytes(content.encode())
    assert _report(snap, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and needle in err[0]
    assert not (tmp_path / "out" / "REPORT.md").exists()


# --------------------------------------------------------------------------------------------
# The adaptive stage: keyed by the recipe, arguments checked first, Ctrl-C
# --------------------------------------------------------------------------------------------
def _log_finished(uri, experiment, variant, seed, loss, key):
    """A FINISHED training run as run.py logs it (the tags and metric the analysis reads)."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    rid = client.create_run(exp_id, tags={"attnres.variant": variant, "attnres.run_key": key,
                                          "attnres.status": "FINISHED", "attnres.role": "job"}).info.run_id
    client.log_batch(rid, metrics=[Metric("final/val_loss", loss, 0, 1)],
                     params=[Param("train.seed", str(seed)), Param("sweep.name", experiment)])
    client.set_terminated(rid)


def test_a_changed_recipe_trains_its_own_runs_and_never_reuses_the_old_verdict(tmp_path, monkeypatch):
    """Runs of the experiment trained with `train.steps=400` are not runs of `train.steps=7
    optim.lr=0.1`: called again with other overrides, the study trains the new recipe's runs
    (their keys) and judges those alone."""
    from analysis import adaptive

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    plan = adaptive.Plan((("block", "baseline"),), start=2, max_seeds=2, half_width=10.0)
    for s in (0, 1):  # the old recipe: block far below the baseline
        _log_finished(uri, "study", "block", s, 1.0 + 0.01 * s, f"old-block-{s}")
        _log_finished(uri, "study", "baseline", s, 2.0, f"old-baseline-{s}")
    new = {(v, s): f"new-{v}-{s}" for v in ("block", "baseline") for s in (0, 1)}
    launched = []

    def fake_launch(todo, overrides, lanes, log):  # training, as fast as logging its result
        for s, variants in todo.items():
            for v in variants:
                launched.append((v, s))
                _log_finished(uri, "study", v, s, 3.0 + (0.5 if v == "block" else 0) + 0.01 * s, new[(v, s)])
        return 0

    monkeypatch.setattr(adaptive, "_launch", fake_launch)
    log = __import__("io").StringIO()
    (st,), trained = adaptive.run(plan, uri, "study", ["train.steps=7", "optim.lr=0.1"], log=log, keys=new)
    assert trained == 4 and sorted(launched) == sorted(new)
    assert st.n == 2 and st.diff == pytest.approx(0.5) and st.verdict == "block > baseline"
    assert "4 finished run(s) of experiment study were trained with another recipe" in log.getvalue()
    # the same recipe again: nothing to train, the same verdict
    (again,), trained = adaptive.run(plan, uri, "study", [], log=log, keys=new)
    assert trained == 0 and again.verdict == st.verdict


def test_run_keys_follow_the_resolved_recipe():
    from analysis import adaptive

    plan = adaptive.Plan((("block", "baseline"),), start=2, max_seeds=2)
    long = adaptive.resolve_keys(plan, ["model=tiny", "train.steps=400", "sweep.name=s"])
    short = adaptive.resolve_keys(plan, ["model=tiny", "train.steps=7", "optim.lr=0.1", "sweep.name=s"])
    assert set(long) == set(short) == {(v, s) for v in ("block", "baseline") for s in (0, 1)}
    assert not set(long.values()) & set(short.values()) and len(set(long.values())) == 4
    with pytest.raises(adaptive.AdaptiveInputError, match="blok"):
        adaptive.resolve_keys(adaptive.Plan((("blok", "baseline"),), start=2, max_seeds=2), ["model=tiny"])


@pytest.mark.parametrize("args", [
    ["--first-seed", "-3"], ["--budget-minutes", "0"], ["--budget-minutes", "-1"],
    ["--budget-runs", "0"], ["--", "residual=full"], ["--", "train.seed=3"],
])
def test_adaptive_arguments_are_checked_before_anything_trains(tmp_path, capsys, monkeypatch, args):
    from analysis import adaptive

    def never(*a, **k):
        raise AssertionError("nothing may resolve or train on bad arguments")

    monkeypatch.setattr(adaptive, "resolve_keys", never)
    monkeypatch.setattr(adaptive, "_launch", never)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    assert adaptive.main(["--compare", "block:baseline", "--tracking-uri", uri, *args]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "m.db").exists()


def test_an_unknown_variant_is_refused_before_the_baseline_trains(tmp_path, capsys, monkeypatch):
    from analysis import adaptive

    monkeypatch.setattr(adaptive, "_launch", lambda *a, **k: pytest.fail("trained"))
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    assert adaptive.main(["--compare", "blok:baseline", "--tracking-uri", uri, "--", "model=tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "blok" in err[0]
    assert not (tmp_path / "m.db").exists()


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    from analysis import adaptive

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(adaptive, "resolve_keys", lambda plan, overrides: {})
    monkeypatch.setattr(adaptive, "run", interrupted)
    assert adaptive.main(["--compare", "block:baseline", "--tracking-uri",
                          f"sqlite:///{tmp_path / 'm.db'}"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]


def test_ctrl_c_stops_the_training_processes(monkeypatch):
    """The children `_launch` started are terminated before the interrupt goes on."""
    import subprocess
    import sys as _sys

    from analysis import adaptive

    started = []

    class Child(subprocess.Popen):  # a "training" that runs for a minute; Ctrl-C while waiting
        def communicate(self, input=None, timeout=None):
            raise KeyboardInterrupt

    def popen(cmd, **kw):
        started.append(Child([_sys.executable, "-c", "import time; time.sleep(60)"]))
        return started[-1]

    monkeypatch.setattr(adaptive.subprocess, "Popen", popen)
    with pytest.raises(KeyboardInterrupt):
        adaptive._launch({0: ["baseline", "block"]}, [], 2, __import__("io").StringIO())
    assert len(started) == 2 and all(p.poll() is not None for p in started)


def test_runs_without_a_known_token_count_are_kept_by_their_key():
    """Keyed runs that logged no tokens (killed before the first log, older harnesses) are told
    apart by their run key alone."""
    from analysis.runs import _tidy, latest_per_config

    rows = [{**r, "tokens": None, "start_time": i} for i, r in enumerate(_rows(("baseline",), seeds=(0, 1)))]
    kept, dropped = latest_per_config(_tidy(rows))
    assert len(kept) == 2 and dropped.empty


# --------------------------------------------------------------------------------------------
# The other commands' bad arguments: one line, exit 2, nothing written
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["noise", "--metric", "variant"], "not a numeric column"),
    (["noise", "--target", "inf"], "positive finite"),
    (["noise", "--seeds", "2,100000000000"], "<= 1000"),
    (["merge", "--without-sweep", "ablatoin"], "no such sweep"),
    (["merge", "--without-sweep", "ablation"], "no runs left"),
    (["report", "--multiplier-at", "inf"], "positive compute"),
    (["report", "--role", "ablatoin=ablation"], "no such sweep"),
])
def test_bad_arguments_of_the_other_commands(tmp_path, capsys, args, needle):
    snap = _snapshot(tmp_path / "snap", _rows())
    out = tmp_path / ("out.csv" if args[0] == "merge" else "out")
    argv = ([args[0], str(snap), *args[1:]] if args[0] == "merge"
            else [args[0], "--snapshot", str(snap), *args[1:]])
    assert analysis_main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not out.exists() or not any(out.iterdir())


def test_seeds_needed_for_constant_differences_returns_at_once():
    """Same-seed differences that agree to rounding (a snapshot whose variants differ by a fixed
    offset): two pairs suffice; the power search must not loop on statsmodels' NaN power."""
    from analysis.significance import seeds_needed_paired

    assert seeds_needed_paired(1e-17, 0.03) == 2.0
    assert seeds_needed_paired(0.03, 0.03) > 2


def test_an_adaptive_verdict_of_other_runs_is_not_quoted_beside_a_snapshot(tmp_path):
    """adaptive.json records the run keys its verdicts rest on; beside a snapshot without those
    runs (another recipe's study) the report does not quote it, and says why."""
    from analysis import adaptive
    from analysis.report import _adaptive_for
    from analysis.runs import import_snapshot

    plan = adaptive.Plan((("block", "baseline"),), start=2, max_seeds=3)
    keys = {(v, s): f"k-{v}-{s}" for v in ("block", "baseline") for s in (0, 1, 2)}
    st = adaptive.Status("block", "baseline", n=2, resolved=True, verdict="block < baseline")
    used = adaptive.used_keys(plan, [st], keys)
    assert used == ["k-baseline-0", "k-baseline-1", "k-block-0", "k-block-1"]
    snap = _snapshot(tmp_path / "snap", _rows())
    for run_keys, quoted in ((used, True), (["k-block-0", "old-recipe-key"], False)):
        (snap.parent / "adaptive.json").write_text(json.dumps(
            {"rule": plan.rule(), "comparisons": [st.__dict__], "run_keys": run_keys}))
        found, note = _adaptive_for(import_snapshot(snap))
        assert (found is not None) is quoted and bool(note) is not quoted
    assert "1 of the 2 runs" in note


def test_a_damaged_instrumentation_artifact_in_a_store_is_named_not_a_traceback(tmp_path):
    from mlflow.tracking import MlflowClient

    from analysis.runs import load_runset

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("ablation", artifact_location=(tmp_path / "art").as_uri())
    rid = client.create_run(exp, tags={"attnres.variant": "block"}).info.run_id
    client.log_text(rid, '{"step": 5, "depth_weights": [[1.0', "instrumentation/step_0000005.json")
    client.set_terminated(rid)
    rs = load_runset(uri)
    assert rs.instrumentation == {}
    assert len(rs.notes) == 1 and rid[:12] in rs.notes[0] and "not a JSON object" in rs.notes[0]


def test_merge_of_a_cat_joined_snapshot_keeps_each_run_once_and_says_so(tmp_path, capsys):
    snap = _snapshot(tmp_path / "snap", _rows())
    snap.write_text(snap.read_text() * 2)
    out = tmp_path / "merged.csv"
    assert analysis_main(["merge", str(snap), "--out", str(out)]) == 0
    assert len(pd.read_csv(out)) == 9
    assert "repeat the run id of a later row" in capsys.readouterr().err


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    import analysis.__main__ as cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "import_snapshot", interrupted)
    snap = _snapshot(tmp_path / "snap", _rows())
    assert cli.main(["report", "--snapshot", str(snap), "--out", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
