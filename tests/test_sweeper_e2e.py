"""The sweeper driving a real Hydra app (tests/sweeper_apps/fake_train.py) in subprocesses.

The app is a stand-in for run.py with the harness's contract (returns the final validation loss,
reports each validation to harness.pruning, nests its MLflow run under the study's parent run) and
a loss whose best learning rate is known. Each test gets its own Optuna and MLflow SQLite files;
the MLflow database is migrated once per session and copied, as parallel jobs require anyway.
"""

import json
import math
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hydra_plugins.attnres_optuna_sweeper._storage import sqlite_init_lock

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "tests" / "sweeper_apps" / "fake_train.py"
LR = "optim.lr=tag(log,interval(1e-4,1e-1))"


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    # WAL journal (kept by the file and its copies): one disk sync per commit instead of several,
    # which is most of the time these tests spend on a slow disk.
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")
    MlflowClient(f"sqlite:///{path}").search_experiments()  # creates and migrates the schema
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # everything in the file before copying
    return path


@pytest.fixture
def mlflow_uri(tmp_path, mlflow_template):
    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _command(tmp_path, name, *overrides, mlflow_uri=None):
    args = [
        sys.executable,
        str(APP),
        "-m",
        "hydra/sweeper=attnres_optuna",
        f"hydra.sweep.dir={tmp_path / 'multirun' / name}",
        f"hydra.sweeper.storage=sqlite:///{tmp_path / 'optuna.db'}",
    ]
    if mlflow_uri:
        args += [f"tracking.uri={mlflow_uri}", "hydra.sweeper.mlflow.plots=false"]
    else:
        args += ["hydra.sweeper.mlflow.enabled=false"]
    return [*args, *overrides]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HYDRA_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MPLBACKEND"] = "Agg"
    env.update(extra)
    return env


