"""Four jobs started at the same moment on a tracking database that does not exist yet: the
store is created once (under harness.tracking_store's file lock) and all four runs complete."""
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
