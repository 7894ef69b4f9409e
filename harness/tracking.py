"""MLflow for a run: the store (its URI checked, a SQLite store created once under a lock, the
experiment), the run (new, child or resumed; the fluent API so the Optuna sweeper and a user's own
`mlflow.log_*` see it), and its metrics, buffered and written exactly once, kept on disk while a
server is down and replayed when it answers.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import re
from contextlib import contextmanager, nullcontext
from collections.abc import Iterator

from harness.checkpoint import atomic_write

from analysis.sqlite_store import SQLITE_FULL_CHECK_BYTES, sqlite_damage  # noqa: F401  (evaluation reads them here)


# --- The store a run logs to: its URI checked, the server reached, a SQLite store created once
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
DESCRIPTION = "mlflow.note.content"  # the experiment description the UI shows
PROBE_TIMEOUT = 5.0  # seconds to reach an http(s) tracking server at start
# MLflow's HTTP client retries a dead server with exponential backoff for minutes by default; a
# training loop must not stall that long per flush. A user's own setting wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


# --------------------------------------------------------------------------------------------
# Checking a tracking URI before a run uses it
# --------------------------------------------------------------------------------------------
class TrackingUnreachable(ValueError):
    """tracking.uri cannot be used: no server answers there, or it is no store (one line)."""


SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "file", "databricks")
DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}  # database stores: default ports


def check_tracking_uri(uri: str) -> None:
    """tracking.uri checked before anything runs (one line, TrackingUnreachable): a scheme MLflow
    can store runs in, a SQLite database whose folder can exist, a server that answers."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0] if ":" in uri else ""
    if scheme not in SCHEMES and not Path(uri).is_absolute():
        raise TrackingUnreachable(f"tracking.uri={uri}: not a tracking store; allowed: "
                                  "http(s)://host:port, sqlite:///path.db, postgresql://…, mysql://…, file:/path")
    db = sqlite_path(uri)
    if db is not None:
        damage = sqlite_damage(db)
        if damage is not None:
            raise TrackingUnreachable(f"tracking.uri={uri}: {damage}; allowed: a sqlite:/// path to an MLflow "
                                      "database or to a file that does not exist yet")
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise TrackingUnreachable(f"tracking.uri={uri}: cannot create the folder {db.parent} "
                                      f"({error.strerror}); allowed: a sqlite:/// path in a writable folder") from None
        refused = _unwritable(db)
        if refused is not None:
            raise TrackingUnreachable(f"tracking.uri={uri}: {refused.filename} cannot be written ({refused.strerror}); "
                                      "allowed: a sqlite:/// path in a writable folder") from None
    check_reachable(uri)


def _unwritable(db: Path) -> OSError | None:
    """Whether SQLite could write `db`: the file itself, and its folder (its journal goes there),
    tried for real (no permission bit tells it for root or a read-only mount). MLflow's own error
    is about 200 lines of retries and a SQLAlchemy traceback."""
    import tempfile

    try:
        if db.exists():
            with open(db, "r+b"):
                pass
        handle, probe = tempfile.mkstemp(prefix=".attnres-probe-", dir=db.parent)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        if error.filename is None:
            error.filename = str(db.parent)
        return error
    return None


