"""Four jobs started at the same moment on a tracking database that does not exist yet: the
store is created once (under harness.tracking's file lock) and all four runs complete."""
import os
import subprocess
import sys

import pytest

from harness_testing import ROOT, TINY, isolated, metric_steps, runs

FAST = ["train.steps=4", "tracking.log_code=false", "tracking.log_env=false", "tracking.log_model=false",
        "tracking.log_plots=false"]


@pytest.mark.slow  # ~15 s, four training subprocesses at once
def test_four_parallel_jobs_on_a_fresh_sqlite_store_all_finish(tmp_path):
    assert not (tmp_path / "mlflow.db").exists()
    env = dict(os.environ, MPLBACKEND="Agg", HYDRA_FULL_ERROR="0")
    env.pop("MLFLOW_TRACKING_URI", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "run.py"), *TINY, *FAST, f"train.seed={seed}",
             *isolated(tmp_path), f"hydra.run.dir={tmp_path / f'out{seed}'}"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for seed in range(4)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], "\n".join(e[-1500:] for e in errors)
    done = runs(tmp_path)
    assert sorted(r.data.tags["attnres.seed"] for r in done) == ["0", "1", "2", "3"]
    for run in done:
        assert run.info.status == "FINISHED" and "final/val_loss" in run.data.metrics
        assert metric_steps(tmp_path, run.info.run_id, "train/loss") == [1, 2, 3, 4]


@pytest.mark.slow  # ~20 s, two multiruns of two jobs at once
def test_the_same_multirun_started_twice_at_once_waits_and_both_exit_0(tmp_path):
    """The second process finds each job held by the first: it waits (one line per job) and then
    answers from the finished run, so both exit 0 and each job is trained once."""
    env = dict(os.environ, MPLBACKEND="Agg", HYDRA_FULL_ERROR="0")
    env.pop("MLFLOW_TRACKING_URI", None)
    keep = [o for o in isolated(tmp_path) if not o.startswith("hydra.sweep.dir")]
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "run.py"), "-m", "train.seed=0,1", *TINY, *FAST, *keep,
             f"hydra.sweep.dir={tmp_path / f'multirun{i}'}"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-1500:] for e in errors)
    jobs = [r for r in runs(tmp_path) if r.data.tags.get("attnres.role") == "job"]
    assert sorted(r.data.tags["attnres.seed"] for r in jobs) == ["0", "1"]  # each trained once
    assert all(r.info.status == "FINISHED" for r in jobs)
    assert "Traceback" not in "".join(errors) and "RunBusy" not in "".join(errors)
