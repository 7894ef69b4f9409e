"""Preemption: SIGTERM during training checkpoints, ends the MLflow run KILLED and exits with
REQUEUE_EXIT (75); the requeued command resumes into the same MLflow run, every metric step once."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.job import INTERRUPT_EXIT, REQUEUE_EXIT
from harness_testing import ROOT, TINY, isolated, metric_steps, run_cli, runs

STEPS = 60
# Long enough to be caught mid-run (a flush per step slows each step to a few ms of SQLite work).
ARGS = [*TINY, f"train.steps={STEPS}", "train.checkpoint_interval=5", "train.eval_interval=20",
        "train.instrument_interval=30", "tracking.flush_seconds=0", "tracking.log_code=false",
        "tracking.log_env=false", "tracking.log_model=false", "tracking.log_plots=false"]


def _signal_after_first_checkpoint(proc, tmp, signum) -> str:
    """Send `signum` once the first checkpoint exists (training is on); the process's stderr."""
    deadline = time.monotonic() + 60
    while not list((tmp / "ckpt").rglob("last.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signum)
    return proc.communicate(timeout=60)[1]


def _start(tmp, args=ARGS):
    env = dict(os.environ, MPLBACKEND="Agg", HYDRA_FULL_ERROR="0")
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args, *isolated(tmp)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_checkpoints_ends_killed_asks_for_requeue_and_resumes_into_the_same_run(tmp_path):
    proc = _start(tmp_path)
    stderr = _signal_after_first_checkpoint(proc, tmp_path, signal.SIGTERM)
    assert proc.returncode == REQUEUE_EXIT == 75, stderr[-3000:]
    assert "requeue" in stderr

    (run,) = runs(tmp_path)
    assert run.info.status == "KILLED" and run.data.tags["attnres.status"] == "KILLED"
    assert "StopRequested" in run.data.tags["attnres.failure"]
    folder = next((tmp_path / "ckpt").rglob("run.json")).parent
    record = json.loads((folder / "run.json").read_text())
    assert record["status"] == "interrupted" and record["mlflow_run_id"] == run.info.run_id
    import torch

    stopped = torch.load(folder / "last.pt", weights_only=True)["step"]
    assert 5 <= stopped < STEPS  # checkpointed at the step it stopped, not only at an interval
    assert metric_steps(tmp_path, run.info.run_id, "train/loss") == list(range(1, stopped + 1))

    again = run_cli(ARGS, tmp_path)  # the requeued job: the same command
    assert again.returncode == 0, again.stderr[-3000:]
    (run,) = runs(tmp_path)  # still one run: the same one, continued
    assert run.info.status == "FINISHED" and run.data.tags["attnres.status"] == "FINISHED"
    assert run.data.tags["attnres.resumed_at_step"] == str(stopped)
    # The interruption no longer describes the run: no failure tag, none in its record.
    assert "attnres.failure" not in run.data.tags
    record = json.loads((folder / "run.json").read_text())
    assert record["status"] == "finished" and record["failure"] is None
    for key in ("train/loss", "train/lr", "val/loss"):
        steps = metric_steps(tmp_path, run.info.run_id, key)
        assert len(steps) == len(set(steps)), key
    assert sorted(metric_steps(tmp_path, run.info.run_id, "train/loss")) == list(range(1, STEPS + 1))
    assert sorted(metric_steps(tmp_path, run.info.run_id, "val/loss")) == [20, 40, 60]


def test_ctrl_c_checkpoints_ends_killed_in_one_line_and_the_same_command_resumes(tmp_path):
    """A first Ctrl-C is a stop request like SIGTERM (the step finishes, a checkpoint is written,
    nothing is cut mid-write), then one line and exit 130 (INTERRUPT_EXIT), no traceback."""
    proc = _start(tmp_path)
    stderr = _signal_after_first_checkpoint(proc, tmp_path, signal.SIGINT)
    assert proc.returncode == INTERRUPT_EXIT == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert ": interrupted (Ctrl-C): stopped at step " in last and last.endswith("; rerun to resume"), last
    (run,) = runs(tmp_path)
    assert run.info.status == "KILLED" and "interrupted (StopRequested" in run.data.tags["attnres.failure"]
    import torch

    folder = next((tmp_path / "ckpt").rglob("run.json")).parent
    stopped = torch.load(folder / "last.pt", weights_only=True)["step"]
    assert f"stopped at step {stopped} of {STEPS}" in last  # checkpointed where it stopped
    assert metric_steps(tmp_path, run.info.run_id, "train/loss") == list(range(1, stopped + 1))

    again = run_cli(ARGS, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    (run,) = runs(tmp_path)
    assert run.info.status == "FINISHED" and "attnres.failure" not in run.data.tags
    assert sorted(metric_steps(tmp_path, run.info.run_id, "train/loss")) == list(range(1, STEPS + 1))


@pytest.mark.slow  # in CI's second step (.ci/run): keeps the default run under 10 minutes
def test_a_stopped_multirun_ends_its_parent_killed_and_the_rerun_finishes_it(tmp_path):
    """SIGTERM in a basic multirun: the job checkpoints and is KILLED, the multirun exits 75, its
    parent run is KILLED too (not FAILED: nothing failed); the same command finishes both jobs
    under the same parent."""
    argv = ["-m", *ARGS, "residual=baseline,block"]
    proc = _start(tmp_path, argv)
    stderr = _signal_after_first_checkpoint(proc, tmp_path, signal.SIGTERM)
    assert proc.returncode == REQUEUE_EXIT, stderr[-3000:]
    (parent,) = [r for r in runs(tmp_path) if r.data.tags.get("attnres.role") == "parent"]
    assert parent.info.status == "KILLED" and parent.data.tags["attnres.status"] == "KILLED"

    again = run_cli(argv, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    everything = runs(tmp_path)
    (parent_again,) = [r for r in everything if r.data.tags.get("attnres.role") == "parent"]
    assert parent_again.info.run_id == parent.info.run_id and parent_again.info.status == "FINISHED"
    jobs = [r for r in everything if r.data.tags.get("attnres.role") == "job"]
    assert len(jobs) == 2 and all(r.info.status == "FINISHED" for r in jobs)


@pytest.mark.parametrize("signum, code, said", [
    pytest.param(signal.SIGINT, INTERRUPT_EXIT, "Ctrl-C", marks=pytest.mark.slow),  # the same path as SIGTERM's
    (signal.SIGTERM, REQUEUE_EXIT, "SIGTERM")])
def test_a_stopped_optuna_sweep_is_one_line_and_the_runs_exit_code(tmp_path, signum, code, said):
    """run.py's Optuna sweep stopped by Ctrl-C (exit 130) or SIGTERM (75, "requeue me"), as a
    stopped training run: the sweeper's line alone (no Hydra hint about HYDRA_FULL_ERROR after it,
    no traceback). In the trial, as in a plain run, the signal is a stop request: the step ends
    and is checkpointed, so the interrupt never lands inside an MLflow write (it once did:
    "database is locked"); the trial is void, its MLflow run KILLED."""
    argv = ["-m", "hydra/sweeper=attnres_optuna", *ARGS, "optim.lr=interval(1e-3,1e-2)", "hydra.sweeper.n_trials=2",
            f"hydra.sweeper.storage=sqlite:///{tmp_path / 'optuna.db'}", "hydra.sweeper.mlflow.plots=false"]
    proc = _start(tmp_path, argv)
    stderr = _signal_after_first_checkpoint(proc, tmp_path, signum)
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr and "HYDRA_FULL_ERROR" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"attnres_optuna sweeper: sweep interrupted ({said}): run the same command again"), last
    (trial,) = [r for r in runs(tmp_path) if r.data.tags.get("attnres.role") == "trial"]
    failure = trial.data.tags["attnres.failure"]
    assert trial.info.status == "KILLED" and failure.startswith("interrupted (StopRequested: stopped at step "), failure
    # the sweeper voids the trial and samples its slot again: the run is not resumed, so not "rerun to resume"
    assert failure.endswith("); the trial is void: rerunning the sweep samples its slot again"), failure
    import torch

    folder = next((tmp_path / "ckpt").rglob("run.json")).parent
    stopped = torch.load(folder / "last.pt", weights_only=True)["step"]
    assert metric_steps(tmp_path, trial.info.run_id, "train/loss") == list(range(1, stopped + 1))
    assert json.loads((folder / "run.json").read_text())["status"] == "interrupted"


def _preempted_in_process(tmp_path, monkeypatch, owner, name):
    """job.run in this process with SIGTERM raised right after `owner.name` returns; the exit code."""
    from harness import job
    from harness_testing import compose, process_state_kept

    original = getattr(owner, name)

    def then_preempted(*args, **kwargs):
        result = original(*args, **kwargs)
        signal.raise_signal(signal.SIGTERM)
        return result

    def unhandled(signum, frame):  # what the job leaves to the process (the default action killed it)
        raise AssertionError("SIGTERM reached the process's own handler")

    monkeypatch.setattr(owner, name, then_preempted)
    overrides = [*ARGS, "train.steps=6", *(o for o in isolated(tmp_path) if not o.startswith("hydra."))]
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        with process_state_kept(), pytest.raises(SystemExit) as stop:
            job.run(compose(overrides))
    finally:
        signal.signal(signal.SIGTERM, previous)
    return stop.value.code


def test_sigterm_while_the_mlflow_run_opens_stops_before_training_killed_and_resumable(tmp_path, monkeypatch, capsys):
    """A preemption between taking the run folder and training (checkpoint loading, the MLflow
    run opening) waits for the trainer, which stops before its first step: KILLED, exit 75, and
    the rerun trains into the same MLflow run. The default action killed the job with 143 and
    left its MLflow run RUNNING."""
    from harness import job

    assert _preempted_in_process(tmp_path, monkeypatch, job, "_open_tracker") == REQUEUE_EXIT
    assert "stopped at step 0 of 6 before training" in capsys.readouterr().err
    (run,) = runs(tmp_path)
    assert run.info.status == "KILLED"
    assert json.loads(next((tmp_path / "ckpt").rglob("run.json")).read_text())["status"] == "interrupted"
    assert not list((tmp_path / "ckpt").rglob("last.pt"))  # no step trained, nothing new to keep


def test_sigterm_after_training_lets_the_job_finish_then_exits_75(tmp_path, monkeypatch, capsys):
    """During the final logging there is no step to stop after: the run finishes and is recorded,
    and the process still stops (a preempted multirun must not start its next job)."""
    from harness.train import Trainer

    assert _preempted_in_process(tmp_path, monkeypatch, Trainer, "fit") == REQUEUE_EXIT
    assert f"stopped after the job (SIGTERM); exit {REQUEUE_EXIT} = requeue me" in capsys.readouterr().err
    (run,) = runs(tmp_path)
    assert run.info.status == "FINISHED"
    assert json.loads(next((tmp_path / "ckpt").rglob("run.json")).read_text())["status"] == "finished"


@pytest.mark.parametrize("mode", ["multirun", "trial"])
def test_a_stop_request_still_ends_a_multirun_when_its_job_ends_with_an_error(tmp_path, monkeypatch, capsys, mode):
    """SIGTERM during the step that also diverged (or was pruned, or during the loading of a
    checkpoint that turns out unreadable): the job ends with its own outcome, which a multirun or
    a sweep records before starting the next job. The stop request must still end the process
    (exit 75; in a trial the sweeper's interrupt), not be lost with the job's exception."""
    from harness import job
    from harness.train import NonFiniteLoss, Trainer

    def fit(self):
        signal.raise_signal(signal.SIGTERM)  # the preemption, during this step...
        raise NonFiniteLoss("non-finite training loss (nan) at step 1", 1)  # ...which diverged

    monkeypatch.setattr(Trainer, "fit", fit)
    if mode == "multirun":
        monkeypatch.setattr(job, "_hydra_mode", lambda: (True, None, []))  # the basic launcher's job
        expected = pytest.raises(SystemExit)
    else:
        monkeypatch.setattr(job, "_in_trial", lambda: True)
        expected = pytest.raises(KeyboardInterrupt)
    overrides = [*ARGS, "train.steps=6", *(o for o in isolated(tmp_path) if not o.startswith("hydra."))]
    from harness_testing import compose, process_state_kept

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with process_state_kept(), expected as stop:
            job.run(compose(overrides))
    finally:
        signal.signal(signal.SIGTERM, previous)
    if mode == "multirun":
        assert stop.value.code == REQUEUE_EXIT
        assert "stopped after the job (SIGTERM; it ended NonFiniteLoss: " in capsys.readouterr().err
    else:
        assert str(stop.value) == "SIGTERM"  # what the sweeper reads as "exit 75"
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED"  # the job's own outcome stands
    assert json.loads(next((tmp_path / "ckpt").rglob("run.json")).read_text())["status"] == "failed"