def check_reachable(uri: str, timeout: float = PROBE_TIMEOUT, option: str = "tracking.uri=") -> None:
    """For an http(s) URI, GET <uri>/health within `timeout` seconds, else TrackingUnreachable
    (its line names the URI as `option` gave it: run.py's tracking.uri= or a command's flag).
    A database URI (postgresql, mysql, mssql) is checked by `check_database`; sqlite and file
    stores are opened by the client itself, which fails fast."""
    import urllib.error
    import urllib.request

    if uri.split(":", 1)[0].split("+", 1)[0] in DATABASE_PORTS:
        check_database(uri, timeout, option)
        return
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as response:
            response.read(64)
    except urllib.error.HTTPError:
        return  # something answers HTTP there (a proxy without /health): let MLflow judge it
    except (OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or error
        allowed = " or tracking=off" if option == "tracking.uri=" else ""
        raise TrackingUnreachable(
            f"{option}{uri}: no MLflow server answers there within {timeout:.0f} s ({reason}); "
            f"allowed: a running server's URI, a sqlite:/// path{allowed}"
        ) from None


def redact(url: str) -> str:
    """A database URL as a message or a tag may show it: the password as *** (logs outlive a
    password); the Optuna sweeper's storage URLs too."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def check_database(uri: str, timeout: float = PROBE_TIMEOUT, option: str = "tracking.uri=") -> None:
    """A database URI used as the tracking store directly: its driver installed, its host
    answering within `timeout`, one connection accepted; else TrackingUnreachable (one line, the
    password hidden). MLflow's own store retries a failed connection ten times with backoff
    (~100 s) and then ends in a traceback, after the run's folder was made."""
    import socket

    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError
    from sqlalchemy.pool import NullPool

    shown = redact(uri)
    allowed = "allowed: a running database's URI with an installed driver (e.g. postgresql+psycopg2://…), " \
              "an http(s):// server, a sqlite:/// path" + (" or tracking=off" if option == "tracking.uri=" else "")
    try:
        url = make_url(uri)
        url.get_dialect().import_dbapi()
    except (ArgumentError, ImportError) as error:  # an unknown driver name, or one not installed
        raise TrackingUnreachable(f"{option}{shown}: no database driver for it here "
                                  f"({' '.join(str(error).split())}); {allowed}") from None
    if url.host:  # (none: a local socket named in the query, nothing to probe over TCP)
        port = url.port or DATABASE_PORTS[url.get_backend_name()]
        try:
            socket.create_connection((url.host, port), timeout=timeout).close()
        except OSError as error:
            raise TrackingUnreachable(f"{option}{shown}: no database answers at {url.host}:{port} within "
                                      f"{timeout:.0f} s ({error}); {allowed}") from None
    # The host answers; one real connection tells a wrong user, password or database name in
    # seconds (postgresql and mysql drivers take connect_timeout; others keep their default).
    bounded = {"connect_timeout": max(1, int(timeout))} if url.get_backend_name() in ("postgresql", "mysql") else {}
    engine = create_engine(url, poolclass=NullPool, connect_args=bounded)
    try:
        with engine.connect():
            pass
    except Exception as error:  # the driver's OperationalError, whatever the driver
        reason = " ".join(str(getattr(error, "orig", None) or error).split())[:300]
        raise TrackingUnreachable(f"{option}{shown}: the database refused the connection ({reason}); "
                                  f"{allowed}") from None
    finally:
        engine.dispose()


# --------------------------------------------------------------------------------------------
# Store and experiment
# --------------------------------------------------------------------------------------------
def sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite:// URI (None for servers and in-memory databases)."""
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(uri).database
    return None if database in (None, "", ":memory:") else Path(database).expanduser()


@contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive inter-process lock: flock on the folder itself, so no lock file is created or
    left behind. Enough on one machine, the only place a SQLite file can be shared anyway."""
    try:
        import fcntl
    except ImportError:  # Windows: no fcntl; create the store with one process first there
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    handle = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the descriptor closes
        yield
    finally:
        os.close(handle)


def store_lock(uri: str):
    """The inter-process lock for creating the SQLite store at `uri` (no-op for servers): the
    database's folder, locked as the Optuna sweeper locks it for its own database and its MLflow
    client (hydra_plugins/attnres_optuna_sweeper/_storage.py), so no two of them ever migrate a
    fresh store at once. (It was a file per store in the temporary folder, never removed: a test
    run left a hundred, and the sweeper's client did not take it.)"""
    path = sqlite_path(uri)
    return nullcontext() if path is None else folder_lock(path.resolve().parent)


def prepare_server(uri: str, option: str = "tracking.uri=") -> None:
    """For an http(s) store: check that a server answers (TrackingUnreachable, one line, within
    PROBE_TIMEOUT) and bound MLflow's retries (HTTP_DEFAULTS) before any client talks to it."""
    check_reachable(uri, option=option)
    if uri.startswith(("http://", "https://")):
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)


def client_for(uri: str):
    """An MlflowClient on `uri`, creating (and migrating) a SQLite store once, under the lock."""
    from mlflow import MlflowClient

    prepare_server(uri)
    path = sqlite_path(uri)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    with store_lock(uri):
        if path is not None:
            _forget_stale_engine(uri, path)
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)  # forces the schema creation/migration now
        if path is not None:
            _OPENED[uri] = _file_identity(path)
    return client


