"""A run's folder under the checkpoint root: its identity, its lock, its checkpoint and its record.

Design decisions:
- **Identity = the effective config.** The folder is
  `<train.checkpoint_dir>/<sweep.name>/<variant>-<model>-s<seed>-<hash>`, the hash taken over
  the effective config minus the keys that cannot change what a run computes (where it logs,
  whether a bar is drawn, how often it checkpoints). Rerunning an interrupted command therefore
  finds its own folder whatever Hydra's (timestamped) output folder is, and a changed learning
  rate is a different run, never a resumed one.
- **Atomic writes**: a checkpoint is written to a temporary file in the same folder, flushed to
  disk, then renamed over `last.pt` (rename is atomic on POSIX and Windows). A crash or a full
  disk during the write leaves the previous checkpoint intact and loadable.
- **`run.json`** records the MLflow run id (so a resumed run continues the *same* MLflow run, even
  when it was killed before its first checkpoint), the status, and once finished the final
  metrics: rerunning a finished config returns its result without training again.
- **One process per run folder**: an exclusive lock (fcntl) on `<folder>/.lock`, so two jobs with
  the same config (a duplicated multirun, a user who started the command twice) cannot write the
  same checkpoint; the second stops with one line. The lock dies with its process (kill -9 too).
- Nothing is created before the config and the data have been checked (the job calls `open`
  only after validation), so a bad command leaves no folder behind.
- **One writer under torchrun**: rank 0 holds the lock and writes; every other rank gets a
  read-only view of the same folder (it reads the checkpoint to resume, its writes are no-ops),
  so "only rank 0 writes" holds wherever the job or the loop would write. How many processes
  train (train.distributed, WORLD_SIZE) is not part of the identity: a run started on 8 GPUs
  resumes on 4, or on one.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from harness.atomic_write import atomic_write
from harness.config import flatten
from harness.identity import NOT_IDENTITY
from harness.pruning import TrialNotRun
from harness.resolvers import PROJECT_ROOT

CHECKPOINT = "last.pt"
RECORD = "run.json"


class RunBusy(TrialNotRun):
    """Another live process holds this run's folder (a sweep voids such a trial: harness.pruning)."""


class CheckpointUnreadable(ValueError):
    """last.pt exists but is no checkpoint (truncated, overwritten, bit rot): one line, exit 2."""


def run_key(plain: dict[str, Any]) -> str:
    """A short, stable hash of the config's identity keys."""
    identity = {k: v for k, v in flatten(plain).items() if not k.startswith(NOT_IDENTITY)}
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def run_folder(plain: dict[str, Any]) -> Path:
    root = Path(plain["train"]["checkpoint_dir"] or PROJECT_ROOT / "checkpoints").expanduser()
    name = f"{plain['residual']['name']}-{plain['model']['name']}-s{plain['train']['seed']}-{run_key(plain)}"
    return root.resolve() / _safe(plain["sweep"]["name"]) / _safe(name)


def creatable(folder: Path) -> OSError | None:
    """Whether `folder` can be made, tried for real and undone (no permission bit tells it for
    root or for /proc): the folders it had to make are removed again. None, or the error."""
    missing = []
    probe = folder
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
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


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in str(name)) or "_"


def _torch_save(state: dict[str, Any], path: Path) -> None:
    """torch.save, a failed write reported as the OSError it is. torch's C++ writer turns a full
    disk, a quota or a file-size limit into RuntimeError("[enforce fail at inline_container.cc]
    unexpected pos ..."), which the loop would take for a bug and die on (measured on a full
    tmpfs), instead of keeping the previous checkpoint and training on."""
    try:
        torch.save(state, path)
    except RuntimeError as error:
        if not any(w in str(error) for w in ("inline_container", "PytorchStreamWriter", "file write failed")):
            raise  # not the writer's (a CUDA fault in the copy to the host, say): a real error
        raise OSError(f"torch.save could not write {path.name}: {' '.join(str(error).split())} "
                      "(a full disk, a quota or a file-size limit)") from error


class RunFolder:
    def __init__(self, path: Path, read_only: bool = False):
        self.path = path
        self.read_only = read_only  # a torchrun rank other than 0: reads, never writes
        self._lock_handle = None

    # -- lifetime -------------------------------------------------------------------------------
    def acquire(self, fresh: bool) -> RunFolder:
        """Create (or, with fresh=True, empty) the folder and take its lock. Raises RunBusy."""
        if self.read_only:
            raise RuntimeError(f"{self.path}: a read-only view (rank != 0) cannot take the run's lock")
        self.path.mkdir(parents=True, exist_ok=True)
        handle = open(self.path / ".lock", "a+")
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # Windows: no lock
            pass
        except OSError:
            handle.close()
            raise RunBusy(
                f"{self.path}: another process is running this exact config; wait for it or kill it"
            ) from None
        self._lock_handle = handle
        # A writer killed mid-write (kill -9, the OOM killer) leaves its temp file (atomic_write's
        # cleanup never ran): a whole checkpoint's size per kill, never read. Holding the lock, we
        # are the folder's only writer, so every temp file here is such a leftover.
        for stale in self.path.glob(".*.tmp"):
            stale.unlink(missing_ok=True)
        if fresh:
            for child in self.path.iterdir():
                if child.name != ".lock":
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
        return self

    def release(self) -> None:
        if self._lock_handle is not None:
            self._lock_handle.close()  # closing the file drops the flock
            self._lock_handle = None

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
        if self.read_only:
            return
        atomic_write(self.path / CHECKPOINT, lambda tmp: _torch_save(state, tmp))

    def load(self, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
        path = self.path / CHECKPOINT
        if not path.exists():
            return None
        # weights_only: tensors, numbers, strings and containers only (the RNG states are stored as
        # such), so loading a checkpoint never runs pickled code.
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as error:  # torch says "corrupted" in a RuntimeError, UnpicklingError, EOFError...
            reason = f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]
            state = None
        else:
            reason = None if isinstance(state, dict) and "step" in state else "not a training checkpoint"
        if reason is not None:
            # Our writes are atomic, so this is damage from outside (a copy cut short, a disk
            # error); resuming from it is impossible and starting over silently would discard
            # the run's history. The file is left for the user to restore or remove.
            raise CheckpointUnreadable(
                f"train.resume=true: {path} cannot be read ({reason}); it is left as it is; allowed: a "
                "readable checkpoint there (restore it), or train.resume=false to train this config from step 0")
        return state
