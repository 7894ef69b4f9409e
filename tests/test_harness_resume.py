"""Resume: a run killed (like kill -9) after a checkpoint, rerun with the same command, ends exactly
where an uninterrupted run ends, in one MLflow run with every metric step once."""
import json

import pytest

from harness_testing import TINY, client, compose, isolated, kill_at_step, metric_steps, process_state_kept, run_cli, runs

# 8 steps, checkpoints every 3: the kill after step 5 loses steps 4-5 (logged or not) and the
# resumed run recomputes them from the step-3 checkpoint.
ARGS = [*TINY, "train.steps=8", "train.checkpoint_interval=3", "train.eval_interval=2", "residual=block"]


def _in_process(args, tmp) -> float:
    """run.py's job in this process (seconds less than a subprocess): for runs nobody kills."""
    from harness import job

    with process_state_kept():
        return job.run(compose([*args, *(o for o in isolated(tmp) if not o.startswith("hydra."))]))


def _final(result) -> float:
    line = [l for l in result.stderr.splitlines() if "val loss" in l][-1]
    return float(line.split("val loss ")[1].split()[0].rstrip(",)"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    _in_process(ARGS, tmp)
    (run,) = runs(tmp)
    return tmp, run


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resumed")
    # Flushing every metric at once puts steps 4-5 in MLflow before the kill: the resumed run
    # recomputes them from the step-3 checkpoint and must not log them twice.
    killed = run_cli([*ARGS, "tracking.flush_seconds=0", *kill_at_step(5)], tmp)
    assert killed.returncode == 137, killed.stderr[-3000:]
    (run,) = runs(tmp)
    assert run.info.status == "RUNNING"  # killed: nobody ended it
    assert metric_steps(tmp, run.info.run_id, "train/loss") == [1, 2, 3, 4, 5]
    record = json.loads(next((tmp / "ckpt").rglob("run.json")).read_text())
    assert record["status"] == "running" and record["mlflow_run_id"] == run.info.run_id
    return tmp, _in_process(ARGS, tmp)  # resumed; its final validation loss


def test_resumed_run_ends_exactly_like_the_uninterrupted_one(uninterrupted, resumed):
    (tmp_u, run_u), (tmp_r, _) = uninterrupted, resumed
    (run_r,) = runs(tmp_r)  # one MLflow run, continued
    assert run_r.info.status == "FINISHED" and run_r.data.tags["attnres.resumed_at_step"] == "3"
    assert run_r.data.metrics["final/val_loss"] == run_u.data.metrics["final/val_loss"]  # exactly
    for key in ("train/loss", "val/loss", "train/lr"):
        u = [(m.step, m.value) for m in client(tmp_u).get_metric_history(run_u.info.run_id, key)]
        r = [(m.step, m.value) for m in client(tmp_r).get_metric_history(run_r.info.run_id, key)]
        assert sorted(r) == sorted(u), key


def test_no_duplicated_or_missing_metric_steps(resumed):
    tmp, _ = resumed
    (run,) = runs(tmp)
    for key in run.data.metrics:
        steps = metric_steps(tmp, run.info.run_id, key)
        assert len(steps) == len(set(steps)), (key, steps)
    assert sorted(metric_steps(tmp, run.info.run_id, "train/loss")) == list(range(1, 9))
    assert sorted(metric_steps(tmp, run.info.run_id, "val/loss")) == [2, 4, 6, 8]
    assert sorted(metric_steps(tmp, run.info.run_id, "depth/output_rms/block_00")) == [3, 6, 8]


def test_rerunning_a_finished_run_returns_its_result_without_training(resumed):
    tmp, finished = resumed
    again = run_cli(ARGS, tmp)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished" in again.stderr
    (run,) = runs(tmp)
    assert sorted(metric_steps(tmp, run.info.run_id, "train/loss")) == list(range(1, 9))
    assert _final(again) == pytest.approx(finished, abs=1e-4)


def test_a_resume_between_two_logs_reports_the_same_training_means(tmp_path):
    """train/loss and train/grad_norm average the steps since the last log (here every 2 steps);
    resumed from the step-3 checkpoint, the mean logged at step 4 must still cover steps 3 and 4,
    exactly as without the interruption (it covered step 4 alone)."""
    args = [*ARGS, "train.log_interval=2"]
    _in_process(args, tmp_path / "u")
    killed = run_cli([*args, *kill_at_step(5)], tmp_path / "r")
    assert killed.returncode == 137, killed.stderr[-3000:]
    _in_process(args, tmp_path / "r")
    (run_u,), (run_r,) = runs(tmp_path / "u"), runs(tmp_path / "r")
    for key in ("train/loss", "train/grad_norm"):
        u = sorted((m.step, m.value) for m in client(tmp_path / "u").get_metric_history(run_u.info.run_id, key))
        r = sorted((m.step, m.value) for m in client(tmp_path / "r").get_metric_history(run_r.info.run_id, key))
        assert [s for s, _ in u] == [2, 4, 6, 8] and r == u, key


def test_data_edited_since_the_run_started_is_refused_not_resumed(tmp_path, capsys):
    """A run folder is keyed by the config, which names the data file but not its bytes: after the
    file changed, rerunning the killed run must not resume it on other data under the old
    fingerprint; one line, exit 2, the checkpoint kept. train.resume=false trains it afresh."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 800)
    args = [*ARGS, "data=text", f"data.path={corpus}"]
    killed = run_cli([*args, *kill_at_step(5)], tmp_path)
    assert killed.returncode == 137, killed.stderr[-3000:]
    corpus.write_text(corpus.read_text().upper())
    capsys.readouterr()
    with pytest.raises(SystemExit) as again:
        _in_process(args, tmp_path)
    stderr = capsys.readouterr().err
    assert again.value.code == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the data changed since this run started" in errors[0], stderr[-3000:]
    assert list((tmp_path / "ckpt").rglob("last.pt"))  # nothing lost
    _in_process([*args, "train.resume=false"], tmp_path)


def test_a_finished_run_asked_for_in_another_store_says_where_it_is(resumed, tmp_path):
    """The run folder is keyed by what a run computes, not where it logs: the same config with
    another tracking.uri returns the recorded result, and the line said only "MLflow run <id>",
    a run the user then looked for, and did not find, in the store they named."""
    import os
    import subprocess
    import sys

    from harness_testing import ROOT

    tmp, finished = resumed
    other = tmp_path / "other.db"
    args = [*ARGS, *(o for o in isolated(tmp) if not o.startswith("tracking.uri=")), f"tracking.uri=sqlite:///{other}"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    again = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    (line,) = [l for l in again.stderr.splitlines() if "already finished" in l]
    assert (f" in sqlite:///{tmp}/mlflow.db, not in tracking.uri=sqlite:///{other}); train.resume=false (or "
            "another train.checkpoint_dir) trains it again into this store") in line, line
    assert _final(again) == pytest.approx(finished, abs=1e-4)