_OPENED: dict[str, Any] = {}  # per SQLite URI: the file this process's MLflow engine opened


def _forget_stale_engine(uri: str, path: Path) -> None:
    """MLflow keeps one engine per database URI for the process; its pooled connections hold the
    file they opened. A store deleted or replaced since (a multirun's next job, a rerun in the same
    process) would be written through them into the deleted file: the engine is dropped."""
    if uri not in _OPENED or _OPENED[uri] == _file_identity(path):
        return
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        engine = SqlAlchemyStore._engine_map.pop(uri, None)  # (MLflow's cache; absent in another version: nothing to drop)
    except (ImportError, AttributeError):
        return
    if engine is not None:
        engine.dispose()


def experiment_id(client, name: str, uri: str) -> str:
    """Get or create experiment `name`, tagged so the MLflow 3 UI opens it as model training."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        location = None
        db = sqlite_path(uri)
        if db is not None:
            # one folder under mlruns/: "..", or a name of dots, would put the artifacts beside the store
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip(".") or "_"
            location = (db.resolve().parent / "mlruns" / safe).as_uri()
        try:
            exp_id = client.create_experiment(name, artifact_location=location)
        except MlflowException:  # another process created it a moment ago
            exp_id = client.get_experiment_by_name(name).experiment_id
    else:
        exp_id = found.experiment_id
        if found.lifecycle_stage == "deleted":  # deleted in the UI: runs cannot start in it
            client.restore_experiment(exp_id)
    mark_model_training(client, exp_id)
    return exp_id


def mark_model_training(client, exp_id: str) -> None:
    """Tag experiment `exp_id` as model training (RUN_SCHEMA), and give it a description that links
    to its runs table when it has none.

    MLflow 3's UI ignores the tag when it picks a page: a browser that has not switched the
    sidebar to "Model training" opens every experiment on the GenAI overview, where the
    description shows; its link opens the runs table in model-training mode.

    Two processes starting together (the workers of one Optuna study) may both find a tag
    missing and both set it; on a tracking server over PostgreSQL the second insert then fails on
    the tag's unique key. The tag being there is what was asked, so that failure is not an error."""
    key, value = EXPERIMENT_KIND
    _set_tag(client, exp_id, key, lambda tags: tags.get(key) == value, value)
    _set_tag(client, exp_id, DESCRIPTION, lambda tags: bool(tags.get(DESCRIPTION)), runs_table_note(exp_id))


def runs_table_note(exp_id: str) -> str:
    return (f"Model-training runs: [open the runs table]({runs_table_link(exp_id)}). MLflow opens "
            "experiments on its GenAI overview unless the sidebar's switch says \"Model training\".")


def runs_table_link(exp_id: str) -> str:
    """The UI's address (after the server's root) of the experiment's runs table, model-training view."""
    return f"#/experiments/{exp_id}/runs?workflowType=machine_learning"


def _set_tag(client, exp_id: str, key: str, done, value: str) -> None:
    from mlflow.exceptions import MlflowException

    if done(client.get_experiment(exp_id).tags):
        return
    try:
        client.set_experiment_tag(exp_id, key, value)
    except MlflowException:
        if not done(client.get_experiment(exp_id).tags):
            raise


log = logging.getLogger(__name__)

MAX_PARAM_VALUE = 6000  # MLflow's limit on a param's value
MAX_BATCH = 900  # log_batch takes at most 1000 metrics per call
PENDING_METRICS = "metrics_pending.jsonl"  # in the run folder: metrics the server did not take yet
PENDING_TAGS = "tags_pending.json"
PENDING_ARTIFACTS = "artifacts_pending"
END_PENDING = "end_pending.json"  # the run's end status, when the server was down at its end
RETRY_SECONDS = 30.0  # while the server is down, a flush tries it at most this often
FAILURE_TAGS = ("attnres.failure", "attnres.failure_step")  # set when a run ends other than FINISHED
# Recomputed steps of a resumed run compared with what was logged before the crash: train/loss
# (a mean over the log window, checkpointed), equal on CPU; a GPU's reduction order moves it ~1e-6.
RECOMPUTED_CHECK = ("train/loss",)
RECOMPUTED_RTOL = 1e-3


