"""Runs → a tidy pandas frame (one row per training run), metric histories and instrumentation.

Reads only the names docs/RUN_SCHEMA.md gives and never imports training code. What it does not find
becomes NaN, not an error: older, ad-hoc and failed runs lack pieces, and a report must still cover
them. A snapshot (runs.csv plus .history.csv and .instrumentation.json) replaces the database.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pandas as pd

from .scaling import PFLOPS_DAY

HISTORY_KEYS = ("val/loss", "val/loss_by_tokens", "train/loss", "depth/entropy")
NOT_TRAINING_ROLES = {"parent", "study"}  # multirun parents and Optuna studies; trials are kept

# column -> (source, key), tried in order; the first one present wins.
_FIELDS: dict[str, list[tuple[str, str]]] = {
    "variant": [("tags", "attnres.variant"), ("params", "residual.name")],
    "model": [("params", "model.name"), ("tags", "attnres.model")],
    "sweep": [("params", "sweep.name"), ("tags", "attnres.sweep")],
    "seed": [("params", "train.seed"), ("tags", "attnres.seed")],
    "block_size": [("params", "residual.block_size")],
    "num_blocks": [("params", "residual.num_blocks")],
    "window": [("params", "residual.window")],
    "residual_heads": [("params", "residual.heads")],
    # Nominal cell of a generated architecture sweep (the real shape is rounded from it).
    "arch_d_model_per_layer": [("params", "sweep.arch.d_model_per_layer")],
    "arch_heads_per_layer": [("params", "sweep.arch.heads_per_layer")],
    "d_model": [("params", "model.d_model")],
    "layers": [("params", "model.layers")],
    "n_heads": [("params", "model.n_heads")],
    "n_kv_heads": [("params", "model.n_kv_heads")],
    "d_ff": [("params", "model.d_ff")],
    "lr": [("params", "optim.lr")],
    # Nuisance knobs of the recipe (analysis/robustness.py); unset ones resolve in _knob_defaults.
    "norm_eps": [("params", "model.norm_eps")],
    "prenorm_eps": [("params", "model.prenorm_eps")],
    "residual_norm_eps": [("params", "model.residual_norm_eps")],
    "final_norm_eps": [("params", "model.final_norm_eps")],
    "init_std": [("params", "model.init_std")],
    "embed_std": [("params", "model.embed_std")],
    "batch_size": [("params", "train.batch_size")],
    "seq_len": [("params", "train.seq_len")],
    "data": [("params", "data.name")],
    "params_total": [("params", "count.params_total")],
    "params_embedding": [("params", "count.params_embedding")],
    "params_non_embedding": [("params", "count.params_non_embedding")],
    "params_residual": [("params", "count.params_residual")],
    "flops_per_token": [("params", "count.flops_per_token")],
    # Tokens *trained*: from the metrics only. The param train.tokens is a requested budget (and
    # its default, 250k, stays set when steps, flops or tokens_per_param decide the budget), so a
    # run killed before its first log would get a made-up token count, FLOPs and compute.
    "tokens": [("metrics", "final/tokens"), ("metrics", "train/tokens")],
    "flops": [("metrics", "final/flops"), ("metrics", "train/flops")],
    "final_val_loss": [("metrics", "final/val_loss"), ("metrics", "val/loss")],
    "best_val_loss": [("metrics", "final/val_loss_best")],
    "train_seconds": [("metrics", "final/train_seconds")],
    "tokens_per_s": [("metrics", "train/tokens_per_s")],
    "failure": [("tags", "attnres.failure")],
    "role": [("tags", "attnres.role")],
    "parent_run_id": [("tags", "mlflow.parentRunId")],
    "run_name": [("tags", "mlflow.runName")],
    "data_fingerprint": [("tags", "attnres.data_fingerprint")],
    "run_key": [("tags", "attnres.run_key")],
}
TEXT_COLUMNS = ["run_id", "experiment", "sweep", "variant", "model", "status", "failure", "role",
                "parent_run_id", "run_name", "data", "data_fingerprint", "run_key"]
DEPTH_PREFIXES = {"depth/output_rms/block_": "output_rms_block_",
                  "depth/grad_norm/block_": "grad_norm_block_"}
# Multi-hop probe accuracy per hop count k (latest evaluation = the end of training).
PROBE_PREFIX = ("probe/acc_hop_", "probe_acc_hop_")
# The accuracy of answering with a random digit of the prompt, per hop count (no chain followed).
COPY_PREFIX = ("probe/copy_hop_", "probe_copy_hop_")
TAIL_PREFIXES = (*DEPTH_PREFIXES.values(), PROBE_PREFIX[1], COPY_PREFIX[1])


class AnalysisInputError(Exception):
    """Bad input to the analysis (missing file, unknown experiment, no runs). The CLI prints the
    message as one line and exits non-zero."""


@dataclass
class RunSet:
    """What a report is made from: the run frame, histories, instrumentation and their source."""

    runs: pd.DataFrame
    histories: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(
        columns=["run_id", "key", "step", "value"]))
    instrumentation: dict[str, dict] = field(default_factory=dict)
    source: str = ""
    adaptive: dict | None = None  # adaptive.json beside a snapshot: the seeds' stopping rule and verdicts
    pilot: frozenset = frozenset()  # run ids of pilot/runs.csv beside a snapshot: the runs that sized the study
    notes: tuple[str, ...] = ()  # what reading the input left out (duplicate rows), for REPORT.md

    @property
    def finished(self) -> pd.DataFrame:
        """The FINISHED runs, the latest of each config and seed (`latest_per_config`)."""
        return latest_per_config(self.runs[self.runs["status"] == "FINISHED"])[0]

    def only(self, run_ids) -> "RunSet":
        """These runs alone, with their histories and instrumentation."""
        ids = set(run_ids)
        return RunSet(runs=self.runs[self.runs["run_id"].isin(ids)].reset_index(drop=True),
                      histories=self.histories[self.histories["run_id"].isin(ids)].reset_index(drop=True),
                      instrumentation={k: v for k, v in self.instrumentation.items() if k in ids},
                      source=self.source, adaptive=self.adaptive, pilot=self.pilot)


def latest_per_config(finished: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(kept, superseded). Finished runs sharing an ``attnres.run_key`` (the hash of the whole
    config, seed included) are one config trained again (``train.resume=false``, or another
    checkpoint folder into the same store), not independent seeds: counted as such they would
    narrow every interval with a copy. Keyed runs that trained the same values under two keys
    (``train.steps=20`` and ``train.tokens=40960`` name one budget) are one config too
    (`trained_key`). The latest started is kept; runs without the tag (older harnesses, ad-hoc
    runs) are all kept."""
    keyed = finished[finished["run_key"].notna()].sort_values("start_time", kind="mergesort",
                                                                na_position="first")
    latest = keyed.drop_duplicates("run_key", keep="last")
    known = latest["tokens"].notna() & latest["seed"].notna()  # what was trained is known
    latest = pd.concat([latest[~known], latest[known].assign(_t=trained_key(latest[known]))
                        .drop_duplicates("_t", keep="last").drop(columns="_t")])
    superseded = keyed.index.difference(latest.index)
    return finished.drop(index=superseded), finished.loc[superseded]


