"""A store, an output folder or a checkpoint folder that cannot be written: one line, exit 2, and
nothing left behind (no run folder holding only its `.lock`). /proc stands for a read-only place:
it refuses new files to every user, root included (a chmod does not stop root)."""
import os
import subprocess
import sys

from harness import checkpoint
from harness_testing import ROOT, TINY, runs


def _run(args, tmp):
    env = dict(os.environ, MPLBACKEND="Agg", HYDRA_FULL_ERROR="0")
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *TINY, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _one_line(result) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_sqlite_store_in_a_read_only_folder_is_one_line_and_leaves_nothing(tmp_path):
    result = _run(["tracking.uri=sqlite:////proc/mlflow.db", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
                   f"hydra.run.dir={tmp_path / 'out'}"], tmp_path)
    assert "tracking.uri=sqlite:////proc/mlflow.db" in _one_line(result)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "out").exists()


def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path):
    result = _run([f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
                   "hydra.run.dir=/proc/attnres-out"], tmp_path)
    assert "/proc/attnres-out" in _one_line(result)
    assert not (tmp_path / "ckpt").exists() and runs(tmp_path) == []


def test_a_checkpoint_folder_that_cannot_be_made_is_one_line(tmp_path):
    result = _run([f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "train.checkpoint_dir=/proc/attnres-ckpt",
                   f"hydra.run.dir={tmp_path / 'out'}"], tmp_path)
    assert "train.checkpoint_dir=/proc/attnres-ckpt" in _one_line(result)
    assert runs(tmp_path) == [] and not (tmp_path / "out").exists()


def test_a_run_folder_left_with_only_its_lock_is_removed_with_the_folders_made_for_it(tmp_path):
    (tmp_path / "root").mkdir()
    folder = checkpoint.RunFolder(tmp_path / "root" / "sweep" / "run").acquire(fresh=False)
    folder.release()  # refused before anything was written
    assert list((tmp_path / "root").iterdir()) == []
    kept = checkpoint.RunFolder(tmp_path / "root" / "sweep" / "run").acquire(fresh=False)
    kept.write_record(status="running")
    kept.release()
    assert sorted(p.name for p in kept.path.iterdir()) == [".lock", "run.json"]
