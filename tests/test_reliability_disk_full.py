"""A checkpoint write that fails (full disk, simulated in-process: the writer dies half-way with
ENOSPC) keeps the previous checkpoint intact and loadable; training goes on, retries at the next
interval, and the run says so in its tags."""
import errno

import pytest
import torch

from harness import checkpoint, job
from harness_testing import restore_process_state  # noqa: F401  (a fixture, used below)
from harness_testing import TINY, compose, file_size_limit, isolated, metric_steps, runs

pytestmark = pytest.mark.usefixtures("restore_process_state")


def test_a_full_disk_keeps_the_last_checkpoint_and_training_goes_on(tmp_path, monkeypatch):
    real_save = torch.save
    writes = []

    def disk_full_after_the_first_checkpoint(obj, path, *args, **kwargs):
        if isinstance(obj, dict) and "optimizer" in obj:  # a checkpoint, not another file
            writes.append(obj["step"])
            if len(writes) > 1:
                with open(path, "wb") as handle:
                    handle.write(b"half a checkpoint")  # what a full disk leaves behind
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_after_the_first_checkpoint)
    overrides = [*TINY, *(o for o in isolated(tmp_path) if not o.startswith("hydra.")),
                 "tracking.log_code=false", "tracking.log_env=false"]
    value = job.run(compose(overrides))  # steps 6, a checkpoint every 2: written at 2, fails at 4 and 6

    assert writes == [2, 4, 6]  # it retried at every interval
    (run,) = runs(tmp_path)
    assert run.info.status == "FINISHED" and run.data.metrics["final/val_loss"] == value
    assert run.data.tags["attnres.checkpoint_failures"] == "2"
    assert "step 6 not written" in run.data.tags["attnres.checkpoint_error"]
    assert "No space left on device" in run.data.tags["attnres.checkpoint_error"]
    assert metric_steps(tmp_path, run.info.run_id, "train/loss") == [1, 2, 3, 4, 5, 6]
    folder = checkpoint.RunFolder(next((tmp_path / "ckpt").rglob("run.json")).parent)
    assert folder.load()["step"] == 2  # the previous checkpoint, intact and loadable
    assert not [p for p in folder.path.iterdir() if p.name.endswith(".tmp")]  # no half file left


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGXFSZ"), reason="no file-size limit on this system")
def test_a_write_that_the_system_refuses_reaches_the_loop_as_an_oserror(tmp_path):
    """Not a simulated exception: the system refuses the write (a file-size limit, as a full disk
    does), and torch's own writer reports it as a RuntimeError. The loop keeps training only on
    an OSError, so the run folder must turn it into one; the previous checkpoint stays."""
    folder = checkpoint.RunFolder(tmp_path / "run").acquire(fresh=False)
    folder.save({"step": 1})
    with file_size_limit(64 * 1024), pytest.raises(OSError, match="torch.save could not write"):
        folder.save({"step": 2, "weights": torch.zeros(100_000)})  # 400 kB
    assert folder.load()["step"] == 1
    assert sorted(p.name for p in folder.path.iterdir()) == [".lock", "last.pt"]
    folder.release()


def test_a_disk_too_full_for_the_run_record_stops_in_one_line_with_the_run_failed(tmp_path, monkeypatch, capsys):
    """A disk full before the first step (the run's record cannot be written): one line, exit 1,
    the MLflow run FAILED with the reason (it was left to MLflow's exit hook, which ends it
    FINISHED with no metrics: a finished run that never trained)."""
    def no_room(self, **fields):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path / checkpoint.RECORD))

    monkeypatch.setattr(checkpoint.RunFolder, "write_record", no_room)
    overrides = [*TINY, *(o for o in isolated(tmp_path) if not o.startswith("hydra.")),
                 "tracking.log_code=false", "tracking.log_env=false"]
    with pytest.raises(SystemExit) as stopped:
        job.run(compose(overrides))
    assert stopped.value.code == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and " INFO " not in line]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "FAILED" in lines[0], lines
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED" and "No space left on device" in run.data.tags["attnres.failure"]