def trained_key(runs: pd.DataFrame) -> pd.Series:
    """What each run trained, as one string: its sweep, variant, seed, tokens trained and every
    config value the run frame holds (shape, learning rate, batch, data, residual settings),
    whatever overrides spelled them."""
    cols = [c for c in ("sweep", "variant", "model", "seed", "tokens", "data_fingerprint",
                        *(c for c, src in _FIELDS.items() if src[0][0] == "params"
                          and not src[0][1].startswith("count."))) if c in runs]
    cols = list(dict.fromkeys(cols))
    if runs.empty:  # apply on no rows gives a frame, not a column
        return pd.Series("", index=runs.index, dtype=object)
    return runs[cols].apply(lambda c: c.map(lambda x: "?" if pd.isna(x) else repr(x))).agg("/".join, axis=1)


# --------------------------------------------------------------------------------------------
# MLflow
# --------------------------------------------------------------------------------------------
def _client(tracking_uri: str):
    """An MlflowClient for an existing store. MLflow silently creates an empty SQLite database or
    file store for a path that does not exist, which would turn a typo into "no runs"; so a local
    store must exist first."""
    from mlflow.tracking import MlflowClient

    parsed = urlparse(tracking_uri)
    if parsed.scheme == "sqlite":
        path = tracking_uri[len("sqlite:///"):] if tracking_uri.startswith("sqlite:///") else ""
        if not path or not Path(path).is_file():
            raise AnalysisInputError(f"tracking database not found: {path or tracking_uri}")
        from .sqlite_store import sqlite_damage  # a cut-short or damaged file: one line, not SQLAlchemy's trace
        if sqlite_damage(Path(path)):
            raise AnalysisInputError(f"--tracking-uri {tracking_uri}: {sqlite_damage(Path(path))}")
    elif parsed.scheme in ("", "file"):
        path = parsed.path if parsed.scheme == "file" else tracking_uri
        if not Path(path).exists():
            raise AnalysisInputError(f"tracking store not found: {path}")
    elif parsed.scheme in ("http", "https"):
        # MLflow's client retries a server that does not answer with exponential backoff, for
        # minutes; a read-only command should say so at once (a user's own setting wins).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    return MlflowClient(tracking_uri=tracking_uri)


