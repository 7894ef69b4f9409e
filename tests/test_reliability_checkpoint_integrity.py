"""Checkpoints that prove what they are: a damaged or foreign last.pt never yields a FINISHED run
with a wrong result; it falls back to previous.pt or is refused in one line (exit 2), and a
refusal leaves the folder re-runnable."""
import json
import logging
import zipfile

import pytest
import torch

from harness import checkpoint, job
from harness.config import to_plain, validate
from harness_testing import TINY, client, compose, isolated, kill_at_step, metric_steps, process_state_kept, run_cli, runs

# 6 steps, checkpoints at 2 and 4: a kill after step 5 leaves last.pt (step 4) and previous.pt (step 2)
ARGS = [*TINY, "tracking.log_code=false", "tracking.log_env=false", "tracking.log_model=false",
        "tracking.log_plots=false", "tracking.log_explorer=false"]


def _overrides(tmp, *extra):
    return [*ARGS, *extra, *(o for o in isolated(tmp) if not o.startswith("hydra."))]


def _in_process(tmp, *extra) -> float:
    with process_state_kept():
        return job.run(compose(_overrides(tmp, *extra)))


def _flip_tensor_byte(path):
    """Flip one byte inside the largest tensor's stored bytes (the zip's own checks are not read by torch.load)."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26: info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28: info.header_offset + 30], "little")
    at = info.header_offset + 30 + name_len + extra_len + 3  # byte 3 of a float32: sign and exponent
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


# -- the folder alone -------------------------------------------------------------------------------
def _folder(tmp, **identity):
    return checkpoint.RunFolder(tmp / "run", identity=identity or {"run_key": "abc", "seed": 0, "variant": "block"})


def _state(step):
    return {"step": step, "model": {"w": torch.full((64,), float(step))}, "mlflow_run_id": "r1"}


def test_a_checkpoint_round_trips_with_its_digest_and_identity(tmp_path):
    folder = _folder(tmp_path).acquire(fresh=False)
    folder.save(_state(2))
    loaded = folder.load()
    assert loaded["step"] == 2 and loaded["digest"] == checkpoint.digest(loaded)
    assert loaded["identity"] == {"run_key": "abc", "seed": 0, "variant": "block", "mlflow_run_id": "r1"}
    folder.release()


def test_a_flipped_byte_in_last_falls_back_to_previous(tmp_path, caplog):
    folder = _folder(tmp_path).acquire(fresh=False)
    folder.save(_state(2))
    folder.save(_state(4))
    assert sorted(p.name for p in folder.path.glob("*.pt")) == ["last.pt", "previous.pt"]
    _flip_tensor_byte(folder.path / "last.pt")
    with caplog.at_level(logging.WARNING):
        loaded = checkpoint.RunFolder(folder.path, identity=folder.identity).load()
    assert loaded["step"] == 2 and torch.equal(loaded["model"]["w"], torch.full((64,), 2.0))
    assert "digest" in caplog.text
    folder.release()


def test_a_damaged_last_is_not_rotated_over_the_good_previous(tmp_path):
    folder = _folder(tmp_path).acquire(fresh=False)
    folder.save(_state(2))
    folder.save(_state(4))
    folder.release()
    _flip_tensor_byte(folder.path / "last.pt")
    again = _folder(tmp_path).acquire(fresh=False)
    assert again.load()["step"] == 2
    again.save(_state(4))  # the damaged last.pt is overwritten, previous.pt (step 2) kept
    assert torch.load(folder.path / "previous.pt", weights_only=True)["step"] == 2
    assert again.load()["step"] == 4
    again.release()


def test_no_trustworthy_checkpoint_is_refused_naming_every_file(tmp_path):
    folder = _folder(tmp_path).acquire(fresh=False)
    folder.save(_state(2))
    folder.save(_state(4))
    for name in ("last.pt", "previous.pt"):
        _flip_tensor_byte(folder.path / name)
    with pytest.raises(checkpoint.CheckpointUnreadable) as refused:
        folder.load()
    assert "\n" not in str(refused.value)
    assert str(folder.path / "last.pt") in str(refused.value) and str(folder.path / "previous.pt") in str(refused.value)
    folder.release()


@pytest.mark.parametrize("key, value", [("run_key", "other"), ("seed", 1), ("variant", "full")])
def test_a_checkpoint_of_another_run_is_refused(tmp_path, key, value):
    theirs = _folder(tmp_path, **{"run_key": "abc", "seed": 0, "variant": "block", key: value}).acquire(fresh=False)
    theirs.save(_state(4))
    theirs.release()
    with pytest.raises(checkpoint.CheckpointUnreadable, match="another run"):
        _folder(tmp_path).load()


def test_a_checkpoint_of_another_mlflow_run_is_refused(tmp_path):
    folder = _folder(tmp_path).acquire(fresh=False)
    folder.save(_state(4))  # mlflow_run_id r1
    folder.write_record(mlflow_run_id="r2")
    with pytest.raises(checkpoint.CheckpointUnreadable, match="another run"):
        folder.load()
    folder.release()


def test_a_checkpoint_of_an_earlier_mlflow_run_of_the_same_folder_is_accepted(tmp_path):
    """Resumed into another store, the run continued in a new MLflow run (r2); until its next
    checkpoint, last.pt still names the first (r1), which the record lists."""
    folder = _folder(tmp_path).acquire(fresh=False)
    folder.save(_state(4))  # mlflow_run_id r1
    folder.write_record(mlflow_run_id="r2", mlflow_run_ids=["r1", "r2"])
    assert folder.load()["step"] == 4
    folder.release()


def test_a_checkpoint_without_a_digest_is_not_trusted(tmp_path):
    (tmp_path / "run").mkdir()
    torch.save(_state(4), tmp_path / "run" / "last.pt")
    with pytest.raises(checkpoint.CheckpointUnreadable, match="no digest"):
        _folder(tmp_path).load()


# -- whole runs ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return _in_process(tmp)


def test_a_flipped_byte_in_last_pt_resumes_from_previous_and_ends_with_the_right_result(tmp_path, uninterrupted):
    killed = run_cli([*ARGS, "tracking.flush_seconds=0", *kill_at_step(5)], tmp_path)
    assert killed.returncode == 137, killed.stderr[-3000:]
    (last,) = (tmp_path / "ckpt").rglob("last.pt")
    assert torch.load(last, weights_only=True)["step"] == 4
    _flip_tensor_byte(last)
    final = _in_process(tmp_path)
    (run,) = runs(tmp_path)
    assert run.info.status == "FINISHED" and run.data.tags["attnres.resumed_at_step"] == "2"
    assert final == uninterrupted  # fp32 on CPU: bit for bit, as the uninterrupted run
    assert sorted(metric_steps(tmp_path, run.info.run_id, "train/loss")) == [1, 2, 3, 4, 5, 6]
    assert "attnres.resume_mismatch" not in run.data.tags  # steps 3-5 recomputed as logged


def test_a_foreign_checkpoint_is_refused_and_the_folder_stays_rerunnable(tmp_path, capsys):
    _in_process(tmp_path, "train.seed=1")  # a finished seed-1 run
    (theirs,) = (tmp_path / "ckpt").rglob("last.pt")
    cfg = compose(_overrides(tmp_path))
    ours = checkpoint.run_folder(to_plain(validate(cfg).cfg))
    ours.mkdir(parents=True)
    (ours / "last.pt").write_bytes(theirs.read_bytes())
    capsys.readouterr()
    with process_state_kept(), pytest.raises(SystemExit) as stopped:
        job.run(cfg)
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "another run" in lines[0], lines
    assert len(runs(tmp_path)) == 1  # no MLflow run for the refused one
    assert (ours / "last.pt").read_bytes() == theirs.read_bytes()  # left as it was
    record = ours / "run.json"
    assert not record.exists() or json.loads(record.read_text()).get("status") != "failed"  # not marked failed
    (ours / "last.pt").unlink()  # the way out the line names: remove it (or train.resume=false)
    _in_process(tmp_path)
    assert sorted(r.info.status for r in runs(tmp_path)) == ["FINISHED", "FINISHED"]


def test_a_refused_resume_then_resume_false_ends_the_old_run_killed(tmp_path):
    killed = run_cli([*ARGS, *kill_at_step(3)], tmp_path)
    assert killed.returncode == 137, killed.stderr[-3000:]
    (old,) = runs(tmp_path)
    assert old.info.status == "RUNNING"
    (last,) = (tmp_path / "ckpt").rglob("last.pt")
    last.write_bytes(last.read_bytes()[:100])  # truncated: the resume is refused
    refused = run_cli(ARGS, tmp_path)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-3000:]
    _in_process(tmp_path, "train.resume=false")
    by_id = {r.info.run_id: r for r in runs(tmp_path)}
    assert len(by_id) == 2
    assert by_id[old.info.run_id].info.status == "KILLED"
    assert "train.resume=false" in by_id[old.info.run_id].data.tags["attnres.failure"]
    (new,) = [r for i, r in by_id.items() if i != old.info.run_id]
    assert new.info.status == "FINISHED"


def test_recomputed_steps_that_disagree_with_the_logged_ones_are_tagged(tmp_path, caplog):
    from harness.tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with process_state_kept():
        first = MlflowTracker.start(uri, "default", "r", {}, flush_seconds=0)
        for step, loss in enumerate([5.0, 4.0, 3.0, 2.5], start=1):
            first.log_metrics({"train/loss": loss}, step)
        first.end("KILLED")
        same = MlflowTracker.start(uri, "default", "r", {}, resume_run_id=first.run_id, flush_seconds=0)
        same.log_metrics({"train/loss": 3.0}, 3)  # recomputed as logged
        same.end("KILLED")
        assert "attnres.resume_mismatch" not in client(tmp_path).get_run(first.run_id).data.tags
        other = MlflowTracker.start(uri, "default", "r", {}, resume_run_id=first.run_id, flush_seconds=0)
        with caplog.at_level(logging.WARNING):
            other.log_metrics({"train/loss": 3.5}, 3)  # not what step 3 logged
            other.log_metrics({"train/loss": 2.9}, 4)  # said once
        other.end("FINISHED")
    tags = client(tmp_path).get_run(first.run_id).data.tags
    assert "step 3" in tags["attnres.resume_mismatch"]
    assert caplog.text.count("does not recompute") == 1
