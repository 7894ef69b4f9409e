"""The launcher presets, on a machine without SLURM or GPUs.

- `hydra/launcher=slurm` composes with the expected values, and the real launcher (submitit's
  SLURM executor) writes the sbatch script those values say; `sbatch` and `srun` are test doubles
  on PATH (the double records the script, then refuses the submission, so nothing runs).
- `hydra/launcher=local_gpus` runs jobs in parallel, each with CUDA_VISIBLE_DEVICES set to one GPU
  of a (fake) list and never two jobs on one GPU at once; a real two-job run.py multirun finishes;
  the submitit signal that precedes a requeue makes a training job checkpoint, submitit's local
  controller restarts it, and it resumes into the same MLflow run (slow).
"""
import itertools
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
from harness_testing import ROOT, TINY, isolated, metric_steps, run_cli, runs

APP = ROOT / "tests" / "launcher_apps" / "record_gpu.py"
QUIET = ["tracking.log_code=false", "tracking.log_env=false", "tracking.log_model=false", "tracking.log_plots=false"]


def _hydra_config(overrides):
    from hydra import compose, initialize_config_dir

    from harness.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def test_the_slurm_preset_composes_with_the_expected_values():
    launcher = _hydra_config(["hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                              "hydra.launcher.gpus_per_node=4", "hydra.launcher.tasks_per_node=4"]).hydra.launcher
    assert launcher._target_ == "hydra_plugins.attnres_launchers.launchers.AttnresSlurmLauncher"
    assert (launcher.partition, launcher.gpus_per_node, launcher.tasks_per_node) == ("gpu", 4, 4)
    assert (launcher.cpus_per_task, launcher.mem_gb, launcher.timeout_min) == (8, 64, 1440)
    assert (launcher.signal_delay_s, launcher.max_num_timeout) == (120, 10)
    assert launcher.additional_parameters == {"requeue": True}


def test_the_slurm_launcher_writes_an_sbatch_script_that_signals_and_requeues(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = tmp_path / "submitted.sh"
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {script}\necho "sbatch: test double, not submitted" >&2\nexit 1\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit only checks that it exists
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    result = run_cli(["-m", "train.seed=0,1", *TINY, "tracking=off", "hydra/launcher=slurm",
                      "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=30"], tmp_path,
                     env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert result.returncode != 0 and "test double" in result.stderr, result.stderr[-3000:]
    lines = set(script.read_text().splitlines())
    for flag in ("--partition=gpu", "--gpus-per-node=1", "--ntasks-per-node=1", "--cpus-per-task=8", "--mem=64GB",
                 "--time=30", "--signal=USR2@120", "--requeue", "--array=0-1%2"):
        assert f"#SBATCH {flag}" in lines, flag
    assert any(line.startswith("srun ") and "submitit.core._submit" in line for line in lines)
    assert not (tmp_path / "ckpt").exists()  # nothing ran


def _run_app(tmp_path, args, record, sleep="1.0", timeout=180):
    env = dict(os.environ, LAUNCHER_TEST_RECORD=str(record), LAUNCHER_TEST_SLEEP=sleep,
               LAUNCHER_TEST_BARRIER=str(tmp_path / "barrier"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, str(APP), "-m", *args, f"hydra.sweep.dir={tmp_path / 'multirun'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_local_gpus_runs_jobs_in_parallel_one_per_gpu_each_seeing_only_its_gpu(tmp_path):
    record = tmp_path / "jobs.jsonl"
    result = _run_app(tmp_path, ["+job=0,1,2,3", "hydra/launcher=local_gpus", "hydra.launcher.gpus=[5,7]"], record)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(j["job"] for j in jobs) == [0, 1, 2, 3]
    assert {j["cuda_visible_devices"] for j in jobs} == {"5", "7"}  # one GPU each, both GPUs used
    for gpu in ("5", "7"):
        spans = sorted((j["start"], j["end"]) for j in jobs if j["cuda_visible_devices"] == gpu)
        assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans)), (gpu, spans)
    first_two = [j for j in jobs if j["job"] in (0, 1)]
    assert all(j["peers_seen"] >= 2 for j in first_two)  # jobs 0 and 1 were alive at the same time


@pytest.mark.parametrize("gpus, says", [("[0,0]", "hydra.launcher.gpus=[0, 0]"),
                                        ("null", "hydra.launcher.gpus=null: this machine shows no GPU")])
def test_local_gpus_refuses_a_gpu_list_it_cannot_use(tmp_path, gpus, says):
    if gpus == "null":
        import torch

        if torch.cuda.device_count():
            pytest.skip("this machine has a GPU: gpus=null is valid here")
    result = _run_app(tmp_path, ["+job=0,1", "hydra/launcher=local_gpus", f"hydra.launcher.gpus={gpus}"],
                      tmp_path / "jobs.jsonl")
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert says in line and "allowed: a non-empty list of distinct GPU indices" in line
    assert not (tmp_path / "jobs.jsonl").exists()


@pytest.mark.slow  # ~15 s, two training subprocesses; the launcher's GPU assignment is tested fast below
def test_local_gpus_runs_a_two_job_training_multirun_to_completion(tmp_path):
    result = run_cli(["-m", "train.seed=0,1", *TINY, "train.steps=2", "tracking=off", "hydra/launcher=local_gpus",
                      "hydra.launcher.gpus=[0,1]"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in (tmp_path / "ckpt").rglob("run.json")]
    assert sorted(r["status"] for r in records) == ["finished", "finished"]
    assert all(math.isfinite(r["final"]["final/val_loss"]) for r in records)
    logs = list((tmp_path / "multirun" / ".submitit").rglob("*_log.err"))
    assert len(logs) == 2 and all("val loss" in log.read_text() for log in logs)  # one submitit job each


class _TwoArgumentError(RuntimeError):
    def __init__(self, message, step):
        super().__init__(message)
        self.step = step


def test_a_failed_jobs_exception_is_made_loadable_for_the_launching_process():
    from hydra.core.utils import JobReturn, JobStatus

    from hydra_plugins.attnres_launchers._job_side import loadable

    with pytest.raises(TypeError):  # why loadable exists: such an exception does not unpickle
        pickle.loads(pickle.dumps(_TwoArgumentError("loss is nan", 3)))
    bad = loadable(JobReturn(status=JobStatus.FAILED, _return_value=_TwoArgumentError("loss is nan", 3)))
    assert type(bad._return_value) is RuntimeError and str(bad._return_value) == "_TwoArgumentError: loss is nan"
    fine = ValueError("kept as it is")
    assert loadable(JobReturn(status=JobStatus.FAILED, _return_value=fine))._return_value is fine


STEPS = 60
PREEMPTIBLE = [*TINY, f"train.steps={STEPS}", "train.checkpoint_interval=5", "train.eval_interval=20",
               "train.instrument_interval=30", "tracking.flush_seconds=0", *QUIET]


def _start_two_jobs_on_local_gpus(tmp_path, args):
    env = dict(os.environ, MPLBACKEND="Agg", HYDRA_FULL_ERROR="0")
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), "-m", "train.seed=0,1", "hydra/launcher=local_gpus",
         "hydra.launcher.gpus=[0,1]", *args, *isolated(tmp_path)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_checkpoints(tmp_path, launcher, count):
    deadline = time.monotonic() + 240
    while len(list((tmp_path / "ckpt").rglob("last.pt"))) < count:  # a checkpoint: that job is training
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.05)


@pytest.mark.slow
def test_submitits_requeue_signal_checkpoints_requeues_and_resumes_into_the_same_run(tmp_path):
    import psutil

    launcher = _start_two_jobs_on_local_gpus(tmp_path, PREEMPTIBLE)
    _wait_for_checkpoints(tmp_path, launcher, 1)
    folder = next((tmp_path / "ckpt").rglob("last.pt")).parent
    (job,) = [p for p in psutil.Process(launcher.pid).children(recursive=True)
              if "submitit.core._submit" in " ".join(p.cmdline())
              and any(str(folder) in f.path for f in p.open_files())]  # the job holding that run's lock
    job.send_signal(signal.SIGUSR2)  # what SLURM sends signal_delay_s before the time limit
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, stderr[-3000:]

    jobs = {r.data.tags["attnres.seed"]: r for r in runs(tmp_path) if r.data.tags.get("attnres.role") == "job"}
    assert set(jobs) == {"0", "1"} and all(r.info.status == "FINISHED" for r in jobs.values())
    interrupted = jobs[folder.name.split("-s")[1][0]]  # <variant>-<model>-s<seed>-<hash>
    stopped = int(interrupted.data.tags["attnres.resumed_at_step"])  # the requeued job resumed...
    assert 5 <= stopped < STEPS
    for run in jobs.values():  # ...into the same MLflow run: every step once
        assert sorted(metric_steps(tmp_path, run.info.run_id, "train/loss")) == list(range(1, STEPS + 1))
    log = "".join(p.read_text() for p in (tmp_path / "multirun" / ".submitit").rglob("*_log.err"))
    assert "Caught signal SIGUSR2" in log and f"stopped at step {stopped}" in log
    (parent,) = [r for r in runs(tmp_path) if r.data.tags.get("attnres.role") == "parent"]
    assert parent.info.status == "FINISHED"


@pytest.mark.slow
def test_sigterm_to_a_local_gpus_multirun_checkpoints_and_stops_every_job_then_exits_75(tmp_path):
    import psutil

    launcher = _start_two_jobs_on_local_gpus(tmp_path, [*PREEMPTIBLE, "train.steps=1000"])
    _wait_for_checkpoints(tmp_path, launcher, 2)  # both jobs are training
    descendants = psutil.Process(launcher.pid).children(recursive=True)
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 75, stderr[-3000:]
    assert "rerun the same command to resume" in stderr
    assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # none outlives it
    records = [json.loads(p.read_text()) for p in (tmp_path / "ckpt").rglob("run.json")]
    assert sorted(r["status"] for r in records) == ["interrupted", "interrupted"]
    jobs = [r for r in runs(tmp_path) if r.data.tags.get("attnres.role") == "job"]
    assert len(jobs) == 2 and all(r.info.status == "KILLED" for r in jobs)
    for run in jobs:  # each stopped at a step of its own, after writing a checkpoint there
        assert 5 <= len(metric_steps(tmp_path, run.info.run_id, "train/loss")) < 1000