def _experiments(client, names):
    from mlflow.entities import ViewType

    if names:
        out = []
        for name in names:
            exp = client.get_experiment_by_name(name)
            if exp is None:
                known = sorted(e.name for e in client.search_experiments(view_type=ViewType.ALL))
                raise AnalysisInputError(f"unknown experiment {name!r} "
                                         f"(known: {', '.join(known) or 'none'})")
            out.append(exp)
        return out
    return list(client.search_experiments(view_type=ViewType.ACTIVE_ONLY))


def _number(value):
    if value is None:
        return np.nan
    try:
        x = float(value)
    except (TypeError, ValueError):
        return np.nan
    return x


def _text(value):
    """A text field, with every spelling of "missing" (None, NaN, "None", "") as None."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    value = str(value)
    return None if value in ("None", "null", "") else value


def _row(run, exp_name: str) -> dict:
    src = {"params": run.data.params, "metrics": run.data.metrics, "tags": run.data.tags}
    row = {"run_id": run.info.run_id, "experiment": exp_name}
    for col, options in _FIELDS.items():
        row[col] = next((src[kind][key] for kind, key in options if key in src[kind]), None)
    # The harness's own tag knows PRUNED; no status is dropped, the report lists the unfinished.
    row["status"] = run.data.tags.get("attnres.status") or run.info.status
    row["start_time"] = run.info.start_time
    for metric, value in run.data.metrics.items():
        for prefix, col in (*DEPTH_PREFIXES.items(), PROBE_PREFIX, COPY_PREFIX):
            if metric.startswith(prefix):
                row[col + metric[len(prefix):]] = value
    return row


def _tidy(rows: list[dict]) -> pd.DataFrame:
    """Types, derived columns and a stable order, shared by the MLflow and snapshot paths."""
    df = pd.DataFrame(rows)
    for col in list(_FIELDS) + ["status", "start_time"]:
        if col not in df:
            df[col] = np.nan
    for col in df.columns:
        if col in TEXT_COLUMNS:
            df[col] = df[col].map(_text).astype(object)
        else:
            df[col] = df[col].map(_number).astype(float)
    df["sweep"] = df["sweep"].where(df["sweep"].notna(), df["experiment"])
    df["variant"] = df["variant"].where(df["variant"].notna(), "unknown")
    # FLOPs from the accounting when the run ended before logging them.
    df["flops"] = df["flops"].where(df["flops"].notna(), df["tokens"] * df["flops_per_token"])
    df["compute_pfd"] = df["flops"] / PFLOPS_DAY
    _knob_defaults(df)
    df["d_model_per_layer"] = df["d_model"] / df["layers"]
    df["heads_per_layer"] = df["n_heads"] / df["layers"]
    lead = ["run_id", "experiment", "sweep", "variant", "model", "seed", "status", "failure",
            "final_val_loss", "best_val_loss", "tokens", "flops", "compute_pfd"]
    depth = sorted(c for c in df.columns if c.startswith(TAIL_PREFIXES))
    rest = [c for c in df.columns if c not in lead and c not in depth]
    df = df[lead + rest + depth]
    return df.sort_values(["experiment", "variant", "model", "seed", "run_id"],
                          na_position="last", kind="mergesort").reset_index(drop=True)


def _knob_defaults(df: pd.DataFrame) -> None:
    """The value each knob ran at: a per-family epsilon or embed_std left unset (None) is its
    parent's, and a snapshot exported before the knobs were columns ran at the model's defaults."""
    df["norm_eps"] = df["norm_eps"].fillna(1e-6)
    for col in ("prenorm_eps", "residual_norm_eps", "final_norm_eps"):
        df[col] = df[col].fillna(df["norm_eps"])
    df["init_std"] = df["init_std"].fillna(0.02)
    df["embed_std"] = df["embed_std"].fillna(df["init_std"])


def load_runs(tracking_uri: str, experiments=None, filter_string: str = "") -> pd.DataFrame:
    """The tidy run frame: one row per training run in the given experiments (all if none),
    optionally narrowed by an MLflow filter string (e.g. ``tags.attnres.sweep = 'scaling'``)."""
    from mlflow.exceptions import MlflowException

    try:
        return _load_runs(tracking_uri, experiments, filter_string)
    except MlflowException as exc:
        # A bad filter, an unreachable server, a database of another program: one line, no trace.
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        errno = re.findall(r"\[Errno -?\d+\] [^\"')]+", first)  # a refused or unknown host, in urllib3's words
        raise AnalysisInputError(f"cannot read runs from {redact(tracking_uri)}: "
                                 f"{'no MLflow server answers there (' + errno[-1] + ')' if errno else first}") from None


def _load_runs(tracking_uri: str, experiments, filter_string: str) -> pd.DataFrame:
    from mlflow.entities import ViewType

    client = _client(tracking_uri)
    exps = _experiments(client, experiments)
    rows, token = [], None
    by_id = {e.experiment_id: e.name for e in exps}
    if by_id:
        while True:
            page = client.search_runs(list(by_id), filter_string=filter_string or "",
                                      run_view_type=ViewType.ACTIVE_ONLY, max_results=5000,
                                      page_token=token)
            for run in page:
                if run.data.tags.get("attnres.role") in NOT_TRAINING_ROLES:
                    continue
                rows.append(_row(run, by_id[run.info.experiment_id]))
            token = page.token
            if not token:
                break
    if not rows:
        where = ", ".join(sorted(by_id.values())) or "no experiments"
        raise AnalysisInputError(f"no runs found in {tracking_uri} ({where}"
                                 + (f"; filter {filter_string!r}" if filter_string else "") + ")")
    return _tidy(rows)


def load_histories(tracking_uri: str, run_ids, keys=HISTORY_KEYS) -> pd.DataFrame:
    """Metric histories in long format: run_id, key, step, value (sorted by run, key, step)."""
    client = _client(tracking_uri)
    rows = []
    for rid in run_ids:
        for key in keys:
            for m in client.get_metric_history(rid, key):
                rows.append((rid, key, int(m.step), float(m.value)))
    df = pd.DataFrame(rows, columns=["run_id", "key", "step", "value"])
    return df.sort_values(["run_id", "key", "step"], kind="mergesort").reset_index(drop=True)


def load_instrumentation(tracking_uri: str, run_ids, notes: list | None = None) -> dict[str, dict]:
    """The latest ``instrumentation/step_*.json`` artifact of each run that has one; a damaged one
    (not a JSON object) is left out, and named in ``notes``."""
    client = _client(tracking_uri)
    # One progress bar per downloaded file would bury the command's own output.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rid in run_ids:
            try:
                files = [f.path for f in client.list_artifacts(rid, "instrumentation")
                         if f.path.endswith(".json")]
            except Exception:  # a run whose artifact store is gone still gets a report
                continue
            if not files:
                continue
            latest = max(files)  # step numbers are zero-padded, so the name sorts by step
            local = client.download_artifacts(rid, latest, tmp)
            try:
                value = json.loads(Path(local).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                value = exc
            if isinstance(value, dict):
                out[rid] = value
            elif notes is not None:
                notes.append(f"the instrumentation artifact {latest} of run {rid[:12]} is not a JSON "
                             f"object ({_first_line(value) if isinstance(value, Exception) else type(value).__name__}); "
                             "that run is drawn without it")
    return out


def load_runset(tracking_uri: str, experiments=None, filter_string: str = "",
                history_keys=HISTORY_KEYS) -> RunSet:
    runs = load_runs(tracking_uri, experiments, filter_string)
    ids, notes = runs["run_id"].tolist(), []
    return RunSet(runs=runs, histories=load_histories(tracking_uri, ids, history_keys),
                  instrumentation=load_instrumentation(tracking_uri, ids, notes),
                  source=f"MLflow {redact(tracking_uri)}", notes=tuple(notes))


def redact(uri: str) -> str:
    """A tracking URI fit to print in a report: no user or password."""
    p = urlparse(uri)
    if p.password or p.username:
        return uri.replace(p.netloc, p.hostname + (f":{p.port}" if p.port else ""))
    return uri


# --------------------------------------------------------------------------------------------
# Snapshots
# --------------------------------------------------------------------------------------------
def _sidecars(path: Path) -> tuple[Path, Path]:
    stem = path.with_suffix("")
    return Path(f"{stem}.history.csv"), Path(f"{stem}.instrumentation.json")


def export_snapshot(runset: RunSet, path) -> list[Path]:
    """Write the run frame to ``path`` and its histories and instrumentation beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hist_path, inst_path = _sidecars(path)
    # Full precision, so tables made from a snapshot equal those made from the database.
    runset.runs.to_csv(path, index=False, float_format="%.17g")
    runset.histories.to_csv(hist_path, index=False, float_format="%.17g")
    inst_path.write_text(json.dumps(runset.instrumentation, sort_keys=True, indent=1))
    return [path, hist_path, inst_path]


