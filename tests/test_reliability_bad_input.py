"""Bad input at every user-facing door of run.py: exit code 2, one line naming the key, the value
and what is allowed, and nothing left behind (no run folder, no Hydra output folder, no store)."""
import os
import subprocess
import sys

import pytest

from harness_testing import ROOT, TINY

CASES = {
    "a value the config cannot run": (["train.micro_batch_size=3"], "train.micro_batch_size=3"),
    "a data path": (["data=text", "data.path=/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    "a checkpoint path": (["train.checkpoint_dir=/proc/no-such-dir"], "train.checkpoint_dir=/proc/no-such-dir"),
    "a tracking URI scheme": (["tracking.uri=foo://bar"], "tracking.uri=foo://bar"),
    "a SQLite URI in a folder that cannot exist": (["tracking.uri=sqlite:////proc/x/mlflow.db"],
                                                    "tracking.uri=sqlite:////proc/x/mlflow.db"),
    "a dead tracking server, in a multirun": (["-m", "residual=baseline,block", "tracking.uri=http://127.0.0.1:1"],
                                              "tracking.uri=http://127.0.0.1:1: no MLflow server answers"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line_naming_the_key(case, tmp_path):
    extra, named = CASES[case]
    base = [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
            f"hydra.run.dir={tmp_path / 'out'}", f"hydra.sweep.dir={tmp_path / 'out'}"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    flags = [a for a in extra if a.startswith("-")]  # before the overrides (argparse)
    overrides = [a for a in extra if not a.startswith("-")]
    result = subprocess.run([sys.executable, "run.py", *flags, *TINY, *base, *overrides], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)  # the last override of a key wins
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()
    assert not list((tmp_path / "ckpt").rglob("run.json")) if (tmp_path / "ckpt").exists() else True
