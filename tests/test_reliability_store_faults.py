"""A tracking store that is damaged, or that disappears under a run.

A SQLite store cut short or with damaged pages is one line naming it and what is wrong, exit 2,
nothing left behind, from run.py, `analysis export` and the evaluation commands (it was a
SQLAlchemy traceback, and from run.py a Hydra one with the run's output folder left)."""
import os
import subprocess
import sys

import pytest

from harness_testing import ROOT, TINY
from harness_testing import restore_process_state  # noqa: F401  (a fixture, used below)

FAST = ["tracking.log_code=false", "tracking.log_env=false"]


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    """The bytes of a fresh MLflow SQLite store (its schema made by MLflow itself)."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path.read_bytes()


def damaged(kind: str, good: bytes) -> bytes:
    if kind == "cut short":
        return good[: len(good) // 3]
    # the header kept, the schema page overwritten (a disk's bad sector, a copy of the wrong blocks)
    return good[:100] + bytes((i * 7 + 3) % 251 for i in range(4096 - 100)) + good[4096:]


KINDS = {"cut short": "is cut short", "damaged pages": "is a damaged SQLite database"}


def _env():
    return {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_sqlite_store_is_one_line_from_run_py_and_nothing_is_left(kind, mlflow_store, tmp_path):
    store = tmp_path / "mlflow.db"
    store.write_bytes(damaged(kind, mlflow_store))
    before = store.read_bytes()
    result = subprocess.run([sys.executable, "run.py", *TINY, *FAST, f"tracking.uri=sqlite:///{store}",
                             f"train.checkpoint_dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path / 'out'}"],
                            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: tracking.uri=sqlite:///{store}: ") and KINDS[kind] in lines[0], lines
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()
    assert store.read_bytes() == before  # the store is evidence: never "repaired" or replaced


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_sqlite_store_is_one_line_from_analysis_and_evaluation(kind, mlflow_store, tmp_path, capsys):
    from analysis.__main__ import main as analysis
    from evaluation.cli import main as evaluate
    from evaluation.explorer import main as explore

    store = tmp_path / "mlflow.db"
    store.write_bytes(damaged(kind, mlflow_store))
    uri = f"sqlite:///{store}"
    run_id = "0123456789abcdef0123456789abcdef"
    for command, args in [(analysis, ["export", "--tracking-uri", uri, "--out", str(tmp_path / "runs.csv")]),
                          (evaluate, [run_id, "--tracking-uri", uri]),
                          (explore, [run_id, "--tracking-uri", uri, "--out", str(tmp_path / "d.html")])]:
        assert command(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(store) in err and KINDS[kind] in err, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


def test_a_sound_store_and_an_empty_file_are_not_damage(mlflow_store, tmp_path):
    from harness.tracking import sqlite_damage

    (tmp_path / "good.db").write_bytes(mlflow_store)
    (tmp_path / "empty.db").write_bytes(b"")
    assert sqlite_damage(tmp_path / "good.db") is None and sqlite_damage(tmp_path / "empty.db") is None
    assert sqlite_damage(tmp_path / "absent.db") is None
    assert "a folder" in sqlite_damage(tmp_path) and "another kind of file" in sqlite_damage(ROOT / "README.md")


@pytest.mark.usefixtures("restore_process_state")
def test_a_store_deleted_mid_run_keeps_the_records_and_the_rerun_never_calls_the_run_finished(tmp_path, monkeypatch,
                                                                                              capfd):
    """The SQLite store deleted at step 3 (a backup taken just before): it was six of MLflow's
    tracebacks, "the MLflow server is unreachable", and a rerun answering "already finished" for
    a run the new store never saw. Now: one warning while it trains and one at its end saying how
    to send the records kept in the run folder; a rerun without the store is one line, exit 2,
    and leaves no empty store; with the store put back the rerun sends everything, once."""
    import shutil

    from harness import job
    from harness.tracking import PENDING_METRICS, MlflowTracker
    from harness_testing import compose

    store = tmp_path / "mlflow.db"
    real_log = MlflowTracker.log_metrics

    def delete_the_store_after_step_2(self, metrics, step):
        if step == 3 and "train/loss" in metrics and store.exists():
            shutil.copy(store, tmp_path / "backup.db")
            store.unlink()
        return real_log(self, metrics, step)

    monkeypatch.setattr(MlflowTracker, "log_metrics", delete_the_store_after_step_2)
    overrides = [*TINY, *FAST, f"tracking.uri=sqlite:///{store}", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
                 "tracking.flush_seconds=0"]
    value = job.run(compose(overrides))  # trains to the end
    err = capfd.readouterr().err
    assert "Traceback" not in err and "server is unreachable" not in err, err[-3000:]
    said = [l for l in err.splitlines() if "was deleted during run" in l]
    assert len(said) == 1 and "train.resume=false" in said[0] and "rerun the same command" in said[0], said
    folder = next((tmp_path / "ckpt").rglob("run.json")).parent
    assert '"step": 6' in (folder / PENDING_METRICS).read_text()
    assert not store.exists()  # no empty store made in its place

    def rerun():
        # (code_change=keep: the files of the tree may change while the suite runs; not this test's subject)
        return subprocess.run([sys.executable, "run.py", *overrides, f"hydra.run.dir={tmp_path / 'out'}",
                               "train.code_change=keep"], cwd=ROOT,
                              env=_env(), capture_output=True, text=True, timeout=120)

    result = rerun()
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "is not in tracking.uri=" in lines[0] and "train.resume=false" in lines[0], lines
    assert "already finished" not in result.stderr and not store.exists() and not (tmp_path / "out").exists()

    # The store put back: the same command sends what waited. In this process, whose MLflow engine
    # opened the deleted file (a multirun's next job is in the same place).
    shutil.copy(tmp_path / "backup.db", store)
    capfd.readouterr()
    assert job.run(compose([*overrides, "train.code_change=keep"])) == value
    assert "already finished" in capfd.readouterr().err
    import sqlite3

    with sqlite3.connect(store) as db:
        assert db.execute("SELECT status FROM runs").fetchall() == [("FINISHED",)]
        assert db.execute("SELECT value FROM latest_metrics WHERE key = 'final/val_loss'").fetchall() == [(value,)]
        steps = db.execute("SELECT step FROM metrics WHERE key = 'train/loss' ORDER BY step").fetchall()
    assert [s for (s,) in steps] == [1, 2, 3, 4, 5, 6]  # each once
    assert not [p for p in folder.iterdir() if "pending" in p.name]


@pytest.mark.usefixtures("restore_process_state")
def test_records_of_a_run_its_store_lost_are_kept_aside_and_can_be_sent_later(tmp_path, capsys):
    """An interrupted run whose MLflow run is not in the store it resumes into starts a new run;
    what waited for the old one was deleted then. It is moved to unsent_<run id>/, and
    `python -m harness.tracking URI RUN_ID FOLDER` sends it once the store that holds the run is back."""
    from mlflow import MlflowClient

    from harness.tracking import END_PENDING, PENDING_METRICS, MlflowTracker, main

    old_uri, new_uri = f"sqlite:///{tmp_path / 'old.db'}", f"sqlite:///{tmp_path / 'new.db'}"
    old = MlflowClient(old_uri)
    run_id = old.create_run(old.create_experiment("lost")).info.run_id
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / PENDING_METRICS).write_text("".join(
        f'{{"key": "train/loss", "value": {5 - s}, "timestamp": 1, "step": {s}}}\n' for s in (3, 4)))
    (folder / END_PENDING).write_text('{"status": "KILLED"}')

    tracker = MlflowTracker.start(new_uri, "lost", "again", {}, resume_run_id=run_id, pending_dir=folder)
    tracker.end("FINISHED")
    aside = folder / f"unsent_{run_id}"
    assert sorted(p.name for p in aside.iterdir()) == sorted([END_PENDING, PENDING_METRICS])
    assert not (folder / PENDING_METRICS).exists() and tracker.run_id != run_id

    assert main([new_uri, run_id, str(aside)]) == 2  # the store that never held it: one line
    said = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]  # (MLflow's INFO lines aside)
    assert len(said) == 1 and run_id in said[0] and aside.exists()
    assert main([old_uri, run_id, str(aside)]) == 0
    assert [(m.step, m.value) for m in old.get_metric_history(run_id, "train/loss")] == [(3, 2.0), (4, 1.0)]
    assert old.get_run(run_id).info.status == "KILLED" and not aside.exists()


@pytest.mark.usefixtures("restore_process_state")
def test_a_figure_that_cannot_be_drawn_is_a_warning_and_the_store_stays_online(tmp_path, caplog):
    """A plot titled with the run's name: `$$` in it is mathtext matplotlib cannot parse. The
    failed upload was taken for a store gone offline, and drawing it again for the run folder
    raised, ending a trained run FAILED. Now one warning; the next figure still reaches the store."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow import MlflowClient

    from harness.tracking import MlflowTracker

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("figures", (tmp_path / "art").as_uri())).info.run_id
    tracker = MlflowTracker(client, run_id, 5.0, resumed=False, pending_dir=tmp_path / "run")
    (tmp_path / "run").mkdir()
    bad, good = plt.subplots()[0], plt.subplots()[0]
    bad.axes[0].set_title("price $$ list")
    good.axes[0].set_title("fine")
    tracker.log_figure(bad, "plots/bad.png")
    tracker.log_figure(good, "plots/good.png")
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/good.png"]
    assert "plots/bad.png not drawn" in caplog.text and not tracker.has_pending()


@pytest.mark.parametrize("title", ["a $$ b", "cost $x^$", "$"])
def test_the_run_plots_draw_any_run_name_as_text(title, tmp_path):
    """`tracking.run_name='a $$ b'` ended a trained run with matplotlib's mathtext traceback (exit 1,
    the MLflow run FAILED): the plots' titles hold the run's name, which is text."""
    from harness import dynamics

    weights = {"step": 4, "depth_weights": [[1.0, 0.0], [0.25, 0.75]], "sublayer_kind": ["attn", "mlp"]}
    history = [{"step": s, "output_rms_block": [1.0, 2.0], "grad_norm_block": [0.5, 0.1]} for s in (2, 4)]
    for i, figure in enumerate([dynamics.depth_weights_figure(weights, title),
                                dynamics.depth_weights_figure({**weights, "depth_weights": None}, title),
                                dynamics.magnitudes_figure(history, title)]):
        figure.savefig(tmp_path / f"{i}.png")
        assert (tmp_path / f"{i}.png").stat().st_size > 0
