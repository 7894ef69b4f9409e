"""MLflow for studies: a parent run per study, its trials' runs as children, results on the parent.

The sweeper's own runs use MlflowClient only, never the fluent API: with Hydra's basic launcher the
trial's job runs in this process and calls ``mlflow.start_run`` itself. One parent per study, its
id kept in the study, so reruns and workers share it; what MLflow shows: docs/SWEEPER.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.trial import FrozenTrial, TrialState

from harness.tracking import experiment_id

from ._ledger import FAILURE_ATTR, Ledger, is_genuine_failure
from ._storage import absolute_sqlite, sqlite_init_lock
from .settings import MlflowConf

log = logging.getLogger(__name__)

PARENT_ATTR = "mlflow.parent_run_id"
_PARENT_WAIT_S = 30.0


def resolve_tracking(
    conf: MlflowConf, config: DictConfig, base_dir: Path
) -> tuple[str, str] | None:
    """(tracking URI, experiment) the way the harness picks them for its runs; None: no MLflow.

    The task config's ``tracking.enabled: false`` (the harness's ``tracking=off``) turns the
    sweeper's MLflow off too: parent runs without children would only clutter the UI.
    """
    if not conf.enabled or _select(config, "tracking.enabled") is False:
        return None
    uri = (
        conf.tracking_uri
        or _select(config, "tracking.uri")
        or os.environ.get("MLFLOW_TRACKING_URI")
        or "sqlite:///mlflow.db"
    )
    experiment = (
        conf.experiment
        or _select(config, "tracking.experiment")
        or _select(config, "sweep.name")
        or "default"
    )
    return absolute_sqlite(str(uri), base_dir), str(experiment)


def _select(config: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(config, key, default=None)
    except Exception:  # an interpolation that only resolves inside a job
        return None


def last_run_id() -> str | None:
    """The id of the last MLflow run this process started, if the job imported MLflow at all."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None
    try:
        run = mlflow.last_active_run()
    except Exception:
        return None
    return None if run is None else run.info.run_id


def end_leftover_runs(status: str) -> None:
    """End runs a crashed in-process job left active, so the next trial's start_run works.

    A run the job already terminated through the client keeps its status; only a run still
    RUNNING in the store gets ``status``.
    """
    mlflow = sys.modules.get("mlflow")
    while mlflow is not None and (active := mlflow.active_run()) is not None:
        try:
            stored = mlflow.get_run(active.info.run_id).info.status
        except Exception:
            stored = "RUNNING"
        mlflow.end_run(status=status if stored == "RUNNING" else stored)


