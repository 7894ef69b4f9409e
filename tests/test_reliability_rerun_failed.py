"""Rerunning a sweep redoes only what was interrupted. A failed job (real divergence: lr=1e30, no
clipping) is reported failed again without training, one line naming the reason and the way to
retry; the finished job returns its recorded result; only `train.retry_failed=true` trains the
failed one again, from its last good checkpoint, into the same MLflow run, under the same parent."""
import time

import pytest

from harness_testing import TINY, compose, metric_steps, run_cli, runs

FAST = ["optim.grad_clip=0", "train.checkpoint_interval=1", "tracking.log_code=false", "tracking.log_env=false",
        "tracking.log_model=false", "tracking.log_plots=false"]
SWEEP = ["-m", "optim.lr=1e30,0.003", *TINY, *FAST]


def _jobs(tmp):
    return {r.data.params["optim.lr"]: r for r in runs(tmp) if r.data.tags.get("attnres.role") == "job"}


def _records(tmp):
    return {p: p.read_bytes() for p in (tmp / "ckpt").rglob("run.json")}


def test_retry_failed_is_not_part_of_the_run_identity():
    from harness.checkpoint import run_folder
    from harness.config import to_objects, to_plain

    folders = [run_folder(to_plain(to_objects(compose(["model=tiny", f"train.retry_failed={v}"]))))
               for v in ("false", "true")]
    assert folders[0] == folders[1]


def test_a_single_failed_run_rerun_exits_1_with_one_line(tmp_path, capsys):
    import pytest

    from harness.checkpoint import RunFolder
    from harness.job import PreviouslyFailed, _skip_failed

    folder = RunFolder(tmp_path / "baseline-tiny-s0-0123456789ab")
    folder.path.mkdir()
    record = folder.write_record(status="failed", failure="NonFiniteLoss: non-finite loss nan\nat step 4")
    with pytest.raises(SystemExit) as stop:  # a single run: exit 1, no traceback
        _skip_failed(folder, record, multirun=False)
    assert stop.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == ("baseline-tiny-s0-0123456789ab: failed before (NonFiniteLoss: non-finite loss nan at step 4); "
                    "not trained again: add train.retry_failed=true to resume it from its last good checkpoint")
    with pytest.raises(PreviouslyFailed, match="failed before"):  # a multirun: a failed job
        _skip_failed(folder, record, multirun=True)


@pytest.mark.slow  # ~20 s, three multirun subprocesses; the skip decision is tested fast in this file
def test_a_failed_job_is_skipped_on_rerun_and_retrained_only_when_asked(tmp_path):
    started = time.monotonic()
    first = run_cli(SWEEP, tmp_path)
    first_s = time.monotonic() - started
    assert first.returncode == 1 and "non-finite" in first.stderr, first.stderr[-3000:]
    jobs = _jobs(tmp_path)
    diverged, healthy = jobs["1e+30"], jobs["0.003"]
    assert (diverged.info.status, healthy.info.status) == ("FAILED", "FINISHED")
    losses = {lr: metric_steps(tmp_path, r.info.run_id, "train/loss") for lr, r in jobs.items()}
    records = _records(tmp_path)
    assert len(records) == 2

    started = time.monotonic()
    again = run_cli(SWEEP, tmp_path)  # the same multirun again
    again_s = time.monotonic() - started
    assert again.returncode == 1, again.stderr[-3000:]  # the failure is still the multirun's outcome
    (line,) = [l for l in again.stderr.splitlines() if l.startswith("baseline-tiny-s0-") and "failed before" in l]
    assert "NonFiniteLoss" in line and "non-finite" in line and "train.retry_failed=true" in line
    assert "already finished" in again.stderr
    assert _records(tmp_path) == records  # neither job trained nor wrote anything
    assert {lr: r.info.status for lr, r in _jobs(tmp_path).items()} == {"1e+30": "FAILED", "0.003": "FINISHED"}
    assert {lr: metric_steps(tmp_path, r.info.run_id, "train/loss") for lr, r in _jobs(tmp_path).items()} == losses
    assert "attnres.resumed_at_step" not in _jobs(tmp_path)["1e+30"].data.tags
    print(f"first multirun {first_s:.1f} s, rerun {again_s:.1f} s")

    retry = run_cli([*SWEEP, "train.retry_failed=true"], tmp_path)
    assert retry.returncode == 1 and "non-finite" in retry.stderr, retry.stderr[-3000:]  # same lr: diverges again
    assert "already finished" in retry.stderr  # the finished job is not retrained
    jobs = _jobs(tmp_path)
    assert set(jobs) == {"1e+30", "0.003"}  # the same two MLflow runs: the failed one was reopened
    diverged = jobs["1e+30"]
    resumed_at = int(diverged.data.tags["attnres.resumed_at_step"])  # trained again, from a checkpoint
    assert 0 < resumed_at < int(diverged.data.tags["attnres.failure_step"])
    assert diverged.info.status == "FAILED" and "non-finite" in diverged.data.tags["attnres.failure"]
    changed = [p for p, blob in _records(tmp_path).items() if records[p] != blob]
    assert len(changed) == 1 and "failed" in changed[0].read_text()
    parents = [r for r in runs(tmp_path) if r.data.tags.get("attnres.role") == "parent"]
    assert len(parents) == 1  # every rerun, retry included, stayed under the multirun's parent