def merge_snapshots(paths, without_sweeps=()) -> RunSet:
    """One run set from snapshots exported from different stores (a study trained on two
    machines, or continued after its store was lost). A run id in two snapshots is refused: it
    is one run exported twice. Runs of one config in both are kept, and `latest_per_config`
    counts them once, as it does within one store. `without_sweeps`: sweeps whose runs are left
    out with their histories and instrumentation (a sweep re-run at a new recipe replaces them)."""
    read = [import_snapshot(p) for p in paths]
    sweeps = set().union(*(rs.runs["sweep"].dropna() for rs in read))
    unknown = sorted(set(without_sweeps) - sweeps)
    if unknown:  # a typo would leave the old runs in, beside their re-run
        raise AnalysisInputError(f"--without-sweep {', '.join(unknown)}: no such sweep in the "
                                 f"snapshots (allowed: {', '.join(sorted(map(str, sweeps)))})")
    sets = [_without(rs, set(without_sweeps)) for rs in read]
    if not any(len(rs.runs) for rs in sets):
        raise AnalysisInputError("no runs left to merge: --without-sweep left out every run")
    seen: dict[str, str] = {}
    for path, rs in zip(paths, sets):
        for rid in rs.runs["run_id"]:
            if rid in seen:
                raise AnalysisInputError(f"run {rid} is in both {seen[rid]} and {path}; "
                                         "each run may come from one snapshot only")
            seen[rid] = str(path)
    rows = [r for rs in sets for r in rs.runs.astype(object).where(rs.runs.notna(), None).to_dict("records")]
    histories = pd.concat([rs.histories for rs in sets], ignore_index=True)
    histories = histories.sort_values(["run_id", "key", "step"], kind="mergesort").reset_index(drop=True)
    return RunSet(runs=_tidy(rows), histories=histories,
                  instrumentation={k: v for rs in sets for k, v in rs.instrumentation.items()},
                  source="snapshots " + ", ".join(Path(p).name for p in paths),
                  notes=tuple(n for rs in sets for n in rs.notes))


