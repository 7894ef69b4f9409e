"""What an evaluation command evaluates: a checkpoint folder or file, or an MLflow run.

Resolves the argument once into the model, its config, the run to log results into (the one named,
or `--log-to`; a folder alone logs nothing) and the run's data settings: from the checkpoint's
config, else the run's `config/resolved.yaml`, else the defaults, said on stderr.
"""
from __future__ import annotations

import dataclasses
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from attnres.io import CheckpointError, load, parse_run_reference
from harness.config import absolute_sqlite, default_tracking_uri


@dataclass
class Source:
    model: object  # attnres.DecoderLM, in eval mode
    config: dict
    label: str  # what the user typed
    run_id: Optional[str]  # the MLflow run that results are logged into, if any
    tracking_uri: Optional[str]


def open_source(arg: str, device=None, tracking_uri: Optional[str] = None, log_to: Optional[str] = None) -> Source:
    """Load the checkpoint or run `arg`; raise CheckpointError with one line if it cannot be."""
    # run.py's store wherever the command starts, not MLflow's default in the working folder.
    tracking_uri = absolute_sqlite(tracking_uri) if tracking_uri else default_tracking_uri()
    if log_to is not None and parse_run_reference(log_to) is None:
        raise CheckpointError(f"--log-to {log_to!r}: not an MLflow run id (32 hex characters)")
    run = None if Path(arg).expanduser().exists() else parse_run_reference(arg)
    if run or log_to:
        from harness.tracking import prepare_server, sqlite_damage, sqlite_path

        db = sqlite_path(tracking_uri)
        if db is not None and not db.exists():  # MLflow would leave an empty database behind
            raise CheckpointError(
                f"run {(run or parse_run_reference(log_to))[0]}: no MLflow store at {tracking_uri} (no such file); "
                "allowed: --tracking-uri or $MLFLOW_TRACKING_URI naming the store the run was logged to "
                "(run.py's default: <project root>/mlflow.db)")
        damage = sqlite_damage(db) if db is not None else None
        if damage:  # MLflow's own error is a SQLAlchemy traceback
            raise CheckpointError(f"--tracking-uri {tracking_uri}: {damage}; allowed: the store the run was logged to")
        # A server that does not answer: one line now, not minutes of MLflow's retries.
        prepare_server(tracking_uri, option="--tracking-uri ")
    model, config = load(arg, device=device, tracking_uri=tracking_uri)
    run_id = parse_run_reference(log_to)[0] if log_to else (run[0] if run else None)
    if run and not isinstance(config.get("data"), dict):
        config = {**config, **_resolved_run_config(run[0], tracking_uri)}
    return Source(model, config, arg, run_id, tracking_uri)


def store_gone(source: Source) -> Optional[str]:
    """Why results cannot go into the source's run any more: its SQLite store deleted since it was
    read (MLflow would make an empty store in its place, then fail to find the run); else None."""
    from harness.tracking import sqlite_path

    db = sqlite_path(source.tracking_uri) if source.run_id and source.tracking_uri else None
    if db is not None and not db.exists():
        return f"the tracking store {db} is gone (deleted since run {source.run_id} was read)"
    return None


def data_settings(source: Source, overrides: Optional[list[str]] = None, seq_len: Optional[int] = None):
    """(DataConfig, seq_len) of the run's validation split, with `key=value` overrides applied."""
    from harness.data import DataConfig

    node = dict(source.config.get("data") or {})
    if not node and not overrides:
        print(f"evaluation: {source.label} records no data settings; using the defaults (stdlib corpus)", file=sys.stderr)
    fields = {f.name: f for f in dataclasses.fields(DataConfig)}
    node = {k: v for k, v in node.items() if k in fields}
    where = {k: f"{source.label}: data.{k}" for k in node}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise CheckpointError(f"--data {item!r}: expected key=value with key one of {', '.join(fields)}")
        node[key], where[key] = _parse_value(value), f"--data {key}"
    cfg = _typed_data_config(node, fields, where)
    train = source.config.get("train") if isinstance(source.config.get("train"), dict) else {}
    seq_len = seq_len or train.get("seq_len") or source.model.config.max_seq_len
    if seq_len > source.model.config.max_seq_len:
        raise CheckpointError(f"seq_len={seq_len} exceeds the model's max_seq_len={source.model.config.max_seq_len}")
    return cfg, int(seq_len)


def _typed_data_config(node: dict, fields: dict, where: dict):
    """DataConfig with each value checked against its field's type, as Hydra checks `data.*`
    overrides for run.py. Unchecked, `--data val_fraction=abc` surfaced as "TypeError: '<' not
    supported between instances of 'float' and 'str'" (exit 1) and `n_vars=abc` as a bare int()
    error, neither naming the setting."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from harness.data import DataConfig

    schema = OmegaConf.structured(DataConfig)
    for key, value in node.items():
        try:
            OmegaConf.merge(schema, {key: value})
        except OmegaConfBaseException:
            raise CheckpointError(f"{where[key]}={value!r}: not a valid {fields[key].type}") from None
    return OmegaConf.to_object(OmegaConf.merge(schema, node))


def _resolved_run_config(run_id: str, tracking_uri: Optional[str]) -> dict:
    """`data` and `train` from the run's config/resolved.yaml artifact, or {} when it has none."""
    import mlflow
    import yaml

    with tempfile.TemporaryDirectory(prefix="attnres-eval-") as tmp:
        try:
            path = mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path="config/resolved.yaml", dst_path=tmp, tracking_uri=tracking_uri
            )
            resolved = yaml.safe_load(Path(path).read_text()) or {}
        except Exception:  # no such artifact: the caller falls back to defaults and says so
            return {}
    return {k: resolved[k] for k in ("data", "train") if isinstance(resolved.get(k), dict)}


def _parse_value(text: str):
    """`--data` values as YAML scalars/lists (numbers, null, [1,2]), like Hydra overrides."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text
