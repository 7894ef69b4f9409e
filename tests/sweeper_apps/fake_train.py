"""A fake training run with the harness's contract, for the sweeper tests (no torch, no data).

Its validation loss at eval k is 1 + (log10(lr / optimum))^2 + 1/k, so the best learning rate is
known. It reports each eval to harness.pruning, nests its MLflow run under the study's parent run,
and on TrialPruned ends the run KILLED with the PRUNED tags and re-raises, as the harness does.
Environment knobs for the tests: SWEEP_TEST_CALLS (a file that gets one JSON line per run),
SWEEP_TEST_INTERRUPT_AT (send this process SIGINT at its n-th run, like a user's Ctrl-C;
with SWEEP_TEST_INTERRUPT_WRAPPED=1 the interrupt comes back wrapped in another error, as from a
library that caught it mid-write),
SWEEP_TEST_BUSY_AT (raise harness.pruning.TrialNotRun at the n-th run, as the harness refuses a
config another process is training: RunBusy), SWEEP_TEST_SLEEP (seconds per run, in place of train.sleep: one worker slow, same overrides),
SWEEP_TEST_SLEEP_IN_RUN (seconds once its MLflow run has started) and
SWEEP_TEST_BARRIER=<folder>:<n> (the first run of each process waits until n processes have
started one, so that parallel workers provably overlap however slowly each one starts).
"""

import json
import math
import os
import signal
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from harness import pruning

_runs_in_this_process = 0


def val_loss(cfg: DictConfig, step: int) -> float:
    lr = float(cfg.optim.lr)
    if cfg.train.nan_above is not None and lr > cfg.train.nan_above:
        return math.nan
    if cfg.train.diverge_above is not None and lr > cfg.train.diverge_above:
        return 10.0 * step
    return 1.0 + math.log10(lr / cfg.residual.optimum_lr) ** 2 + 1.0 / step


def train(cfg: DictConfig) -> float:
    loss = math.inf
    for step in range(1, cfg.train.evals + 1):
        loss = val_loss(cfg, step)
        if not math.isfinite(loss):
            raise FloatingPointError(f"non-finite validation loss {loss} at step {step}")
        if _mlflow_run() is not None:
            import mlflow

            mlflow.log_metric("val/loss", loss, step=step)
        pruning.report(step, loss)
    return loss


def _mlflow_run():
    import sys

    mlflow = sys.modules.get("mlflow")
    return None if mlflow is None else mlflow.active_run()


def _wait_for_peers(barrier: str) -> None:
    folder, count = barrier.rsplit(":", 1)
    Path(folder).mkdir(exist_ok=True)
    (Path(folder) / str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < int(count) and time.monotonic() < deadline:
        time.sleep(0.05)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    global _runs_in_this_process
    _runs_in_this_process += 1
    if os.environ.get("SWEEP_TEST_CALLS"):
        with open(os.environ["SWEEP_TEST_CALLS"], "a") as calls:
            calls.write(
                json.dumps({"pid": os.getpid(), "variant": cfg.residual.name, "lr": cfg.optim.lr})
                + "\n"
            )
    if os.environ.get("SWEEP_TEST_INTERRUPT_AT") == str(_runs_in_this_process):
        if os.environ.get("SWEEP_TEST_INTERRUPT_WRAPPED"):
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("database is locked")  # noqa: B904 (as SQLAlchemy's, implicit context)
        os.kill(os.getpid(), signal.SIGINT)
    if os.environ.get("SWEEP_TEST_BUSY_AT") == str(_runs_in_this_process):
        raise pruning.TrialNotRun("another process is running this exact config")
    if os.environ.get("SWEEP_TEST_BARRIER") and _runs_in_this_process == 1:
        _wait_for_peers(os.environ["SWEEP_TEST_BARRIER"])
    time.sleep(float(os.environ.get("SWEEP_TEST_SLEEP", cfg.train.sleep)))

    if not (cfg.tracking.uri and cfg.tracking.parent_run_id):
        return train(cfg)
    import mlflow

    mlflow.set_tracking_uri(cfg.tracking.uri)
    parent = mlflow.MlflowClient().get_run(cfg.tracking.parent_run_id)
    mlflow.start_run(
        experiment_id=parent.info.experiment_id,
        parent_run_id=cfg.tracking.parent_run_id,
        tags={"attnres.role": "trial", "attnres.variant": cfg.residual.name},
    )
    pruning.record_run(mlflow.active_run().info.run_id)  # as the harness does, at the run's start
    time.sleep(float(os.environ.get("SWEEP_TEST_SLEEP_IN_RUN", 0)))
    mlflow.log_param("optim.lr", cfg.optim.lr)
    try:
        value = train(cfg)
    except pruning.TrialPruned:
        mlflow.set_tags({"attnres.status": "PRUNED", "pruned": "true"})
        mlflow.end_run(status="KILLED")
        raise
    except Exception as error:
        mlflow.set_tags({"attnres.status": "FAILED", "attnres.failure": repr(error)})
        mlflow.end_run(status="FAILED")
        raise
    mlflow.log_metric("final/val_loss", value)
    mlflow.set_tag("attnres.status", "FINISHED")
    mlflow.end_run(status="FINISHED")
    return value


if __name__ == "__main__":
    main()