def param_value(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - 3] + "..."


# --------------------------------------------------------------------------------------------
# Trackers
# --------------------------------------------------------------------------------------------
class NullTracker:
    """Tracking off (or a rank other than 0): every call does nothing."""

    run_id: str | None = None
    enabled = False

    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def flush(self, force: bool = False) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_dict(self, data: Any, artifact_file: str) -> None: ...
    def log_figure(self, figure: Any, artifact_file: str) -> None: ...
    def log_file(self, local_path: str, artifact_dir: str | None = None) -> None: ...
    def end(self, status: str, tags: Mapping[str, Any] | None = None) -> None: ...


class MlflowTracker(NullTracker):
    enabled = True

    def __init__(self, client, run_id: str, flush_seconds: float, resumed: bool, pending_dir: Path | None = None,
                 uri: str | None = None):
        self.client, self.run_id = client, run_id
        self.uri = uri
        self._store = _file_identity(sqlite_path(uri)) if uri else None  # a SQLite store: which file it was
        self._gone: str | None = None  # why the store cannot take this run's records any more
        self.flush_seconds = flush_seconds
        self.resumed = resumed
        self.pending_dir = pending_dir  # None: a failed flush raises (no run folder to keep it in)
        self._buffer: list = []
        self._last_flush = time.monotonic()
        self._offline_since: float | None = None  # monotonic time of the first failed flush
        self._retry_at = 0.0
        if pending_dir is not None and self.has_pending():
            self._replay()  # before the floor: what waited in the files counts as logged
        self._logged: dict[str, dict[int, float]] = {}
        self._mismatch_said = False
        self._floor: dict[str, int] = self._logged_steps() if resumed else {}
        self._ended = False

    @classmethod
    def start(
        cls, uri: str, experiment: str, run_name: str, tags: Mapping[str, str],
        parent_run_id: str | None = None, resume_run_id: str | None = None,
        system_metrics: bool = False, flush_seconds: float = 5.0, pending_dir: Path | None = None,
    ) -> MlflowTracker:
        """A new run (a child of `parent_run_id` when given), or `resume_run_id` reopened."""
        import mlflow

        client = client_for(uri)
        exp_id = experiment_id(client, experiment, uri)
        mlflow.set_tracking_uri(uri)
        resumed = resume_run_id is not None and _run_exists(client, resume_run_id)
        if resumed:
            if pending_dir is not None:
                (pending_dir / END_PENDING).unlink(missing_ok=True)  # it runs again: no end to send
            run = mlflow.start_run(run_id=resume_run_id, log_system_metrics=system_metrics)
            # How it ended before (interrupted, or failed and retried) no longer describes it.
            for key in FAILURE_TAGS:
                if key in run.data.tags:
                    client.delete_tag(resume_run_id, key)
        else:
            if resume_run_id is not None:
                log.warning("MLflow run %s of the checkpoint is not in %s: starting a new run", resume_run_id, uri)
            if pending_dir is not None and resume_run_id is not None:
                _set_aside(pending_dir, resume_run_id, uri)  # the records of a run its store lost: kept
            elif pending_dir is not None:
                _clear_pending(pending_dir)
            run = mlflow.start_run(
                experiment_id=exp_id, run_name=run_name, parent_run_id=parent_run_id,
                tags=dict(tags), log_system_metrics=system_metrics,
            )
        try:
            return cls(client, run.info.run_id, flush_seconds, resumed=resumed, pending_dir=pending_dir, uri=uri)
        except BaseException:
            mlflow.end_run(status="FAILED")  # never leave an active run behind in this process
            raise

    def _logged_steps(self) -> dict[str, int]:
        """Per metric key, the last step already in MLflow (what a resumed run must not repeat);
        the logged values of RECOMPUTED_CHECK kept to compare the recomputed steps with."""
        floor = {}
        for key in self.client.get_run(self.run_id).data.metrics.keys():
            history = self.client.get_metric_history(self.run_id, key)
            floor[key] = max(m.step for m in history)
            if key in RECOMPUTED_CHECK:
                self._logged[key] = {m.step: m.value for m in history}
        return floor

    def _check_recomputed(self, key: str, value: float, step: int) -> None:
        """A resumed run recomputes the steps after its checkpoint that were logged before the
        crash: deterministic data and RNG make them equal up to float noise. A larger gap means
        the resumed state is not the state that logged them (a wrong or damaged checkpoint, or a
        changed code path): said once, and tagged on the run."""
        logged = self._logged.get(key, {}).get(step)
        if logged is None or self._mismatch_said or not math.isfinite(logged):
            return
        if abs(value - logged) <= RECOMPUTED_RTOL * max(1.0, abs(logged)):
            return
        self._mismatch_said = True
        message = (f"{key} at step {step}: logged {logged:.6g} before the resume, recomputed {value:.6g} "
                   f"(beyond the relative tolerance {RECOMPUTED_RTOL:g})")
        log.warning("the resumed run does not recompute what it logged: %s; the checkpoint or the code "
                    "is not what produced those steps", message)
        self.set_tags({"attnres.resume_mismatch": message})

    # -- params, tags, metrics ------------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        items = [Param(k[:250], param_value(v)) for k, v in params.items()]
        try:
            for i in range(0, len(items), 100):  # log_batch takes at most 100 params per call
                self.client.log_batch(self.run_id, params=items[i : i + 100])
        except MlflowException as error:
            if not self.resumed:
                raise
            # A resumed run logged its params at its start; a key outside the run's identity
            # (tracking.*) may differ now, and MLflow params are write-once.
            log.warning("params of the resumed run kept as first logged: %s", str(error).splitlines()[0])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        if self._offline_since is None or self.pending_dir is None:
            try:
                with self._store_call():
                    self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
                return
            except Exception as error:
                if self.pending_dir is None:
                    raise
                self._go_offline(error)
        path = self.pending_dir / PENDING_TAGS
        waiting = json.loads(path.read_text()) if path.exists() else {}
        waiting.update({k: str(v) for k, v in tags.items()})
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(waiting)))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for key, value in metrics.items():
            if step <= self._floor.get(key, -1):
                self._check_recomputed(key, float(value), int(step))
                continue  # already in MLflow from before the resume
            self._buffer.append(Metric(key, float(value), now, int(step)))
        if len(self._buffer) >= MAX_BATCH or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self, force: bool = False) -> None:
        """Write the buffered metrics. While the server is down they go to the pending file
        instead (the loop goes on); the server is retried at most every RETRY_SECONDS (`force`:
        now), and the first flush that reaches it replays the files first, in order."""
        self._last_flush = time.monotonic()
        if self._offline_since is not None and (self._gone or (not force and time.monotonic() < self._retry_at)):
            self._spill()
            return
        try:
            with self._store_call():
                if self.pending_dir is not None and self.has_pending():
                    self._replay()
                while self._buffer:
                    self.client.log_batch(self.run_id, metrics=self._buffer[:MAX_BATCH])
                    self._buffer = self._buffer[MAX_BATCH:]  # dropped only once written
        except Exception as error:  # the server's errors come as MlflowException or requests' own
            if self.pending_dir is None:
                raise
            self._go_offline(error)
            self._spill()
            return
        if self._offline_since is not None:
            log.warning("tracking server reachable again after %.0f s: pending metrics replayed",
                        time.monotonic() - self._offline_since)
            self._offline_since = None

    # -- the pending files (server down) --------------------------------------------------------
    def has_pending(self) -> bool:
        return any((self.pending_dir / n).exists() for n in (PENDING_METRICS, PENDING_TAGS, PENDING_ARTIFACTS))

    def _go_offline(self, error: Exception) -> None:
        if self._offline_since is None:
            self._offline_since = time.monotonic()
            if self._gone:
                log.warning("%s; training goes on, its records are kept in %s", self._gone, self.pending_dir)
            else:
                log.warning("tracking server unreachable (%s); training goes on, metrics are kept in %s "
                            "and replayed when it is back", " ".join(str(error).split())[:300],
                            self.pending_dir / PENDING_METRICS)
        self._retry_at = time.monotonic() + RETRY_SECONDS

    @contextmanager
    def _store_call(self) -> Iterator[None]:
        """Around the calls that write to the store: a SQLite file deleted or replaced since the run
        opened is not written (MLflow would write to the deleted file's inode, or into a new store
        that does not hold this run); MLflow's own logged tracebacks of a failing database are
        held back while the run folder keeps the records (one warning says it instead)."""
        if self._store is not None and self._gone is None:
            now = _file_identity(self._store[0])
            if now != self._store:
                self._gone = (f"the tracking store {self.uri} was {'deleted' if now is None else 'replaced by another file'} "
                              f"during run {self.run_id}")
        if self._gone:
            raise StoreGone(self._gone)
        if self.pending_dir is None:
            yield
            return
        quiet = logging.getLogger("mlflow.store.db.utils")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            quiet.setLevel(level)

    def _spill(self) -> None:
        """Append the buffer to the pending file, synced to disk (a crash then loses nothing)."""
        if not self._buffer:
            return
        with open(self.pending_dir / PENDING_METRICS, "a") as handle:
            handle.write("".join(_metric_line(m) for m in self._buffer))
            handle.flush()
            os.fsync(handle.fileno())
        self._buffer = []

    def _replay(self) -> None:
        """Send the pending metrics, artifacts and tags to MLflow, removing what was sent. Raises
        while the server is still down (the unsent rest stays)."""
        from mlflow.entities import Metric, RunTag

        path = self.pending_dir / PENDING_METRICS
        if path.exists():
            waiting = _pending_metrics(path, Metric)
            sent = 0
            try:
                while sent < len(waiting):
                    self.client.log_batch(self.run_id, metrics=waiting[sent : sent + MAX_BATCH])
                    sent += MAX_BATCH
            finally:
                rest = waiting[sent:]
                if rest:  # never send a point twice: keep only what did not go
                    atomic_write(path, lambda tmp: tmp.write_text("".join(_metric_line(m) for m in rest)))
                else:
                    path.unlink()
        kept = self.pending_dir / PENDING_ARTIFACTS
        if kept.exists():
            for file in sorted(f for f in kept.rglob("*") if f.is_file()):
                folder = file.parent.relative_to(kept).as_posix()
                self.client.log_artifact(self.run_id, str(file), None if folder == "." else folder)
                file.unlink()
            shutil.rmtree(kept)
        tags = self.pending_dir / PENDING_TAGS
        if tags.exists():
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in json.loads(tags.read_text()).items()])
            tags.unlink()

    # -- artifacts ------------------------------------------------------------------------------
    # While the server is down, an artifact is kept at <run folder>/artifacts_pending/<its path>
    # and uploaded by the replay (the loop's instrumentation records must not stop training).
    def _artifact(self, upload, keep, artifact_file: str) -> None:
        if self._offline_since is None or self.pending_dir is None:
            try:
                with self._store_call():
                    upload()
                return
            except Exception as error:
                if self.pending_dir is None:
                    raise
                self._go_offline(error)
        target = self.pending_dir / PENDING_ARTIFACTS / artifact_file
        target.parent.mkdir(parents=True, exist_ok=True)
        keep(target)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._artifact(lambda: self.client.log_text(self.run_id, text, artifact_file),
                       lambda target: target.write_text(text), artifact_file)

    def log_dict(self, data: Any, artifact_file: str) -> None:
        # json.dumps writes NaN for the invisible cells of the depth-weight matrix (RUN_SCHEMA.md)
        self.log_text(json.dumps(data, indent=1), artifact_file)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """Drawn here first: a figure matplotlib cannot draw (a run name holding `$$` is read as
        mathtext) is a warning, not a store gone offline and then a run FAILED after training."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="attnres-figure-") as tmp:
            local = Path(tmp) / Path(artifact_file).name
            try:
                figure.savefig(local)
            except (ValueError, RuntimeError) as error:
                log.warning("plot %s not drawn (%s); the run goes on without it", artifact_file,
                            " ".join(str(error).split())[:200])
                return
            folder = Path(artifact_file).parent.as_posix()
            self.log_file(str(local), None if folder == "." else folder)

    def log_file(self, local_path: str, artifact_dir: str | None = None) -> None:
        name = (Path(artifact_dir or "") / Path(local_path).name).as_posix()
        self._artifact(lambda: self.client.log_artifact(self.run_id, local_path, artifact_dir),
                       lambda target: shutil.copyfile(local_path, target), name)

    # -- end ------------------------------------------------------------------------------------
    def end(self, status: str, tags: Mapping[str, Any] | None = None) -> None:
        """Flush, tag and end the run with an MLflow status (FINISHED, FAILED, KILLED).

        attnres.status carries the harness's own status (PRUNED is KILLED in MLflow's terms).
        Where the server is down at the end, the metrics, the tags and the end itself wait in the
        run folder and are sent by the next command that opens it (`replay_folder`); the run
        stays RUNNING in MLflow until then."""
        if self._ended:
            return
        self._ended = True
        import mlflow

        mlflow_status = "KILLED" if status == "PRUNED" else status
        try:
            self.flush(force=True)
            self.set_tags({"attnres.status": status, **(tags or {})})
        finally:
            active = mlflow.active_run()
            try:
                if self.pending_dir is not None and self.has_pending():
                    raise ConnectionError("pending metrics or tags not sent")
                with self._store_call():
                    if active is not None and active.info.run_id == self.run_id:
                        mlflow.end_run(status=mlflow_status)
                    else:
                        self.client.set_terminated(self.run_id, status=mlflow_status)
            except Exception:
                if self.pending_dir is None:
                    raise
                if mlflow.active_run() is not None and mlflow.active_run().info.run_id == self.run_id:
                    mlflow.tracking.fluent._active_run_stack.get().pop()  # this process is done with it
                atomic_write(self.pending_dir / END_PENDING, lambda tmp: tmp.write_text(json.dumps({"status": mlflow_status})))
                if self._gone:
                    print(f"warning: {self._gone}: its metrics, tags and artifacts since then are kept in "
                          f"{self.pending_dir}; put that store back and rerun the same command to send them, or "
                          "rerun with train.resume=false to train it again into a new store", file=sys.stderr, flush=True)
                else:
                    print(f"warning: the MLflow server is unreachable: run {self.run_id} stays RUNNING there; "
                          f"its metrics wait in {self.pending_dir / PENDING_METRICS}. Rerun the same command "
                          "when the server is back to send them", file=sys.stderr, flush=True)


class StoreGone(ConnectionError):
    """The SQLite store a run logs to was deleted or replaced while it ran."""


class RunNotInStore(ValueError):
    """A finished run's MLflow run is not in the store its record names (one line, what to do)."""


