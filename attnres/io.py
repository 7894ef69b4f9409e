"""Saving a trained DecoderLM and loading it back, from a folder, a file or an MLflow run.

    save_pretrained(model, "out/model")   # model.safetensors (no pickle: loading runs no code) + config.json
    model, config = load("out/model")     # or a .safetensors/.pt file, an MLflow run id, runs:/<id>

Every failure is a one-line `CheckpointError` (a ValueError).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch

from .config import ModelConfig, ResidualConfig
from .model import DecoderLM

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
MLFLOW_ARTIFACT_DIR = "model"  # where a run keeps the folder written by save_pretrained
TRAINING_CHECKPOINT = "last.pt"  # harness.checkpoint.CHECKPOINT: what a run folder of run.py holds
PROJECT_ROOT = Path(__file__).resolve().parents[1]  # the checkout, in an editable install
_METADATA_KEY = "attnres_config"
_RUN_ID = re.compile(r"[0-9a-f]{32}")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: the message names the path (or run) and the problem."""


def save_pretrained(model: torch.nn.Module, directory: Union[str, os.PathLike], extra: Optional[dict] = None) -> Path:
    """Write `model.safetensors` and `config.json` into `directory` (created if needed).

    `model` may be wrapped by torch.compile or DistributedDataParallel; the plain module is saved.
    `extra` adds top-level keys to config.json (not `model` or `residual`). Each file is written
    to a temporary name and renamed, so an interrupted save never leaves a half-written file.
    """
    from safetensors.torch import save_model  # a core dependency, but imported only when saving

    model = _unwrap(model)
    if not isinstance(model, DecoderLM):
        raise TypeError(f"save_pretrained expects an attnres.DecoderLM, got {type(model).__name__}")
    extra = dict(extra or {})
    clash = {"model", "residual"} & set(extra)
    if clash:
        raise ValueError(f"extra must not redefine {sorted(clash)}: they come from the model itself")
    # Extra keys (the run's data and train nodes) ride along so an evaluator needs only the checkpoint.
    config = {"model": dataclasses.asdict(model.config), "residual": dataclasses.asdict(model.residual_config), **extra}
    text = json.dumps(config, indent=2, sort_keys=True, default=str)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{WEIGHTS_NAME}.tmp"
    # save_model (not save_file) because tied embeddings share storage, which save_file refuses.
    # The config also goes into the header, so a lone .safetensors file describes itself.
    save_model(model, str(tmp), metadata={"format": "pt", _METADATA_KEY: text})
    os.replace(tmp, directory / WEIGHTS_NAME)
    tmp = directory / f".{CONFIG_NAME}.tmp"
    tmp.write_text(text + "\n")
    os.replace(tmp, directory / CONFIG_NAME)
    return directory


def load(
    path_or_mlflow_run_id: Union[str, os.PathLike],
    device: Union[str, torch.device, None] = None,
    tracking_uri: Optional[str] = None,
) -> tuple[DecoderLM, dict]:
    """Return `(model, config)`: the DecoderLM in eval mode on `device`, in float32 (weights saved
    in bf16/fp16 are widened exactly; `.to(dtype)` after it for another), and the config dict.

    The argument is, in this order: an existing folder (holding config.json and
    model.safetensors, or a `model/` subfolder that does), an existing file (`.safetensors`,
    `config.json`, or a torch checkpoint), an MLflow run id (32 hex characters) or a
    `runs:/<run id>[/<artifact folder>]` URI, read from `tracking_uri`, else $MLFLOW_TRACKING_URI,
    else the store run.py writes to (<project root>/mlflow.db, from any working folder); a SQLite
    store that does not exist is a CheckpointError, not an empty database left behind. `device`
    None picks CUDA when available, else the CPU.
    """
    source = str(path_or_mlflow_run_id)
    path = Path(source).expanduser()
    if path.exists():
        state, config = _read_local(path)
    else:
        run = parse_run_reference(source)
        if run is None:
            raise CheckpointError(
                f"{source}: no such file or folder, and not an MLflow run id (32 hex characters) or runs:/ URI"
            )
        state, config = _read_mlflow(*run, tracking_uri=tracking_uri)
    model = build_model(config, where=source)
    _load_state(model, state, where=source)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device).eval(), config