def _without(rs: RunSet, sweeps: set) -> RunSet:
    if not sweeps or "sweep" not in rs.runs:
        return rs
    return rs.only(rs.runs.loc[~rs.runs["sweep"].isin(sweeps), "run_id"])


def import_snapshot(path) -> RunSet:
    """Read a snapshot written by :func:`export_snapshot` (the sidecars are optional)."""
    path = Path(path)
    if not path.is_file():
        raise AnalysisInputError(f"snapshot not found: {path}")
    try:
        raw = pd.read_csv(path, dtype={c: object for c in TEXT_COLUMNS})
    except (pd.errors.EmptyDataError, pd.errors.ParserError) as exc:
        raise AnalysisInputError(f"snapshot {path} is not a run CSV: {exc}") from None
    missing = [c for c in ("run_id", "variant", "status", "final_val_loss") if c not in raw]
    if missing:
        raise AnalysisInputError(f"snapshot {path} lacks columns: {', '.join(missing)}")
    raw, notes = _unique_rows(raw, path)
    if raw.empty:
        raise AnalysisInputError(f"snapshot {path} holds no runs")
    rows = raw.astype(object).where(raw.notna(), None).to_dict("records")
    runs = _tidy(rows)
    histories, instrumentation, adaptive = _read_sidecars(path)
    pilot_path = path.parent / "pilot" / "runs.csv"
    pilot = (frozenset(pd.read_csv(pilot_path, usecols=["run_id"], dtype=str)["run_id"])
             if pilot_path.is_file() else frozenset())
    return RunSet(runs=runs, histories=histories, instrumentation=instrumentation,
                  source=f"snapshot {path.name}", adaptive=adaptive, pilot=pilot, notes=notes)


