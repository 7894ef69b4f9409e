"""Where studies live: the storage URL, opening it safely from many processes, trial heartbeats.

Default ``optuna.db`` beside ``mlflow.db`` where the sweep starts, so the same command continues
the same studies; any SQLAlchemy URL otherwise. Workers starting together take turns creating a
fresh SQLite file (a lock) and retry on a fresh server database; heartbeats tell a live trial
from one whose worker died.
"""

from __future__ import annotations

import os
import random
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, ContextManager

import optuna
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import (
    ArgumentError,
    IntegrityError,
    NoSuchModuleError,
    ProgrammingError,
)

from harness.tracking import folder_lock, redact  # the lock MLflow stores take; the password out of messages

from ._ledger import FAILURE_ATTR, VOID_ATTR
from .settings import SweeperConfigError

DEFAULT_STORAGE_FILE = "optuna.db"
SERVER_INIT_ATTEMPTS = 5  # opening a server storage whose schema another worker is creating


def resolve_url(storage: str | None, base_dir: Path) -> str:
    """The storage URL to use, with a relative SQLite path made absolute against ``base_dir`` (a job
    that changes directory must not open a second, empty database)."""
    url = storage or f"sqlite:///{DEFAULT_STORAGE_FILE}"
    try:
        make_url(url).get_dialect()  # an unknown database kind (`postgres://`, a typo) too
    except ArgumentError as error:  # NoSuchModuleError is one
        reason = "unknown database kind; " if isinstance(error, NoSuchModuleError) else ""
        raise SweeperConfigError(
            f"hydra.sweeper.storage={redact(url)!r} is not a database URL ({reason}"
            "e.g. sqlite:///optuna.db or postgresql://user@host/db)"
        ) from None
    try:
        return absolute_sqlite(url, base_dir)
    except OSError as error:
        raise SweeperConfigError(
            f"hydra.sweeper.storage={redact(url)!r}: cannot create its folder ({error})"
        ) from None


def absolute_sqlite(url: str, base_dir: Path) -> str:
    """``url`` with a relative SQLite file path made absolute (its folder created); else as is."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return url
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return url
    path = Path(parsed.database).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    path.parent.mkdir(parents=True, exist_ok=True)
    return parsed.set(database=str(path)).render_as_string(hide_password=False)


def sqlite_init_lock(url: str) -> ContextManager[object]:
    """An inter-process lock for creating a SQLite database at ``url``; no-op for servers.

    Two workers creating one fresh file's schema at once would make one fail. ``flock`` on the
    folder (the lock the MLflow stores take) is enough on the one machine a SQLite file can be
    shared on, and leaves no lock file behind."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return nullcontext()
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return nullcontext()
    return folder_lock(Path(parsed.database).expanduser().resolve().parent)


def open_storage(
    url: str, heartbeat_interval: int, grace_period: int | None
) -> optuna.storages.RDBStorage:
    is_sqlite = make_url(url).get_backend_name() == "sqlite"
    attempt = 1
    while True:
        try:
            return _open_storage(url, is_sqlite, heartbeat_interval, grace_period)
        except (IntegrityError, ProgrammingError):
            # Another worker created the schema at the same moment (a duplicate table or version
            # row); its transaction won, so opening again finds the schema complete.
            if is_sqlite or attempt == SERVER_INIT_ATTEMPTS:
                raise
            time.sleep(random.uniform(0.2, 1.0) * attempt)
            attempt += 1


def _open_storage(
    url: str, is_sqlite: bool, heartbeat_interval: int, grace_period: int | None
) -> optuna.storages.RDBStorage:
    engine_kwargs = {"connect_args": {"timeout": 60}} if is_sqlite else {}
    try:
        with sqlite_init_lock(url), warnings.catch_warnings():
            # Heartbeats are flagged experimental; the sweeper relies on them knowingly.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = optuna.storages.RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=heartbeat_interval,
                grace_period=grace_period,
            )
            if is_sqlite:
                event.listen(storage.engine, "connect", _sqlite_pragmas)
                storage.engine.dispose()  # connections made so far lack the pragmas
            return storage
    except ImportError as error:  # a server URL whose driver is not installed
        raise SweeperConfigError(f"storage {redact(url)}: {error}") from None


def _sqlite_pragmas(connection: Any, record: Any) -> None:
    # WAL: workers read while another writes; NORMAL: a commit does not wait for the disk (only a
    # power cut can lose the last commits), which matters at dozens of small commits per trial.
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def fail_stale_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Fail the trials of dead workers, so that they are run again; return them, now failed (by
    this worker or another at the same moment), so that their MLflow runs can be ended."""
    running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    if not running:
        return []
    failed = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
    # Not those their own worker ended meanwhile (a genuine failure, or void when interrupted).
    return [t for t in failed if t.number in running and not {FAILURE_ATTR, VOID_ATTR} & t.user_attrs.keys()]


@contextmanager
def heartbeat(storage: optuna.storages.RDBStorage, trial_id: int, interval: int) -> Iterator[None]:
    """Record the trial's heartbeat every ``interval`` seconds while the block runs (Optuna beats
    only inside ``Study.optimize``, which ask/tell does not use)."""
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                storage.record_heartbeat(trial_id)
            except Exception:  # a missed beat is harmless; the job must not die of it
                pass
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name=f"optuna-heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def base_directory(runtime_cwd: str | None) -> Path:
    """The directory the sweep was started from (before any job changed directory)."""
    return Path(runtime_cwd or os.getcwd())
