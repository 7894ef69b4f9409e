"""A run's folder under the checkpoint root: its identity (the effective config's hash, so a rerun
finds its folder and a changed config is a new run), its lock (one process per folder; rank 0 alone
writes under torchrun), its checkpoints (written whole or not at all, each carrying a digest of its
content and the run's identity, `last.pt` with `previous.pt` to fall back on) and `run.json` (the
MLflow run id, the status, the final metrics). docs/HARNESS.md, "Resume", says how they are used.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from harness.config import flatten
from harness.config import NEUTRAL, NOT_IDENTITY
from harness.pruning import TrialNotRun
from harness.config import PROJECT_ROOT


# --- Replace a file all at once: readers see the old file or the new one, never half of one
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows cannot open folders; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call write(tmp_path), fsync it, rename it onto `path`; on any error remove the temp file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


log = logging.getLogger(__name__)

CHECKPOINT = "last.pt"
PREVIOUS = "previous.pt"  # the checkpoint before last.pt: the fallback when last.pt cannot be trusted
RECORD = "run.json"


class RunBusy(TrialNotRun):
    """Another live process holds this run's folder (a sweep voids such a trial: harness.pruning)."""


class CheckpointUnreadable(ValueError):
    """No checkpoint of the folder can be trusted (truncated, bit rot, another run's): one line, exit 2."""


def digest(state: dict[str, Any]) -> str:
    """sha256 over a checkpoint's content (its "digest" entry left out): every tensor's dtype, shape
    and bytes, every other value's type and repr, in a fixed order, so the same state hashes the
    same after a save and a load whatever the file's zip layout."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != "digest"})
    return h.hexdigest()


def _feed(h, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    elif isinstance(value, dict):
        h.update(f"D{len(value)}".encode())
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"{'L' if isinstance(value, list) else 'U'}{len(value)}".encode())
        for item in value:
            _feed(h, item)
    else:
        h.update(f"{type(value).__name__}:{value!r};".encode())


def run_key(plain: dict[str, Any]) -> str:
    """A short, stable hash of the config's identity keys."""
    identity = {k: v for k, v in flatten(plain).items()
                if not k.startswith(NOT_IDENTITY) and not (k in NEUTRAL and v == NEUTRAL[k])}
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def run_folder(plain: dict[str, Any]) -> Path:
    root = Path(plain["train"]["checkpoint_dir"] or PROJECT_ROOT / "checkpoints").expanduser()
    name = f"{plain['residual']['name']}-{plain['model']['name']}-s{plain['train']['seed']}-{run_key(plain)}"
    return root.resolve() / _safe(plain["sweep"]["name"]) / _safe(name)