def _unique_rows(raw: pd.DataFrame, path: Path) -> tuple[pd.DataFrame, tuple[str, ...]]:
    """One row per run id: snapshots joined with ``cat`` repeat the header as a row and may hold
    a run twice, which would count it as two seeds. The last row of a run id is kept; (rows,
    notes saying what was dropped)."""
    notes = []
    header = (raw[["run_id", "variant", "status"]] == ["run_id", "variant", "status"]).all(axis=1)
    if header.any():
        notes.append(f"{int(header.sum())} repeated header row(s) of {path.name} dropped")
        raw = raw[~header]
    twice = raw["run_id"].duplicated(keep="last")
    if twice.any():
        ids = sorted(set(raw.loc[twice, "run_id"].astype(str)))
        shown = ", ".join(i[:12] for i in ids[:10]) + (", …" if len(ids) > 10 else "")
        notes.append(f"{int(twice.sum())} row(s) of {path.name} repeat the run id of a later row "
                     f"and were dropped, the last row of each run counting once ({shown})")
        raw = raw[~twice]
    return raw.reset_index(drop=True), tuple(notes)


def _read_sidecars(path: Path) -> tuple[pd.DataFrame, dict, dict | None]:
    """(histories, instrumentation, adaptive.json) beside a snapshot, each optional; a damaged one
    is bad input named with what is wrong (AnalysisInputError), not a parser's traceback."""
    hist_path, inst_path = _sidecars(path)
    histories = RunSet(pd.DataFrame()).histories
    if hist_path.is_file():
        try:
            histories = pd.read_csv(hist_path, dtype={"run_id": str, "key": str})
        except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
            raise AnalysisInputError(f"{hist_path} is not a history CSV: {_first_line(exc)}") from None
        missing = [c for c in ("run_id", "key", "step", "value") if c not in histories]
        bad = [c for c in ("step", "value") if c in histories
               and pd.to_numeric(histories[c], errors="coerce").isna().gt(histories[c].isna()).any()]
        if missing or bad:
            raise AnalysisInputError(f"{hist_path} is not a history CSV: " + (
                f"lacks columns {', '.join(missing)}" if missing else f"non-numeric {', '.join(bad)}")
                + " (expected run_id, key, step, value as `export` writes)")
    instrumentation = _read_json(inst_path, dict, "an object of run id → instrumentation") or {}
    # python -m analysis.adaptive --out <the snapshot's folder> writes it
    adaptive = _read_json(path.parent / "adaptive.json", dict, "the object analysis.adaptive writes")
    if adaptive is not None and not ({"rule", "comparisons"} <= set(adaptive)
                                     and isinstance(adaptive["comparisons"], list)):
        raise AnalysisInputError(f"{path.parent / 'adaptive.json'} lacks its rule or comparisons "
                                 "(expected the file python -m analysis.adaptive --out writes)")
    return histories, instrumentation, adaptive


def _read_json(path: Path, kind: type, expected: str):
    """The JSON value of ``path`` if the file exists (None if not); bad input if it is not JSON
    of ``kind``."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AnalysisInputError(f"{path} is not JSON: {_first_line(exc)}") from None
    if not isinstance(value, kind):
        raise AnalysisInputError(f"{path} holds a {type(value).__name__}; expected {expected}")
    return value


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