def parse_run_reference(text: str) -> Optional[tuple[str, str]]:
    """(run id, artifact folder) for a run id or a `runs:/` URI, else None."""
    if _RUN_ID.fullmatch(text):
        return text, MLFLOW_ARTIFACT_DIR
    if text.startswith("runs:/"):
        run_id, _, folder = text[len("runs:/"):].strip("/").partition("/")
        if _RUN_ID.fullmatch(run_id):
            return run_id, folder or MLFLOW_ARTIFACT_DIR
    return None


def build_model(config: dict, where: str = "config") -> DecoderLM:
    """An untrained DecoderLM from a config dict's `model` and `residual` nodes."""
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"{where}: the config has no 'model' section (expected keys 'model' and 'residual')")
    try:
        model_cfg = ModelConfig(**_known_fields(ModelConfig, config["model"], where, "model"))
        residual_cfg = ResidualConfig(**_known_fields(ResidualConfig, config.get("residual") or {}, where, "residual"))
        return DecoderLM(model_cfg, residual_cfg)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: invalid config: {e}") from None


# --- reading ------------------------------------------------------------------------------------
def _read_local(path: Path) -> tuple[dict, dict]:
    if path.is_dir():
        if not (path / CONFIG_NAME).exists() and (path / MLFLOW_ARTIFACT_DIR / CONFIG_NAME).exists():
            path = path / MLFLOW_ARTIFACT_DIR  # a run's artifact root or a training output folder
        weights = path / WEIGHTS_NAME
        if not weights.exists() and (path / TRAINING_CHECKPOINT).is_file():
            # a run folder of the harness (checkpoints/<sweep>/<run>/): its resumable checkpoint
            return _read_torch_checkpoint(path / TRAINING_CHECKPOINT)
        if not weights.exists():
            raise CheckpointError(f"{path}: no {WEIGHTS_NAME} or {TRAINING_CHECKPOINT} in this folder "
                                  "(expected the output of save_pretrained, or a run folder of run.py)")
        return _read_safetensors(weights)
    if path.name == CONFIG_NAME:
        return _read_local(path.parent)
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    return _read_torch_checkpoint(path)


def _read_safetensors(weights: Path) -> tuple[dict, dict]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        state = load_file(str(weights))
        with safe_open(str(weights), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{weights}: not a readable safetensors file ({_one_line(e)})") from None
    beside = weights.parent / CONFIG_NAME
    if beside.exists():
        try:
            config = json.loads(beside.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{beside}: not valid JSON ({_one_line(e)})") from None
        # The weights carry the config they were saved with: Block and Full have the same tensors,
        # so a config.json copied from another model would load them as the wrong variant.
        own = json.loads(metadata[_METADATA_KEY]) if _METADATA_KEY in metadata else None
        differ = _model_differences(config, own) if isinstance(own, dict) else []
        if differ:
            raise CheckpointError(f"{beside} does not describe {weights.name}: {_few(differ)} (config.json vs the "
                                  "weights' own config); allowed: the config.json saved with these weights, or none")
    elif _METADATA_KEY in metadata:
        config = json.loads(metadata[_METADATA_KEY])
    else:
        raise CheckpointError(f"{weights}: no {CONFIG_NAME} beside it and no config in its header")
    return state, config


def _read_torch_checkpoint(path: Path) -> tuple[dict, dict]:
    try:
        # weights_only: a checkpoint from elsewhere must not be able to run code when loaded.
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{path}: not a safetensors file, a folder or a torch checkpoint readable with weights_only=True ({_one_line(e)})"
        ) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("config"), dict):
        raise CheckpointError(f"{path}: a torch checkpoint needs a dict with 'model' (weights) and 'config' entries")
    state = obj.get("model")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: the checkpoint has no 'model' state dict")
    return state, obj["config"]


def default_tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI (a relative SQLite path made absolute), else <project root>/mlflow.db:
    the store run.py writes to, found from any working folder."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    return absolute_sqlite(env) if env else f"sqlite:///{PROJECT_ROOT / 'mlflow.db'}"


