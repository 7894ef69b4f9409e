"""The MLflow tracking store a run logs to: checking its URI, reaching it, creating it once.

Design decisions:
- tracking.uri is checked before anything runs (`check_tracking_uri`): a scheme MLflow can store
  runs in, a SQLite database whose folder can exist, a server or database that answers. An
  http(s) URI is probed with a short timeout, so a wrong or dead server stops the run in seconds,
  before any training, naming the URI (MLflow's own client would retry for minutes); a database
  URI gets one real connection, so a wrong password shows in seconds too, hidden in the message.
- A SQLite store is created under an inter-process lock (several processes migrating a fresh
  database at once corrupt it, ECOSYSTEM.md): flock on the database's folder, the lock the Optuna
  sweeper takes for its own database and MLflow client, so the two never race each other either.
- Experiments created here on a SQLite store keep their artifacts beside the database
  (<db folder>/mlruns/<experiment>), not in whatever folder a job was started from.
- Experiments are tagged as model training (RUN_SCHEMA.md), and described with a link to their
  runs table: MLflow 3's UI opens an experiment on its GenAI overview whatever the tag says.
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager, nullcontext
from pathlib import Path
from collections.abc import Iterator

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
        if db.is_dir() or _not_sqlite(db):
            raise TrackingUnreachable(f"tracking.uri={uri}: {db} is not a SQLite database "
                                      f"({'a folder' if db.is_dir() else 'another kind of file'}); "
                                      "allowed: a sqlite:/// path to an MLflow database or to a file that does not exist yet")
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


def _not_sqlite(db: Path) -> bool:
    """A non-empty file that does not start with SQLite's header (an empty file SQLite takes as new)."""
    try:
        with open(db, "rb") as handle:
            head = handle.read(16)
    except OSError:
        return False  # absent, or unreadable: the client's own error says more
    return bool(head) and head != b"SQLite format 3\x00"


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
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)  # forces the schema creation/migration now
    return client


def experiment_id(client, name: str, uri: str) -> str:
    """Get or create experiment `name`, tagged so the MLflow 3 UI opens it as model training."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        location = None
        db = sqlite_path(uri)
        if db is not None:
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
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
