"""Writing evaluation results back into the MLflow run that trained the model.

The client API logs into the existing run without starting, resuming or ending it, so its status
and end time stay training's. A later evaluation of the same kind logs newer values (shown as
latest) and overwrites `eval/<kind>.json`: one current answer per kind.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Optional


def log_to_run(run_id: str, tracking_uri: Optional[str], metrics: dict[str, float], artifacts: dict[str, dict]) -> None:
    """Log `metrics` (keys without the `eval/` prefix) and `artifacts` ({name: JSON-able dict})."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    client.get_run(run_id)  # fails early, with MLflow's message, if the run does not exist
    now = int(time.time() * 1000)
    batch = [Metric(f"eval/{k}", float(v), now, 0) for k, v in sorted(metrics.items())]
    for i in range(0, len(batch), 1000):  # MLflow's limit per log_batch call
        client.log_batch(run_id, metrics=batch[i : i + 1000])
    with tempfile.TemporaryDirectory(prefix="attnres-eval-") as tmp:
        for name, payload in artifacts.items():
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=_jsonable))
            client.log_artifact(run_id, str(path), artifact_path="eval")


def log_file(run_id: str, tracking_uri: Optional[str], path: str, artifact_path: str) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=tracking_uri).log_artifact(run_id, path, artifact_path=artifact_path)


def _jsonable(obj):
    """lm-eval's results hold numpy scalars, dtypes and callables: keep numbers, stringify the rest."""
    try:
        return obj.item()
    except Exception:
        return str(obj)