class StudyTracker:
    def __init__(self, tracking_uri: str, experiment: str, plots: bool) -> None:
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.plots = plots
        with sqlite_init_lock(tracking_uri):
            self.client = MlflowClient(tracking_uri)
            # created as the jobs create it: on SQLite its artifacts beside the database, not in the
            # ./mlruns of whatever folder the sweep was started from; tagged for the UI's model view
            self.experiment_id = experiment_id(self.client, experiment, tracking_uri)

    # -- parent run ---------------------------------------------------------------------------

    def open_parent(
        self,
        study: optuna.Study,
        created: bool,
        cell_values: Mapping[str, str],
        tags: Mapping[str, str],
    ) -> str:
        run_id = study.user_attrs.get(PARENT_ATTR)
        if run_id is None and not created:
            run_id = self._wait_for_parent(study)
        if run_id is not None:
            if self._usable(run_id):
                self.client.update_run(run_id, status="RUNNING")
                self._set_tags(run_id, tags)
                return run_id
            log.warning(
                "study %s: its parent run %s is not in experiment %s of %s; starting a new one",
                study.study_name,
                run_id,
                self.experiment_id,
                self.tracking_uri,
            )
        run = self.client.create_run(
            self.experiment_id,
            run_name=study.study_name,
            tags={"attnres.role": "study", "optuna.study": study.study_name, **tags},
        )
        run_id = run.info.run_id
        if cell_values:
            from mlflow.entities import Param

            self.client.log_batch(run_id, params=[Param(k, v) for k, v in cell_values.items()])
        study.set_user_attr(PARENT_ATTR, run_id)
        return run_id

    def _wait_for_parent(self, study: optuna.Study) -> str | None:
        deadline = time.monotonic() + _PARENT_WAIT_S
        while time.monotonic() < deadline:
            run_id = study.user_attrs.get(PARENT_ATTR)
            if run_id is not None:
                return run_id
            time.sleep(0.5)
        return None

    def _usable(self, run_id: str) -> bool:
        try:
            info = self.client.get_run(run_id).info
        except Exception:
            return False
        return info.lifecycle_stage == "active" and info.experiment_id == self.experiment_id

    def _set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        # One batch is one database commit; tag by tag would be one each.
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    # -- trial runs ---------------------------------------------------------------------------

    def record_trial(
        self, parent_id: str, study_name: str, trial: FrozenTrial, run_id: str | None
    ) -> None:
        if run_id is None:
            return
        run = self.client.get_run(run_id)
        if run.data.tags.get("mlflow.parentRunId") != parent_id:
            return  # not this study's trial: the job did not nest its run under the parent
        tags = {
            "attnres.role": "trial",
            "optuna.study": study_name,
            "optuna.trial_number": str(trial.number),
            "optuna.state": trial.state.name,
        }
        defaults: dict[str, str] = {}
        end_status = None
        if trial.state == TrialState.PRUNED:
            defaults = {"attnres.status": "PRUNED", "pruned": "true"}
            end_status = "KILLED"
        elif is_genuine_failure(trial):
            defaults = {
                "attnres.status": "FAILED",
                "attnres.failure": trial.user_attrs[FAILURE_ATTR],
            }
            end_status = "FAILED"
        elif trial.state == TrialState.FAIL:  # void: interrupted or surplus
            defaults = {"attnres.status": "KILLED"}
            end_status = "KILLED"
        # What the training loop already said about its run stays; only gaps are filled.
        tags.update({k: v for k, v in defaults.items() if k not in run.data.tags})
        self._set_tags(run_id, tags)
        if end_status is not None and run.info.status == "RUNNING":
            self.client.set_terminated(run_id, status=end_status)

    # -- results on the parent ----------------------------------------------------------------

    # Best value and params as metrics and tags: MLflow params are write-once, a resumed study's best is not.
    def update_parent(self, parent_id: str, study: optuna.Study, status: str) -> None:
        from mlflow.entities import Metric

        trials = study.get_trials(deepcopy=False)
        ledger = Ledger.of(trials)
        step = ledger.done
        metrics = {
            "trials/complete": ledger.complete,
            "trials/pruned": ledger.pruned,
            "trials/failed": ledger.failed,
        }
        completed = [t for t in trials if t.state == TrialState.COMPLETE]
        if completed:
            best = study.best_trial
            metrics["best/value"] = float(best.value)
            for name, value in best.params.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics[f"best/{name}"] = float(value)
            tags = {"best.trial": str(best.number), "best.params": json.dumps(best.params)}
            tags.update({f"best.{name}": str(value) for name, value in best.params.items()})
            self._set_tags(parent_id, tags)
        now = int(time.time() * 1000)
        self.client.log_batch(
            parent_id,
            metrics=[
                Metric(key, float(value), now, step)
                for key, value in metrics.items()
                if math.isfinite(value)
            ],
        )
        with tempfile.TemporaryDirectory() as folder:
            if self.plots and completed and _draw_plots(study, Path(folder) / "plots"):
                self.client.log_artifacts(parent_id, str(Path(folder) / "plots"), "plots")
            table = Path(folder) / "trials.csv"
            study.trials_dataframe().to_csv(table, index=False)
            self.client.log_artifact(parent_id, str(table), artifact_path="study")
        if status == "RUNNING":
            self.client.update_run(parent_id, status="RUNNING")
        else:
            self.client.set_terminated(parent_id, status=status)


def _draw_plots(study: optuna.Study, folder: Path) -> list[Path]:
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # files only; never open a window from a sweep
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    folder.mkdir(parents=True, exist_ok=True)
    makers = {
        "optimization_history": plots.plot_optimization_history,
        "param_importances": plots.plot_param_importances,
        "slice": plots.plot_slice,
    }
    if any(t.intermediate_values for t in study.get_trials(deepcopy=False)):
        makers["intermediate_values"] = plots.plot_intermediate_values
    written = []
    for name, make in makers.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks these plots experimental
                axes = make(study)
            figure = _figure_of(axes)
            path = folder / f"{name}.png"
            figure.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(figure)
            written.append(path)
        except Exception as error:  # e.g. importances need two complete trials
            log.debug("study %s: no %s plot (%s)", study.study_name, name, error)
    return written


def _figure_of(axes: Any) -> Any:
    if hasattr(axes, "figure"):
        return axes.figure
    import numpy as np

    return np.ravel(axes)[0].figure
