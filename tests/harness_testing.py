"""Shared pieces of the harness tests: a tiny, fast run config and ways to run it.

Every run writes only below a temporary folder: its SQLite tracking database, Hydra's output
folders and the checkpoints. One intra-op thread: tiny models gain nothing from two, and a
busy CI machine makes OpenMP's waiting threads slow.
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from hydra.experimental.callback import Callback

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "model=tiny", "train.steps=6", "train.seq_len=32", "train.batch_size=4", "train.eval_interval=3",
    "train.eval_batches=2", "train.checkpoint_interval=2", "train.instrument_interval=3",
    "train.log_interval=1", "train.threads=1", "train.progress=false", "data.max_bytes=300000",
]


@contextmanager
def process_state_kept():
    """An in-process run changes process-wide state on purpose (the fluent MLflow tracking URI and
    its environment variable, which the Optuna sweeper reads back; torch's thread count). Put it
    back afterwards, so that later tests see the process as they would alone."""
    import torch

    env, threads = os.environ.get("MLFLOW_TRACKING_URI"), torch.get_num_threads()
    try:
        yield
    finally:
        import mlflow

        mlflow.set_tracking_uri(None)  # clears the module global and the environment variable
        if env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = env
        torch.set_num_threads(threads)


@contextmanager
def file_size_limit(nbytes: int):
    """A full disk, without a full disk: writes that would take a file past `nbytes` fail with
    EFBIG (SIGXFSZ ignored, so the write fails instead of the process dying); this process only."""
    import resource
    import signal

    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)


@pytest.fixture
def restore_process_state():
    with process_state_kept():
        yield


def isolated(tmp: Path) -> list[str]:
    """Overrides that keep a run's files inside `tmp`."""
    return [
        f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
        f"train.checkpoint_dir={tmp / 'ckpt'}",
        f"hydra.run.dir={tmp / 'out'}",
        f"hydra.sweep.dir={tmp / 'multirun'}",
    ]


def kill_at_step(step: int) -> list[str]:
    """Overrides that make run.py die like kill -9 right after training step `step` (KillAtStep);
    the run needs tests/ importable (pythonpath_with_tests)."""
    return ["+hydra.callbacks.kill_at_step._target_=harness_testing.KillAtStep",
            f"+hydra.callbacks.kill_at_step.step={step}"]


def pythonpath_with_tests() -> dict:
    """{"PYTHONPATH": this folder first}, for the environment of a job whose Hydra callbacks live here."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)}


class KillAtStep(Callback):
    """A Hydra callback (kill_at_step): once the job starts, every Trainer it builds ends the
    process with os._exit(137) after step `step`, nothing flushed or closed, as kill -9 does."""

    def __init__(self, step: int):
        self.step = step

    def on_job_start(self, config, **kwargs) -> None:
        from harness.train import Trainer

        build, step = Trainer.__init__, self.step

        def build_then_arm(trainer, *args, **kw):
            build(trainer, *args, **kw)
            trainer.after_step.append(lambda end: os._exit(137) if trainer.step == step else None)

        Trainer.__init__ = build_then_arm


def run_cli(args: list[str], tmp: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python run.py ARGS` in the project root, its files in `tmp`."""
    full_env = dict(os.environ, MPLBACKEND="Agg", HYDRA_FULL_ERROR="0", **{**pythonpath_with_tests(), **(env or {})})
    full_env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args, *isolated(tmp)], cwd=ROOT, env=full_env,
        capture_output=True, text=True, timeout=timeout,
    )


def compose(overrides: list[str]):
    """The composed config of run.py (in-process, no Hydra run context)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from harness.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def sweep_jobs(overrides: list[str]):
    """(overrides, config without `hydra`) of every job a basic-sweeper multirun would launch."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from harness.callbacks import _without_hydra, job_configs
    from harness.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        master = hydra_compose("config", overrides=overrides, return_hydra_config=True)
        return [(o, _without_hydra(c)) for o, c in job_configs(master)]


def client(tmp: Path):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")


def runs(tmp: Path, experiment: str = "default"):
    c = client(tmp)
    exp = c.get_experiment_by_name(experiment)
    return [] if exp is None else c.search_runs([exp.experiment_id], max_results=1000)


def metric_steps(tmp: Path, run_id: str, key: str) -> list[int]:
    return [m.step for m in client(tmp).get_metric_history(run_id, key)]


def artifacts(tmp: Path, run_id: str, path: str | None = None) -> list[str]:
    c, out = client(tmp), []
    for item in c.list_artifacts(run_id, path):
        out += artifacts(tmp, run_id, item.path) if item.is_dir else [item.path]
    return out


def then_delete(fn, path):
    """`fn`, which deletes `path` once it has returned: a store that vanishes right after a step."""
    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        path.unlink()
        return result
    return wrapped
