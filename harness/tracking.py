"""MLflow for a run: the run (new, child or resumed) and what it logs, with or without a server.

Design decisions:
- The store and the experiment come from harness/tracking_store.py (the URI checked, the SQLite
  store created once under a lock, the experiment created and tagged).
- The run is started with the fluent API (`mlflow.start_run`) so that code running in the same
  process sees it: the Optuna sweeper finds its trial's run as `mlflow.last_active_run()`, and a
  user's own `mlflow.log_*` inside the loop lands in it. Everything the harness logs goes through
  an explicit `MlflowClient` with the run id (no reliance on the active-run stack).
- Metrics are buffered and written with `log_batch` at most every `tracking.flush_seconds` (and
  before every checkpoint and at the end): one SQLite transaction per flush instead of one per
  value keeps the logging overhead under the 3% bar (benchmarks/harness_overhead.py).
- Exactly-once metric steps across resumes: a resumed run first reads, per metric key, the last
  step already in MLflow, and drops points at or below it. The loop flushes before it writes a
  checkpoint, so every step up to the checkpoint is in MLflow; steps after it that reached MLflow
  before the crash are recomputed identically (deterministic data and RNG) and skipped, the rest
  are logged: no duplicate, no gap.
- `NullTracker` stands in when tracking is off or on ranks other than 0: the loop never branches.
- **A tracking server that is down** (docs/RELIABILITY.md): at start the store's check stops the
  run in seconds. Mid-run, training must not stop for the server: a flush that fails appends its
  metrics to `<run folder>/metrics_pending.jsonl` (and tags to `tags_pending.json`), later
  flushes retry at most every `RETRY_SECONDS`, and the first one that succeeds replays the file in
  order and deletes it. A resumed run replays the file before reading which steps MLflow has, so
  exactly-once still holds across an outage.
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

from harness.atomic_write import atomic_write
from harness.tracking_store import client_for, experiment_id

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

    def __init__(self, client, run_id: str, flush_seconds: float, resumed: bool, pending_dir: Path | None = None):
        self.client, self.run_id = client, run_id
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
            if pending_dir is not None:
                _clear_pending(pending_dir)  # they belonged to the run that is gone
            run = mlflow.start_run(
                experiment_id=exp_id, run_name=run_name, parent_run_id=parent_run_id,
                tags=dict(tags), log_system_metrics=system_metrics,
            )
        try:
            return cls(client, run.info.run_id, flush_seconds, resumed=resumed, pending_dir=pending_dir)
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
        if self._offline_since is not None and not force and time.monotonic() < self._retry_at:
            self._spill()
            return
        try:
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
            log.warning("tracking server unreachable (%s); training goes on, metrics are kept in %s "
                        "and replayed when it is back", " ".join(str(error).split())[:300],
                        self.pending_dir / PENDING_METRICS)
        self._retry_at = time.monotonic() + RETRY_SECONDS

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
        self._artifact(lambda: self.client.log_figure(self.run_id, figure, artifact_file),
                       lambda target: figure.savefig(target), artifact_file)

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
                print(f"warning: the MLflow server is unreachable: run {self.run_id} stays RUNNING there; "
                      f"its metrics wait in {self.pending_dir / PENDING_METRICS}. Rerun the same command "
                      "when the server is back to send them", file=sys.stderr, flush=True)


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


def replay_folder(uri: str, run_id: str, folder: Path) -> bool:
    """Send what a run left waiting in `folder` while its server was down (metrics, tags, its end).
    True when nothing waits any more; False (with a warning) when the server is still down."""
    names = (PENDING_METRICS, PENDING_TAGS, PENDING_ARTIFACTS, END_PENDING)
    if not any((folder / n).exists() for n in names):
        return True
    try:
        tracker = MlflowTracker(client_for(uri), run_id, 5.0, resumed=False, pending_dir=folder)
        end = folder / END_PENDING
        if end.exists():
            tracker.client.set_terminated(run_id, status=json.loads(end.read_text())["status"])
            end.unlink()
    except Exception as error:
        log.warning("run %s: pending metrics in %s not sent yet (%s)", run_id, folder,
                    " ".join(str(error).split())[:300])
        return False
    log.warning("run %s: metrics logged while the tracking server was down are now in MLflow", run_id)
    return True


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