def _file_identity(path: Path | None) -> tuple[Path, int, int] | None:
    """(path, device, inode) of an existing file, else None."""
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return path, st.st_dev, st.st_ino


def _metric_line(m) -> str:
    return json.dumps({"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step}) + "\n"


def _pending_metrics(path: Path, metric) -> list:
    """The metrics of a pending file. A line cut short (the process killed, or the disk full,
    in the middle of an append) is skipped with a warning: unreadable, it would stop every replay,
    and with it the run's start on every rerun. What it held is not lost: appends happen at flushes,
    which come before the checkpoint they precede, so its steps are recomputed on resume."""
    waiting, torn = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            waiting.append(metric(**json.loads(line)))
        except (ValueError, TypeError):
            torn += 1
    if torn:
        log.warning("%s: %d line(s) cut short by an interrupted write skipped", path, torn)
    return waiting


def _clear_pending(folder: Path) -> None:
    for name in (PENDING_METRICS, PENDING_TAGS, END_PENDING):
        (folder / name).unlink(missing_ok=True)
    shutil.rmtree(folder / PENDING_ARTIFACTS, ignore_errors=True)


def _set_aside(folder: Path, run_id: str, uri: str) -> None:
    """Move what waited for MLflow run `run_id` (not in its store any more) to <folder>/unsent_<run id>/
    and say how to send it once that store is back: a new run starts in the folder, and they are
    not its records (they were deleted here before)."""
    names = [n for n in (PENDING_METRICS, PENDING_TAGS, PENDING_ARTIFACTS, END_PENDING) if (folder / n).exists()]
    if not names:
        return
    aside = folder / f"unsent_{run_id}"
    aside.mkdir(exist_ok=True)
    for name in names:
        os.replace(folder / name, aside / name)
    log.warning("the records MLflow run %s did not receive are kept in %s; to send them once the store that holds "
                "the run is back (at %s, if put back where it was): python -m harness.tracking <its URI> %s %s",
                run_id, aside, redact(uri), run_id, aside)


def replay_folder(uri: str, run_id: str, folder: Path) -> bool:
    """Send what a run left waiting in `folder` while its store could not be reached (metrics,
    tags, its end). True when nothing waits any more; False (with a warning) when the store is
    still unreachable. RunNotInStore when the store answers but does not hold the run (deleted, or
    the store replaced since): a finished run it does not hold is not "finished" there."""
    names = (PENDING_METRICS, PENDING_TAGS, PENDING_ARTIFACTS, END_PENDING)
    waiting = any((folder / n).exists() for n in names)
    db = sqlite_path(uri)
    if db is not None and not db.exists():  # (not created: MLflow would make an empty store there)
        if not db.is_absolute():  # relative to the folder the run started in, unknown here: no evidence
            log.warning("run %s: its store %s is not found from this folder; nothing checked or sent", run_id, uri)
            return False
        raise RunNotInStore(_not_held(uri, run_id, folder, waiting, "no such file"))
    try:
        client = client_for(uri)
        if not _run_exists(client, run_id):
            raise RunNotInStore(_not_held(uri, run_id, folder, waiting, "the store has no such run"))
        if not waiting:
            return True
        tracker = MlflowTracker(client, run_id, 5.0, resumed=False, pending_dir=folder)
        end = folder / END_PENDING
        if end.exists():
            tracker.client.set_terminated(run_id, status=json.loads(end.read_text())["status"])
            end.unlink()
    except RunNotInStore:
        raise
    except Exception as error:
        log.warning("run %s: pending metrics in %s not sent yet (%s)", run_id, folder,
                    " ".join(str(error).split())[:300])
        return False
    log.warning("run %s: metrics logged while the tracking server was down are now in MLflow", run_id)
    return True


def _not_held(uri: str, run_id: str, folder: Path, waiting: bool, why: str) -> str:
    kept = f"; what it logged after the store went is kept in {folder}" if waiting else ""
    return (f"{folder.name}: MLflow run {run_id} is not in tracking.uri={redact(uri)} ({why}: "
            f"the store was deleted or replaced, or the run deleted, since){kept}; allowed: that store put back "
            "(the same command then sends what waits), or train.resume=false to train it again into this store")


def _run_exists(client, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        return False
    return run.info.lifecycle_stage == "active"


def end_replaced_run(uri: str, run_id: str, reason: str) -> None:
    """End the MLflow run of a folder started again from step 0 (train.resume=false) KILLED, with
    the reason, if it is still RUNNING: one config, one live run. A store that cannot be reached
    is a warning: the new run does not wait for the old one's bookkeeping."""
    try:
        client = client_for(uri)
        if not _run_exists(client, run_id) or client.get_run(run_id).info.status != "RUNNING":
            return
        client.set_tag(run_id, "attnres.failure", reason)
        client.set_tag(run_id, "attnres.status", "KILLED")
        client.set_terminated(run_id, status="KILLED")
    except Exception as error:  # noqa: BLE001 - the old run's end is bookkeeping; the new run goes on
        log.warning("MLflow run %s (replaced) not ended: %s", run_id, " ".join(str(error).split())[:300])


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.tracking URI RUN_ID FOLDER`: send what a run left waiting in FOLDER."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m harness.tracking", description=main.__doc__)
    parser.add_argument("uri")
    parser.add_argument("run_id")
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"error: {args.folder}: no such folder", file=sys.stderr)
        return 2
    try:
        sent = replay_folder(args.uri, args.run_id, args.folder)
    except RunNotInStore as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if sent and args.folder.name.startswith("unsent_") and not any(args.folder.iterdir()):
        args.folder.rmdir()
    return 0 if sent else 1


if __name__ == "__main__":
    raise SystemExit(main())