def creatable(folder: Path) -> OSError | None:
    """Whether `folder` can be made, tried for real and undone (no permission bit tells it for
    root or for /proc): the folders it had to make are removed again. None, or the error."""
    missing = _missing(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return error
    finally:
        for made in missing:  # deepest first
            try:
                made.rmdir()
            except OSError:
                pass
    return None


def _quiet() -> None:
    pass


def _missing(folder: Path) -> list[Path]:
    """`folder` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in str(name)) or "_"


def _torch_save(state: dict[str, Any], path: Path) -> None:
    """torch.save, a failed write reported as the OSError it is. torch's C++ writer turns a full
    disk, a quota or a file-size limit into RuntimeError("[enforce fail at inline_container.cc]
    unexpected pos ..."), which the loop would take for a bug and die on, instead of keeping the
    previous checkpoint and training on (benchmarks/RESULTS_HARNESS.md, "torch.save on a full disk")."""
    try:
        torch.save(state, path)
    except RuntimeError as error:
        if not any(w in str(error) for w in ("inline_container", "PytorchStreamWriter", "file write failed")):
            raise  # not the writer's (a CUDA fault in the copy to the host, say): a real error
        raise OSError(f"torch.save could not write {path.name}: {' '.join(str(error).split())} "
                      "(a full disk, a quota or a file-size limit)") from error


class RunFolder:
    def __init__(self, path: Path, read_only: bool = False, identity: dict[str, Any] | None = None):
        self.path = path
        self.read_only = read_only  # a torchrun rank other than 0: reads, never writes
        # what a checkpoint of this run must say it is (run_key, seed, variant); stamped on every save
        self.identity = dict(identity or {})
        self._lock_handle = None
        self._made: list[Path] = []  # the folders acquire made (deepest first)
        # last.pt may become previous.pt only once it is known good (written or verified here):
        # rotating a damaged one would overwrite the good fallback
        self._last_trusted = False

    # -- lifetime -------------------------------------------------------------------------------
    def acquire(self, fresh: bool, wait: Callable[[], None] | None = None) -> RunFolder:
        """Create (or, with fresh=True, empty) the folder and take its lock. Raises RunBusy, or
        with `wait` (called once, to say so) waits until the process holding it lets go."""
        if self.read_only:
            raise RuntimeError(f"{self.path}: a read-only view (rank != 0) cannot take the run's lock")
        while True:
            self._made = _missing(self.path)
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                handle = open(self.path / ".lock", "a+")
            except OSError:
                self._remove_made()  # a folder that cannot hold a lock file is left as it was found
                raise
            try:
                import fcntl
            except ImportError:  # Windows: no lock
                break
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if wait is None:
                    handle.close()
                    raise RunBusy(
                        f"{self.path}: another process is running this exact config; wait for it or kill it"
                    ) from None
            wait()
            wait = _quiet
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                same = os.fstat(handle.fileno()).st_ino == os.stat(self.path / ".lock").st_ino
            except OSError:
                same = False
            if same:
                break
            handle.close()  # the holder removed the folder it had made (release): take the new one
        self._lock_handle = handle
        # A writer killed mid-write (kill -9, the OOM killer) leaves its temp file (atomic_write's
        # cleanup never ran): a whole checkpoint's size per kill, never read. Holding the lock, we
        # are the folder's only writer, so every temp file here is such a leftover.
        for stale in self.path.glob(".*.tmp"):
            stale.unlink(missing_ok=True)
        if fresh:
            self.clear()
        return self

    def clear(self) -> None:
        """Empty the folder (its lock kept): the run starts again from step 0."""
        for child in self.path.iterdir():
            if child.name != ".lock":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        self._last_trusted = False

    def release(self) -> None:
        """Drop the lock. A folder this process made that holds nothing but the lock (the run was
        refused before it wrote anything) goes too: no `.lock`-only folder is left behind."""
        if self._lock_handle is not None:
            try:
                if self._made and [p.name for p in self.path.iterdir()] == [".lock"]:
                    (self.path / ".lock").unlink()  # while still holding it: no one else is inside
                    self._remove_made()
            except OSError:
                pass
            self._lock_handle.close()  # closing the file drops the flock
            self._lock_handle = None

    def _remove_made(self) -> None:
        for made in self._made:  # deepest first; a folder someone else filled meanwhile stays
            try:
                made.rmdir()
            except OSError:
                break
        self._made = []

    # -- the record (run.json) ------------------------------------------------------------------
    def record(self) -> dict[str, Any] | None:
        path = self.path / RECORD
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # an unreadable record is a run we cannot continue into; start over

    def write_record(self, **fields: Any) -> dict[str, Any]:
        record = dict(self.record() or {}, **fields, updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
        if self.read_only:
            return record
        atomic_write(self.path / RECORD, lambda tmp: tmp.write_text(json.dumps(record, indent=1, default=str)))
        return record

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, state: dict[str, Any]) -> None:
        """Write last.pt (atomically), the one it replaces kept as previous.pt."""
        if self.read_only:
            return
        state = dict(state, identity=dict(self.identity, mlflow_run_id=state.get("mlflow_run_id")))
        state["digest"] = digest(state)
        last = self.path / CHECKPOINT

        def write(tmp: Path) -> None:
            _torch_save(state, tmp)  # a failed write (full disk) leaves last.pt and previous.pt as they were
            if self._last_trusted and last.exists():
                # a crash between this rename and the one onto last.pt leaves previous.pt: still loadable
                os.replace(last, self.path / PREVIOUS)

        atomic_write(last, write)
        self._last_trusted = True

    def load(self, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
        """The newest checkpoint that proves it is this run's (last.pt, else previous.pt), or None
        when there is none. Raises CheckpointUnreadable when some exist and none can be trusted."""
        present = [self.path / name for name in (CHECKPOINT, PREVIOUS) if (self.path / name).exists()]
        if not present:
            return None
        reasons = []
        for path in present:
            state, reason = self._verified(path, map_location)
            if state is not None:
                if reasons:
                    log.warning("%s: %s; resuming from %s (step %d) instead", self.path, "; ".join(reasons),
                                path.name, state["step"])
                self._last_trusted = path.name == CHECKPOINT
                return state
            reasons.append(f"{path} {reason}")
        # Our writes are atomic, so this is damage from outside (a copy cut short, a disk error)
        # or another run's file; training on it would record a wrong result. Files left as they are.
        raise CheckpointUnreadable(
            f"train.resume=true: {'; '.join(reasons)}; the files are left as they are; allowed: a good "
            "checkpoint of this run there (restore it), or train.resume=false to train this config from step 0")

    def _verified(self, path: Path, map_location) -> tuple[dict[str, Any] | None, str]:
        """(the checkpoint, "") when it is whole and this run's, else (None, why not)."""
        # weights_only: tensors, numbers, strings and containers only (the RNG states are stored as
        # such), so loading a checkpoint never runs pickled code.
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as error:  # torch says "corrupted" in a RuntimeError, UnpicklingError, EOFError...
            return None, f"cannot be read ({type(error).__name__}: {' '.join(str(error).split())[:200]})"
        if not isinstance(state, dict) or "step" not in state:
            return None, "cannot be read (not a training checkpoint)"
        if "digest" not in state:
            return None, "has no digest: it cannot be verified"
        if digest(state) != state["digest"]:
            return None, "is damaged (its content does not match its sha256 digest)"
        theirs = state.get("identity") or {}
        for key, value in self.identity.items():
            if value is not None and theirs.get(key) is not None and str(theirs[key]) != str(value):
                return None, f"belongs to another run ({key} {theirs[key]}, this run's is {value})"
        # Every MLflow run this folder has trained into: a run resumed into another store opens a
        # new one, and its checkpoints before the next one still name the first.
        record = self.record() or {}
        known = {i for i in [record.get("mlflow_run_id"), *record.get("mlflow_run_ids", [])] if i}
        if known and theirs.get("mlflow_run_id") and theirs["mlflow_run_id"] not in known:
            return None, (f"belongs to another run (mlflow_run_id {theirs['mlflow_run_id']}, this run's is "
                          f"{record.get('mlflow_run_id')})")
        missing = [k for k, v in self.identity.items() if v is not None and theirs.get(k) is None]
        if missing:
            return None, f"does not say which run it belongs to (no {', '.join(missing)})"
        return state, ""