def absolute_sqlite(uri: str) -> str:
    """A relative sqlite:/// path resolved against the working folder, so that later chdirs keep it."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/") and uri != prefix + ":memory:":
        return prefix + str(Path(uri[len(prefix):]).expanduser().resolve())
    return uri


def _read_mlflow(run_id: str, folder: str, tracking_uri: Optional[str]) -> tuple[dict, dict]:
    try:
        import mlflow  # imported here only, so `import attnres` stays torch-only
        from mlflow.exceptions import MlflowException
    except ImportError:
        raise CheckpointError(f"{run_id}: looks like an MLflow run id, but mlflow is not installed") from None
    uri = tracking_uri or default_tracking_uri()
    database = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
    if database and database != ":memory:" and not Path(database).expanduser().exists():
        # MLflow would create an empty store here and then not find the run in it.
        raise CheckpointError(
            f"run {run_id}: no MLflow store at {uri} (no such file); allowed: tracking_uri= or "
            "$MLFLOW_TRACKING_URI naming the store the run was logged to (run.py's default: "
            "<project root>/mlflow.db)"
        )
    with tempfile.TemporaryDirectory(prefix="attnres-load-") as tmp:
        try:
            local = mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path=folder, dst_path=tmp, tracking_uri=uri
            )
        except MlflowException as e:
            raise CheckpointError(
                f"run {run_id}: cannot download its artifact folder {folder}/ from {uri} ({_one_line(e)})"
            ) from None
        except OSError as e:
            raise CheckpointError(f"run {run_id}: no artifact folder {folder}/ at {uri} ({_one_line(e)})") from None
        # Read everything into memory now: the temporary folder disappears on return.
        return _read_local(Path(local))


# --- applying -----------------------------------------------------------------------------------
def _load_state(model: DecoderLM, state: dict, where: str) -> None:
    state = {_strip_wrappers(k): v for k, v in state.items()}
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    if model.config.tie_embeddings:
        # One of the two names of a tied matrix is dropped by save_model; either one suffices.
        tied = {"embed.weight", "lm_head.weight"}
        if tied & set(state):
            missing = [k for k in missing if k not in tied]
            present = next(k for k in ("embed.weight", "lm_head.weight") if k in state)
            state = {**state, **{k: state[present] for k in tied}}
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: weights do not match the config (missing {_few(missing)}; unexpected {_few(unexpected)})"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise CheckpointError(
                f"{where}: {k} has shape {tuple(v.shape)}, the config implies {tuple(expected[k].shape)}"
            )
    model.load_state_dict(state)


def _strip_wrappers(key: str) -> str:
    """Drop the prefixes torch.compile (`_orig_mod.`) and DDP (`module.`) add to parameter names."""
    for prefix in ("_orig_mod.", "module."):
        while key.startswith(prefix):
            key = key[len(prefix):]
    return key


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _known_fields(cls, node: Any, where: str, name: str) -> dict:
    if not isinstance(node, dict):
        raise CheckpointError(f"{where}: config section '{name}' is not a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    # Warn, not refuse: a full resolved run config carries preset keys (learning rate, batch) too.
    unknown = sorted(set(node) - names)
    if unknown:
        warnings.warn(f"{where}: ignoring keys of '{name}' that are not {cls.__name__} fields: {unknown}", stacklevel=3)
    return {k: v for k, v in node.items() if k in names}


def _model_differences(config: Any, own: dict) -> list[str]:
    """`section.key=a≠b` for each field of the model and residual sections the two configs set apart
    (a key one leaves out counts as its default)."""
    out = []
    for section, cls in (("model", ModelConfig), ("residual", ResidualConfig)):
        a, b = (c.get(section) if isinstance(c, dict) and isinstance(c.get(section), dict) else {} for c in (config, own))
        for f in dataclasses.fields(cls):
            default = None if f.default is dataclasses.MISSING else f.default
            x, y = a.get(f.name, default), b.get(f.name, default)
            if x != y:
                out.append(f"{section}.{f.name}={x}≠{y}")
    return out


def _few(keys: list, n: int = 4) -> str:
    return "none" if not keys else ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]