def test_under_torchrun_only_rank_0_reports_a_failed_run(tmp_path, capsys):
    """Ranks other than 0 hold a read-only run folder: they stop as rank 0 does, silently."""
    import pytest

    from harness.checkpoint import RunFolder
    from harness.job import _skip_failed

    folder = RunFolder(tmp_path / "baseline-tiny-s0-0123456789ab")
    folder.path.mkdir()
    record = folder.write_record(status="failed", failure="NonFiniteLoss: non-finite loss nan at step 4")
    with pytest.raises(SystemExit) as stop:
        _skip_failed(RunFolder(folder.path, read_only=True), record, multirun=False)
    assert stop.value.code == 1 and capsys.readouterr().err == ""


def test_the_stop_signal_is_named_in_what_the_job_reports():
    """SIGTERM, or submitit's requeue signal routed to the same handler, is recorded by name."""
    import signal

    import pytest

    from harness.stopping import StopSignals, stop_on_signals

    class Trainer:
        stop_reason = None

        def request_stop(self, reason):
            self.stop_reason = reason

    trainer = Trainer()
    with stop_on_signals(StopSignals()) as stops:
        # Before the trainer exists (checkpoint loading, the MLflow run opening) a stop waits for it.
        signal.raise_signal(signal.SIGTERM)
        assert stops.received == "SIGTERM" and trainer.stop_reason is None
        stops.attach(trainer)
        assert trainer.stop_reason == "SIGTERM"
        handler = signal.getsignal(signal.SIGTERM)
        handler(signal.SIGUSR2, None)  # what _job_side.checkpoint_before_requeue hands on
        assert trainer.stop_reason == "SIGUSR2"
        signal.raise_signal(signal.SIGTERM)
        assert trainer.stop_reason == "SIGTERM"
        signal.raise_signal(signal.SIGINT)  # a first Ctrl-C: a stop request too
        assert trainer.stop_reason == "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # a second one: at once
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is not handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_before_the_job_holds_its_run_exits_75_at_once(capsys):
    """Validation, data loading, taking the run folder: nothing to checkpoint, so SIGTERM ends the
    job with the requeue code (the default action's 143 is no "requeue me"); a handler already set
    (the Optuna sweeper's) is left in charge."""
    import signal

    import pytest

    from harness.stopping import REQUEUE_EXIT, requeue_on_sigterm

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as stop, requeue_on_sigterm():
            signal.raise_signal(signal.SIGTERM)
        assert stop.value.code == REQUEUE_EXIT
        assert capsys.readouterr().err == f"stopped before training (SIGTERM); exit {REQUEUE_EXIT} = requeue me\n"
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

        def sweeper(signum, frame):
            raise KeyboardInterrupt("SIGTERM")

        signal.signal(signal.SIGTERM, sweeper)
        with pytest.raises(KeyboardInterrupt), requeue_on_sigterm():
            signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