def sweep(tmp_path, name, *overrides, mlflow_uri=None, check=True, **env):
    done = subprocess.run(
        _command(tmp_path, name, *overrides, mlflow_uri=mlflow_uri),
        cwd=tmp_path,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=180,
    )
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def study(tmp_path, name):
    """The study as the sweeper stores it. Opening the storage creates its tables when they are
    missing, so a poll while a worker creates them takes the lock the workers take (without it:
    "table trial_heartbeats already exists", met in CI)."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    with sqlite_init_lock(url):
        return optuna.load_study(study_name=name, storage=url)


def states(trials):
    return [t.state for t in trials]


def calls(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_two_variants_are_two_studies_with_their_own_trials(tmp_path, mlflow_uri):
    sweep(
        tmp_path,
        "grid",
        "residual=block,full",
        LR,
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.mlflow.plots=true",
        "hydra.sweeper.pruner.name=none",  # a 4-trial study prunes after 2; here every trial runs
        mlflow_uri=mlflow_uri,
    )

    names = sorted(optuna.get_all_study_names(f"sqlite:///{tmp_path / 'optuna.db'}"))
    assert names == ["test/residual=block", "test/residual=full"]
    for name in names:
        trials = study(tmp_path, name).trials
        assert states(trials) == [TrialState.COMPLETE] * 4
        # the variant is the study, not a searched parameter
        assert all(set(t.params) == {"optim.lr"} for t in trials)
        assert all(
            f"residual={name.split('=')[1]}" in t.user_attrs["attnres.overrides"] for t in trials
        )

    from mlflow import MlflowClient

    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("test")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    parents = client.search_runs([experiment.experiment_id], "tags.`attnres.role` = 'study'")
    assert sorted(r.info.run_name for r in parents) == names
    for parent in parents:
        assert parent.info.status == "FINISHED"
        assert parent.data.params["residual"] in ("block", "full")
        assert "best/value" in parent.data.metrics and "best/optim.lr" in parent.data.metrics
        assert set(json.loads(parent.data.tags["best.params"])) == {"optim.lr"}
        children = client.search_runs(
            [experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
        )
        assert len(children) == 4
        assert {c.data.tags["attnres.role"] for c in children} == {"trial"}
        plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
        assert {
            "plots/optimization_history.png",
            "plots/param_importances.png",
            "plots/slice.png",
        } <= plots

    summary = json.loads((tmp_path / "multirun" / "grid" / "optuna_summary.json").read_text())
    assert [(c["study"], c["complete"], c["pruned"], c["failed"]) for c in summary["cells"]] == [
        (name, 4, 0, 0) for name in names
    ]
    assert (tmp_path / "multirun" / "grid" / "optuna_summary.md").read_text().count("| test/") == 2


@pytest.mark.slow
def test_tpe_finds_a_known_optimum_within_a_factor_two(tmp_path):
    # residual=baseline's fake loss is lowest at lr = 3e-3; the search spans five decades.
    sweep(
        tmp_path,
        "tpe",
        "optim.lr=tag(log,interval(1e-5,1))",
        "hydra.sweeper.n_trials=20",
        "hydra.sweeper.sampler.seed=0",
        "hydra.sweeper.pruner.name=none",
    )
    best = study(tmp_path, "test").best_params["optim.lr"]
    assert abs(math.log(best / 3e-3)) <= math.log(2), best


def test_bad_region_is_pruned_and_a_nan_trial_fails_without_stopping(tmp_path, mlflow_uri):
    # Above lr=0.03 the loss grows with every validation; above 0.3 it is NaN. Two good points
    # first give the median pruner its reference; the bad and NaN points follow.
    sweep(
        tmp_path,
        "prune",
        "optim.lr=tag(log,interval(1e-4,1))",
        "hydra.sweeper.n_trials=6",
        "train.diverge_above=0.03",
        "train.nan_above=0.3",
        "hydra.sweeper.pruner.n_startup_trials=2",
        "hydra.sweeper.sampler.seed=1",
        "hydra.sweeper.enqueue=[{optim:{lr:0.003}},{optim:{lr:0.001}},{optim:{lr:0.1}},{optim:{lr:0.5}}]",
        mlflow_uri=mlflow_uri,
    )
    trials = study(tmp_path, "test").trials
    assert len(trials) == 6  # the NaN trial did not stop the sweep
    assert trials[2].state == TrialState.PRUNED and trials[2].last_step == 1
    assert trials[3].state == TrialState.FAIL
    assert trials[3].user_attrs["attnres.failure"].startswith("FloatingPointError")

    from mlflow import MlflowClient

    client = MlflowClient(mlflow_uri)
    pruned = client.get_run(trials[2].user_attrs["mlflow.run_id"])
    assert pruned.info.status == "KILLED"
    assert pruned.data.tags["attnres.status"] == "PRUNED" and pruned.data.tags["pruned"] == "true"
    assert pruned.data.tags["attnres.role"] == "trial"
    assert pruned.data.tags["optuna.state"] == "PRUNED"
    failed = client.get_run(trials[3].user_attrs["mlflow.run_id"])
    assert failed.info.status == "FAILED" and failed.data.tags["attnres.status"] == "FAILED"


def test_too_many_failures_stop_the_sweep_with_one_line(tmp_path):
    done = sweep(
        tmp_path,
        "nan",
        LR,
        "train.nan_above=0",
        "hydra.sweeper.n_trials=8",
        "hydra.sweeper.max_failure_rate=0.25",
        check=False,
    )
    assert done.returncode != 0
    assert (
        "study test: 3 of its 8 trials failed, more than hydra.sweeper.max_failure_rate=0.25 allows (2)"
        in done.stderr
    )
    assert "Traceback" not in done.stderr.split("trials failed")[-1]
    assert states(study(tmp_path, "test").trials) == [TrialState.FAIL] * 3


def test_a_config_another_process_is_training_voids_the_trial_not_fails_it(tmp_path):
    """Two workers that draw the same point: the second one's job is refused (RunBusy, a
    TrialNotRun). That is no fault of the config: the trial is void, does not count against
    max_failure_rate (0 here) and another trial takes its place."""
    done = sweep(tmp_path, "busy", LR, "hydra.sweeper.n_trials=3", "hydra.sweeper.max_failure_rate=0",
                 "hydra.sweeper.pruner.name=none", SWEEP_TEST_BUSY_AT="2")  # no trial pruned: each one's state is known
    assert done.returncode == 0, done.stderr[-2000:]
    trials = study(tmp_path, "test").trials
    assert states(trials) == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert "attnres.failure" not in trials[1].user_attrs
    assert trials[1].user_attrs["attnres.void"].startswith("not run: another process")


def test_a_full_study_over_its_failure_budget_does_not_block_the_next_cells(tmp_path):
    """The first run stops at cell baseline (2 of 2 trials failed, budget 1). Running the same
    command again must go on with the next cell: the full study has nothing left to run (before,
    it stopped at that cell again on every rerun, and block was never reached)."""
    args = ("residual=baseline,block", LR, "train.nan_above=0", "hydra.sweeper.n_trials=2",
            "hydra.sweeper.max_failure_rate=0.5")
    first = sweep(tmp_path, "first", *args, check=False)
    assert first.returncode != 0 and "study test/residual=baseline: 2 of its 2 trials failed" in first.stderr
    second = sweep(tmp_path, "second", *args, check=False)
    assert second.returncode != 0 and "study test/residual=block: 2 of its 2 trials failed" in second.stderr
    assert states(study(tmp_path, "test/residual=baseline").trials) == [TrialState.FAIL] * 2
    assert states(study(tmp_path, "test/residual=block").trials) == [TrialState.FAIL] * 2


@pytest.mark.slow
def test_two_workers_share_one_study_without_overshooting(tmp_path, mlflow_uri):
    log = tmp_path / "calls.jsonl"
    # Output to files, not pipes: a full pipe would stall one worker while we wait on the other.
    outputs = [tmp_path / f"worker{i}.log" for i in (1, 2)]
    workers = []
    for i, output in zip((1, 2), outputs, strict=True):
        with open(output, "w") as out:
            workers.append(
                subprocess.Popen(
                    _command(
                        tmp_path,
                        f"worker{i}",
                        LR,
                        "hydra.sweeper.n_trials=6",
                        "train.sleep=0.1",
                        f"hydra.sweeper.sampler.seed={i}",
                        mlflow_uri=mlflow_uri,
                    ),
                    cwd=tmp_path,
                    env=_env(
                        SWEEP_TEST_CALLS=str(log),
                        SWEEP_TEST_BARRIER=f"{tmp_path / 'started'}:2",
                    ),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    for worker in workers:
        worker.wait(timeout=180)
    assert [w.returncode for w in workers] == [0, 0], "\n".join(
        o.read_text()[-3000:] for o in outputs
    )

    trials = study(tmp_path, "test").trials
    counted = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(counted) == 6
    assert len({t.number for t in trials}) == len(trials)
    jobs = calls(log)
    assert len(jobs) == 6  # no job ran twice, none beyond n_trials
    assert len({j["pid"] for j in jobs}) == 2  # both workers did work (the barrier ensures it)

    from mlflow import MlflowClient

    client = MlflowClient(mlflow_uri)
    parents = client.search_runs(
        [client.get_experiment_by_name("test").experiment_id], "tags.`attnres.role` = 'study'"
    )
    assert len(parents) == 1  # one parent run for the study, shared by both workers
    assert len({t.user_attrs["mlflow.run_id"] for t in counted}) == 6


def test_rerun_after_interrupt_finishes_the_remaining_trials_only(tmp_path):
    log = tmp_path / "calls.jsonl"
    first = sweep(
        tmp_path,
        "first",
        LR,
        "hydra.sweeper.n_trials=6",
        check=False,
        SWEEP_TEST_CALLS=str(log),
        SWEEP_TEST_INTERRUPT_AT="3",
    )
    assert first.returncode != 0
    assert "sweep interrupted (Ctrl-C): run the same command again" in first.stderr
    trials = study(tmp_path, "test").trials
    assert states(trials) == [TrialState.COMPLETE] * 2 + [TrialState.FAIL]
    assert trials[2].user_attrs["attnres.void"] == "interrupted"
    assert (tmp_path / "multirun" / "first" / "optuna_summary.json").exists()

    sweep(tmp_path, "second", LR, "hydra.sweeper.n_trials=6", SWEEP_TEST_CALLS=str(log))
    assert len(calls(log)) == 3 + 4  # the rerun ran the 4 missing trials, nothing more
    trials = study(tmp_path, "test").trials
    assert len([t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]) == 6
    assert len(trials) == 7


def test_an_interrupt_wrapped_in_a_libraries_error_is_still_an_interrupt(tmp_path):
    """A Ctrl-C caught mid-write by a library (SQLAlchemy: "database is locked", the interrupt as
    its context) voids the trial and stops the sweep in one line, as a plain Ctrl-C does; the
    trial is not counted failed and no traceback is printed."""
    first = sweep(tmp_path, "first", LR, "hydra.sweeper.n_trials=3", check=False,
                  SWEEP_TEST_INTERRUPT_AT="2", SWEEP_TEST_INTERRUPT_WRAPPED="1")
    assert first.returncode != 0, first.stderr[-3000:]  # (run.py makes it 130; this bare app, Hydra's 1)
    assert "sweep interrupted (Ctrl-C): run the same command again" in first.stderr
    assert "Traceback" not in first.stderr and "database is locked" not in first.stderr, first.stderr[-3000:]
    trials = study(tmp_path, "test").trials
    assert states(trials) == [TrialState.COMPLETE, TrialState.FAIL]
    assert trials[1].user_attrs["attnres.void"] == "interrupted"


def test_a_study_continues_only_with_the_overrides_it_started_with(tmp_path):
    """Trials of one study must be comparable: continuing it with another fixed override that
    changes what a trial computes is refused in one line before any trial; one that does not
    (a harness key outside a run's identity, here train.progress) continues it."""
    log = tmp_path / "calls.jsonl"
    sweep(tmp_path, "first", LR, "model.layers=4", "hydra.sweeper.n_trials=2", SWEEP_TEST_CALLS=str(log))
    other = sweep(tmp_path, "other", LR, "model.layers=8", "hydra.sweeper.n_trials=3", check=False, SWEEP_TEST_CALLS=str(log))
    assert other.returncode != 0
    lines = [line for line in other.stderr.splitlines() if "attnres_optuna sweeper:" in line]
    assert len(lines) == 1 and "study test was started with the overrides ['model.layers=4']" in lines[0], other.stderr
    assert "this command gives ['model.layers=8']" in lines[0]
    assert "Traceback" not in other.stderr
    assert len(calls(log)) == 2  # nothing ran
    assert not (tmp_path / "multirun" / "other").exists()  # nor was a sweep folder or summary written
    sweep(tmp_path, "same", LR, "model.layers=4", "+train.progress=false", "hydra.sweeper.n_trials=3", SWEEP_TEST_CALLS=str(log))
    assert len(calls(log)) == 3
    assert len(study(tmp_path, "test").trials) == 3


@pytest.mark.slow  # in CI's second step (.ci/run): keeps the default run under 10 minutes
def test_a_dead_workers_trial_is_run_again(tmp_path, mlflow_uri):
    """kill -9 of a worker mid-trial: the next worker fails the trial as stale (void) and runs its
    slot again, and ends the dead trial's MLflow run KILLED (it stayed RUNNING before)."""
    log = tmp_path / "calls.jsonl"
    beat = ["hydra.sweeper.heartbeat_interval=1", "hydra.sweeper.grace_period=2"]
    worker = subprocess.Popen(
        _command(tmp_path, "killed", LR, "hydra.sweeper.n_trials=3", *beat, mlflow_uri=mlflow_uri),
        cwd=tmp_path,
        env=_env(SWEEP_TEST_CALLS=str(log), SWEEP_TEST_SLEEP_IN_RUN="60"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def started():  # the first trial's job has its MLflow run
        try:
            trials = study(tmp_path, "test").trials
        except KeyError:  # no study yet
            return False
        return bool(trials) and "mlflow.run_id" in trials[0].user_attrs

    try:
        deadline = time.monotonic() + 60
        while not started() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert started(), "the first trial never started its MLflow run"
    finally:
        worker.kill()  # no cleanup at all: the trial stays RUNNING in the storage
        worker.wait()
    assert states(study(tmp_path, "test").trials) == [TrialState.RUNNING]

    time.sleep(2.5)  # past the grace period: the next worker takes the trial as dead
    sweep(tmp_path, "rerun", LR, "hydra.sweeper.n_trials=3", "hydra.sweeper.pruner.name=none", *beat,
          mlflow_uri=mlflow_uri)  # no pruning: the 3 trials after the dead one all complete
    trials = study(tmp_path, "test").trials
    assert states(trials) == [TrialState.FAIL] + [TrialState.COMPLETE] * 3
    from mlflow import MlflowClient

    dead = MlflowClient(mlflow_uri).get_run(trials[0].user_attrs["mlflow.run_id"])
    assert dead.info.status == "KILLED" and dead.data.tags["optuna.state"] == "FAIL"


def test_lr_sweep_config_composes_and_runs(tmp_path):
    # sweeps/lr.yaml as a config group option; the command line narrows its 13-variant grid.
    sweep(
        tmp_path,
        "lr",
        f"hydra.searchpath=[file://{ROOT}]",
        "+sweeps=lr",
        "residual=block,full",
        "hydra.sweeper.n_trials=2",
    )
    names = sorted(optuna.get_all_study_names(f"sqlite:///{tmp_path / 'optuna.db'}"))
    assert names == ["lr/residual=block", "lr/residual=full"]
    trial = study(tmp_path, "lr/residual=block").trials[0]
    assert "model.layers=16" in trial.user_attrs["attnres.overrides"]
    # the same seed in every study: each variant starts from the same learning rates
    assert trial.params == study(tmp_path, "lr/residual=full").trials[0].params


def test_bad_sweeper_option_is_one_error_line(tmp_path):
    done = sweep(tmp_path, "bad", LR, "hydra.sweeper.sampler.name=bogus", check=False)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[0] == (
        "attnres_optuna sweeper: hydra.sweeper.sampler.name='bogus' is not one of "
        "tpe, gp, cmaes, random, grid"
    )
    assert "Traceback" not in done.stderr


def test_a_job_config_that_does_not_compose_is_refused_before_any_trial(tmp_path):
    done = sweep(tmp_path, "bad", "optim.lrr=tag(log,interval(1e-4,1e-1))", check=False)
    assert done.returncode != 0
    assert "the jobs of study test do not compose: Could not override 'optim.lrr'" in done.stderr
    assert not (tmp_path / "optuna.db").exists()
