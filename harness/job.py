"""One job: from a composed Hydra config to a finished (or resumed) run; what run.py calls.

Validate and load the data first (bad input: one line, exit 2, nothing created); take the run's
folder and lock (a finished run returns its result, an interrupted one resumes, a failed one is
not retried unless asked); open the MLflow run; train, and end the run by the outcome. SIGTERM
checkpoints and exits with REQUEUE_EXIT (docs/RELIABILITY.md); under torchrun rank 0 alone writes.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
from omegaconf import DictConfig, OmegaConf

from attnres.config import KNOB_READERS, reads
from harness import distributed, dynamics, malloc, memory_budget, provenance, pruning
from harness.checkpoint import CheckpointUnreadable, RunBusy, RunFolder, run_folder, run_key
from harness.config import CodeChange, ConfigError, RunSpec, absolute_sqlite, changes_the_run, flatten, override_key
from harness.config import rank, to_plain, validate, world_size
from harness.data import DataError, TokenData, load_data
from harness.stopping import INTERRUPT_EXIT, REQUEUE_EXIT, StopSignals, requeue_on_sigterm, stop_on_signals
from harness.tracking import MlflowTracker, NullTracker, RunNotInStore, end_replaced_run, replay_folder
from harness.tracking import TrackingUnreachable, check_tracking_uri
from harness.train import RESUME_HINT, NonFiniteLoss, StopRequested, Trainer

log = logging.getLogger(__name__)

PARENT_ENV = "ATTNRES_PARENT_RUN_ID"  # set by harness.callbacks for the jobs of a multirun
# A file system that refuses writes: full, over quota, read-only, failing, or a file-size limit.
DISK_ERRNOS = {getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EROFS", "EIO", "EFBIG") if hasattr(errno, n)}


# Overrides a default run name leaves out: already in it, said by its parent run, or not changing what it computes.
_NAMED = ("residual", "model", "train.seed", "sweep")


def run_label(c, overrides: list) -> str:
    """The default run name: <variant>-<model>-s<seed>, then the job's other overrides that change
    what it computes (`block-default-s0 model.layers=16 residual.block_size=2`), so that the runs
    of a sweep over shapes tell themselves apart in `mlflow ui`; a residual knob the variant does
    not read changes nothing (`baseline-default-s0`, not `... residual.block_size=2`)."""
    rest = [line.lstrip("+") for line in overrides
            if changes_the_run(line) and override_key(line) not in _NAMED and not _unread_knob(c, line)]
    return " ".join([f"{c.residual.name}-{c.model.name}-s{c.train.seed}", *rest])


def _unread_knob(c, line: str) -> bool:
    section, _, knob = override_key(line).partition(".")
    return section == "residual" and not reads(c.residual.name, knob)


def _note_unread_knobs(name: str, ignored: dict) -> None:
    """One line for residual knobs a run sets that its variant does not read (validate resets them)."""
    if ignored:
        knobs = "; ".join(f"residual.{k}={v} (read by {', '.join(KNOB_READERS[k])})" for k, v in ignored.items())
        log.warning(f"residual={name} does not read {knobs}: the model does not change; the run is named "
                    "and recorded with the defaults")


def sweep_needs_multirun(hydra_cfg, sweep: str) -> str | None:
    """The line for a sweep file run without -m (`python run.py +sweep=ablation`): Hydra then
    trains one run and ignores the sweep's grid (hydra.sweeper.params), silently. Not refused:
    one job of a sweep, with its recipe, is a run someone may want (one member on 8 GPUs under
    torchrun, where -m is refused)."""
    params = OmegaConf.select(hydra_cfg, "sweeper.params") or {}
    if not params:
        return None
    return (f"sweep {sweep} is a grid over {', '.join(params)}: run it with -m (python run.py -m ...); "
            "without -m this trains one run, at the values given on the command line or the defaults")


def _note_sweep_without_multirun(sweep: str) -> None:
    from hydra.core.hydra_config import HydraConfig

    line = sweep_needs_multirun(HydraConfig.get(), sweep) if HydraConfig.initialized() else None
    if line and rank() == 0:
        log.warning(line)


def repeated_overrides(overrides: list) -> dict[str, list[str]]:
    """Keys given more than once on the command line, with their overrides in order (Hydra
    applies the last, silently)."""
    by_key: dict[str, list[str]] = {}
    for line in overrides:
        by_key.setdefault(override_key(line), []).append(line)
    return {k: lines for k, lines in by_key.items() if len(lines) > 1}


def _note_repeated_overrides(overrides: list) -> None:
    repeated = repeated_overrides(overrides)
    if repeated and rank() == 0:
        said = "; ".join(f"{' then '.join(lines)}: {lines[-1]} applies" for lines in repeated.values())
        log.warning("a key given more than once: %s", said)


def _hydra_mode() -> tuple[bool, str | None, list]:
    """(is multirun, the job's output folder, its overrides); outside Hydra: (False, None, [])."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return False, None, []
    hc = HydraConfig.get()
    # as written: resolving an override's ${...} here would raise before validate() could say one line
    return hc.mode == RunMode.MULTIRUN, hc.runtime.output_dir, OmegaConf.to_container(hc.overrides.task)


def _bad_input(error: Exception, multirun: bool, output_dir: str | None) -> NoReturn:
    if multirun:
        raise error  # the sweeper records the failed job and goes on with the next
    print(f"error: {error}", file=sys.stderr, flush=True)
    _remove_empty_output_dir(output_dir)
    sys.exit(2)


def _remove_empty_output_dir(output_dir: str | None) -> None:
    """Hydra makes the run's output folder (its .hydra/ config copy and the job log) before the job
    starts; a run refused at the door leaves nothing, so that folder goes too — but only when it
    holds nothing else (hydra.run.dir may point at a folder of the user's). Not under torchrun:
    the ranks start at different moments, and the folder shared by all would vanish under a rank
    whose Hydra is still setting up its log file there."""
    if not output_dir or world_size() > 1:
        return
    folder = Path(output_dir)
    try:
        names = {p.name for p in folder.iterdir()}
    except OSError:
        return
    stem = Path(sys.argv[0]).stem
    ours = {".hydra", "run.log", f"{stem}.log"}
    if names and all(n in ours or (n.startswith(f"{stem}_rank") and n.endswith(".log")) for n in names):
        shutil.rmtree(folder, ignore_errors=True)  # (<stem>_rank<N>.log: the other ranks' logs under torchrun)


@dataclass
class Job:
    """What the steps of one job share, from its validated config to its MLflow run."""

    spec: RunSpec
    plain: dict[str, Any]  # the config as plain containers: its key, its folder, its MLflow params
    data: TokenData
    folder: RunFolder  # read-only on ranks other than 0
    multirun: bool
    output_dir: str | None  # Hydra's folder for this job (None outside Hydra)
    overrides: list
    code_files: dict[str, str] = field(default_factory=dict)  # provenance.run_code_files() at start
    label: str = "run"
    tracker: Any = None
    trainer: Trainer | None = None

    @property
    def cfg(self):
        return self.spec.cfg

    def refuse(self, error: Exception) -> NoReturn:
        _bad_input(error, self.multirun, self.output_dir)


def run(cfg: DictConfig) -> float:
    """Train the run `cfg` describes (or resume it, or return its recorded result)."""
    with requeue_on_sigterm():
        job = _accept(cfg)  # bad input: one line, exit 2, nothing created
        with distributed.process_group(job.spec):
            _acquire(job)
            try:
                # from here a stop ends the run KILLED, resumable
                with stop_on_signals(StopSignals()) as stops, _stop_after_the_job(job, stops):
                    record, state = _earlier_run(job)
                    if _settled(job, record):
                        return _answer_recorded(job, record)
                    job.tracker = _open_tracker(job, record, state)
                    try:
                        _write_running_record(job, record)
                        job.trainer = stops.attach(_build(job, state))
                        final = job.trainer.fit()
                        _log_results(job, final)
                    except BaseException as error:
                        _end_on_error(job.tracker, job.folder, error, interrupted=_lost_process(job, error))
                        _exit_for(job, error)
                        raise
                    return _record_finished(job, final)
            finally:
                job.folder.release()


def _accept(cfg: DictConfig) -> Job:
    """Validate the config, load the data and check the machine can hold the run."""
    multirun, output_dir, overrides = _hydra_mode()
    try:
        spec = validate(cfg)
        if not multirun:
            _note_sweep_without_multirun(spec.cfg.sweep.name)
        _note_unread_knobs(spec.cfg.residual.name, spec.ignored)
        if spec.cfg.train.threads:
            torch.set_num_threads(spec.cfg.train.threads)
        if spec.cfg.train.keep_freed_memory and not malloc.keep_freed_memory():
            log.info("train.keep_freed_memory: not glibc, the allocator keeps its own settings")
        data = load_data(spec.cfg.data, spec.cfg.train.seq_len)
        memory_budget.check_fits(spec)  # on a CPU the OOM killer would end the run without a line
        if spec.cfg.tracking.enabled and rank() == 0:
            check_tracking_uri(spec.cfg.tracking.uri)  # a dead server: seconds, not minutes of retries
    except (ConfigError, DataError, TrackingUnreachable) as error:
        _bad_input(error, multirun, output_dir)
    plain = to_plain(spec.cfg)
    identity = {"run_key": run_key(plain), "seed": spec.cfg.train.seed, "variant": spec.cfg.residual.name}
    folder = RunFolder(run_folder(plain), read_only=rank() != 0, identity=identity)  # rank 0 alone writes
    return Job(spec, plain, data, folder, multirun, output_dir, overrides)


def _acquire(job: Job) -> None:
    """Take the run folder's lock (rank 0; the other ranks wait for its answer)."""
    refusal = None
    replaced = None  # the record of the run a fresh start (train.resume=false) replaces
    if not job.folder.read_only:
        try:
            if not job.cfg.train.resume:
                replaced = job.folder.record()
            # a multirun started twice waits for the jobs held elsewhere (a sweep's trial is voided: RunBusy)
            waiting = job.multirun and not _in_trial()
            job.folder.acquire(fresh=not job.cfg.train.resume, wait=_say_waiting(job.folder) if waiting else None)
        except RunBusy as error:
            refusal = error
        except OSError as error:  # a checkpoint_dir that cannot exist or be written
            refusal = ConfigError(
                f"train.checkpoint_dir={job.cfg.train.checkpoint_dir}: cannot create the run folder "
                f"{job.folder.path} ({error.strerror}); allowed: a writable folder (null = <project root>/checkpoints)")
    refusal = distributed.from_main(refusal)  # also keeps the other ranks off the folder until it is ready
    if refusal is not None:
        job.refuse(refusal)
    if replaced and replaced.get("mlflow_run_id") and replaced.get("tracking_uri"):
        end_replaced_run(replaced["tracking_uri"], replaced["mlflow_run_id"],
                         "replaced: train.resume=false started this config again from step 0")


def _say_waiting(folder: RunFolder):
    return lambda: print(f"{folder.path.name}: another process is running this job; waiting for it",
                         file=sys.stderr, flush=True)


@contextmanager
def _stop_after_the_job(job: Job, stops: StopSignals):
    """A stop asked for when no step was left to stop after (during the last one, the plots or the
    model upload, or before a finished run's answer): the job is done and recorded, and the
    process still stops, so that a preempted multirun does not go on to its next job. Never
    swallows an exception without raising one."""
    failure = None
    try:
        yield
    except Exception as error:
        # a multirun or a sweep would record this outcome and start its next job, losing the stop request
        if not (stops.received and (job.multirun or _in_trial())):
            raise
        failure = error
    late = stops.received
    if not late:
        return
    if _in_trial():
        raise KeyboardInterrupt("" if late == "SIGINT" else late) from failure
    code = INTERRUPT_EXIT if late == "SIGINT" else REQUEUE_EXIT
    ended = f"; it ended {type(failure).__name__}: {' '.join(str(failure).split())[:300]}" if failure else ""
    print(f"stopped after the job ({late}{ended}); exit {code}" + (" = requeue me" if code == REQUEUE_EXIT else ""),
          file=sys.stderr, flush=True)
    raise SystemExit(code) from failure


def _earlier_run(job: Job) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the run's record, its checkpoint) once both may stand for this data and code; refuses
    (exit 2) where they may not, and clears the folder for train.code_change=retrain."""
    c, folder = job.cfg, job.folder
    record = distributed.from_main(folder.record())  # rank 0's decides
    changed = _data_changed(record, job.data)
    if changed:
        job.refuse(DataError(changed))
    job.code_files = provenance.run_code_files()
    edited = _code_changed(record, job.code_files)
    if edited and c.train.code_change is CodeChange.ask:
        job.refuse(ConfigError(f"{folder.path.name}: {edited}; allowed: train.code_change=keep (its recorded "
                               "result, or resume it with the code as it is now) or train.code_change=retrain "
                               "(train it again from step 0)"))
    if edited and c.train.code_change is CodeChange.retrain:
        if not folder.read_only:
            print(f"{folder.path.name}: {edited}; train.code_change=retrain: training it again from step 0",
                  file=sys.stderr, flush=True)
            if record.get("mlflow_run_id") and record.get("tracking_uri"):
                end_replaced_run(record["tracking_uri"], record["mlflow_run_id"],
                                 "replaced: train.code_change=retrain started this config again with changed code")
            folder.clear()
        distributed.from_main(None)  # the other ranks read the folder only once it is cleared
        record = None
    elif edited and not folder.read_only:
        log.warning("%s: %s; train.code_change=keep: %s", folder.path.name, edited,
                    "its recorded result stands" if record.get("status") == "finished" else "resuming with this code")
    if _settled(job, record):
        return record, None
    try:
        state = distributed.load_everywhere(folder)  # every rank loads it
    except CheckpointUnreadable as error:  # before any MLflow run is opened: nothing to end
        job.refuse(error)
    _note_repeated_overrides(job.overrides)  # here, once nothing refuses the job: a refusal stays one line
    job.label = c.tracking.run_name or run_label(c, job.overrides)
    return record, state


def _settled(job: Job, record: dict[str, Any] | None) -> bool:
    """Whether the recorded run is answered rather than trained: finished, or failed and not retried."""
    status = (record or {}).get("status")
    return status == "finished" or (status == "failed" and not job.cfg.train.retry_failed)


def _answer_recorded(job: Job, record: dict[str, Any]) -> float:
    """A finished run's result, said once (its metrics replayed into the store that missed them);
    a failed one's refusal to train again (_skip_failed)."""
    c, folder = job.cfg, job.folder
    if record.get("status") == "failed":
        return _skip_failed(folder, record, job.multirun)
    if c.tracking.enabled and record.get("mlflow_run_id") and not folder.read_only:  # metrics its server missed
        try:  # (a store that lost the run is said, never answered "already finished")
            replay_folder(record.get("tracking_uri") or c.tracking.uri, record["mlflow_run_id"], folder.path)
        except RunNotInStore as error:
            job.refuse(error)
    value = record["final"]["final/val_loss"]
    if not folder.read_only:  # under torchrun rank 0 reports for all
        # the folder is keyed by what a run computes, not where it logs: say which store holds it
        where = record.get("tracking_uri")
        # (compared as stores: sqlite:///mlflow.db in the project root is the default's file)
        elsewhere = (f" in {where}, not in tracking.uri={c.tracking.uri}"
                     if c.tracking.enabled and where and absolute_sqlite(where) != absolute_sqlite(c.tracking.uri)
                     else "")
        again = ("train.resume=false (or another train.checkpoint_dir) trains it again into this "
                 "store" if elsewhere else "train.resume=false trains it again")
        print(f"{folder.path.name}: already finished (val loss {value:.4f}, MLflow run "
              f"{record.get('mlflow_run_id')}{elsewhere}); {again}", file=sys.stderr)
    return value


def _write_running_record(job: Job, record: dict[str, Any] | None) -> None:
    """run.json says running, under which MLflow runs, on which data and code (a full disk here
    ends the MLflow run FAILED, saying why)."""
    tracker = job.tracker
    known = [i for i in [*(record or {}).get("mlflow_run_ids", []), (record or {}).get("mlflow_run_id"),
                         tracker.run_id] if i]
    job.folder.write_record(key=run_key(job.plain), status="running", failure=None, mlflow_run_id=tracker.run_id,
                            mlflow_run_ids=sorted(set(known)),
                            tracking_uri=job.cfg.tracking.uri if tracker.enabled else None,
                            data_sha256=job.data.fingerprint.get("sha256"), code_files=job.code_files)


def _build(job: Job, state: dict[str, Any] | None) -> Trainer:
    """The model, its optimizer and its loop, at the checkpoint's step when there is one."""
    trainer = Trainer(job.spec, job.data, job.tracker, job.folder, label=job.label)
    if state is not None:
        trainer.load_state_dict(state)
        log.info("resumed %s at step %d of %d", job.folder.path, trainer.step, job.spec.steps)
    elif getattr(job.cfg.model, "init_from", None):  # a fresh start from a Hugging Face checkpoint's weights
        from harness import hf_import

        hf_import.load_into(trainer.model, job.cfg.model.init_from)
    return trainer


def _log_results(job: Job, final: dict[str, float]) -> None:
    """The final metrics, plots, model and depth-map explorer into the MLflow run."""
    c, tracker, trainer = job.cfg, job.tracker, job.trainer
    tracker.log_metrics(final, trainer.step)
    if c.tracking.log_plots and tracker.enabled and trainer.history:
        tracker.log_figure(dynamics.depth_weights_figure(trainer.history[-1], job.label), "plots/depth_weights.png")
        tracker.log_figure(dynamics.magnitudes_figure(trainer.history, job.label), "plots/magnitudes.png")
    explorer = c.tracking.log_explorer and trainer.model.residual.has_depth_weights
    if (c.tracking.log_model or explorer) and c.tracking.enabled:
        model = trainer.export_model()  # under FSDP a gather: every rank takes part
        if tracker.enabled and c.tracking.log_model:
            _log_model(tracker, model, job.plain)
        if tracker.enabled and explorer:
            _log_explorer(tracker, model, job.spec, job.data)


def _record_finished(job: Job, final: dict[str, float]) -> float:
    """End the MLflow run, then the record: killed in between, a rerun resumes and ends the run
    (in the other order the run would stay RUNNING, without final/* metrics, for good)."""
    tracker = job.tracker
    tracker.end("FINISHED")
    job.folder.write_record(status="finished", final=final)
    if not job.folder.read_only:  # under torchrun rank 0 reports for all
        print(f"{job.label}: val loss {final['final/val_loss']:.4f} after {final['final/tokens']:,} tokens "
              f"({final['final/train_seconds']:.1f} s)" + (f", MLflow run {tracker.run_id}" if tracker.enabled else ""),
              file=sys.stderr)
    return final["final/val_loss"]


# --- How a job that raised ends: one line and an exit code, or the exception itself -------------
class LostProcess:
    """A collective failed because another process of the launch is gone (distributed.lost_process)."""


class CtrlCStop:
    """StopRequested by Ctrl-C."""


class OutOfMemory:
    """An allocation that did not fit (memory_budget.out_of_memory)."""


class DiskRefused:
    """A write the file system refused (full, over quota, read-only, failing, a file-size limit)."""


@dataclass(frozen=True)
class Exit:
    """How a job ends on an error: exit code and the one line on stderr, in `scope`: "all" jobs,
    "not_trial" (in an Optuna trial the sweeper voids the trial), or "single" runs only (a
    multirun or a sweep records the exception itself). LostProcess, CtrlCStop, OutOfMemory and
    DiskRefused are kinds recognised by content (_kind_of), not exception classes."""

    code: int
    line: Callable[[Job, BaseException], str]
    scope: str = "single"


def _failed_in(job: Job, separator: str) -> str:
    return f"MLflow run {job.tracker.run_id} FAILED{separator}" if job.tracker.enabled else ""


def _at_next_step(job: Job) -> str:
    return f" at step {job.trainer.step + 1}" if job.trainer is not None else " building the model"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


EXITS: dict[type, Exit] = {
    # another rank died (kill -9, OOM, a lost node): not this run's failure, so resumable and requeued
    LostProcess: Exit(REQUEUE_EXIT, lambda job, e: (
        f"{job.label}: stopped{f' at step {job.trainer.step}' if job.trainer is not None else ''}: a process of "
        f"the launch was lost ({' '.join(str(e).split())[:200]}); the same command resumes from the last "
        f"checkpoint; exit {REQUEUE_EXIT} = requeue me"), scope="all"),
    # Stopped on request (every rank agrees, the stop is collective); both also end a multirun.
    CtrlCStop: Exit(INTERRUPT_EXIT, lambda job, e: f"{job.label}: interrupted (Ctrl-C): {e}", scope="all"),
    StopRequested: Exit(REQUEUE_EXIT, lambda job, e: (
        f"{job.label}: {e} ({job.trainer.stop_reason}); exit {REQUEUE_EXIT} = requeue me"), scope="all"),
    # A second Ctrl-C, or one outside the training loop.
    KeyboardInterrupt: Exit(INTERRUPT_EXIT, lambda job, e: (
        f"{job.label}: interrupted (Ctrl-C); rerun to resume from the last checkpoint"), scope="not_trial"),
    # The run's outcome, not a fault of the code.
    NonFiniteLoss: Exit(1, lambda job, e: (
        f"{job.label}: diverged: {e}; {_failed_in(job, ', ')}its last good checkpoint kept "
        "(train.retry_failed=true resumes from it)")),
    # The machine's memory: a micro-batch to try (memory_budget refuses up front what cannot fit on a CPU).
    OutOfMemory: Exit(1, lambda job, e: (
        f"{job.label}: out of memory{_at_next_step(job)} ({_first_line(e)}); {_failed_in(job, '; ')}"
        f"allowed: {memory_budget.after_out_of_memory(job.spec)}")),
    # A write the run cannot go on without (its record; a failed checkpoint write does not end it).
    DiskRefused: Exit(1, lambda job, e: (
        f"{job.label}: stopped: {e}{'' if e.filename else f' (run folder {job.folder.path})'}; "
        f"{_failed_in(job, '; ')}rerun the same command once the disk has room (it resumes from its last checkpoint)")),
}


def _lost_process(job: Job, error: BaseException) -> bool:
    return job.spec.parallel is not None and distributed.lost_process(error)


def _kind_of(job: Job, error: BaseException) -> type:
    """The key of EXITS that `error` ends the job by (its own class when none of the kinds fits)."""
    if _lost_process(job, error):
        return LostProcess
    if isinstance(error, StopRequested) and job.trainer is not None and job.trainer.stop_reason == "SIGINT":
        return CtrlCStop
    if memory_budget.out_of_memory(error):
        return OutOfMemory
    if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
        return DiskRefused
    return type(error)


def _exit_for(job: Job, error: BaseException) -> None:
    """End the process as EXITS says for `error`; return where the exception goes on as it is."""
    kind = _kind_of(job, error)
    if issubclass(kind, (StopRequested, CtrlCStop)) and _in_trial():
        # the sweeper owns the interrupt: it voids the trial, says one line and exits 130 (75 for SIGTERM)
        raise KeyboardInterrupt("" if kind is CtrlCStop else job.trainer.stop_reason) from None
    ending = next((EXITS[k] for k in kind.__mro__ if k in EXITS), None)
    if ending is None or (ending.scope == "not_trial" and _in_trial()):
        return
    if ending.scope == "single" and (job.multirun or _in_trial()):
        return
    print(ending.line(job, error), file=sys.stderr, flush=True)
    raise SystemExit(ending.code) from None


class PreviouslyFailed(RuntimeError):
    """This config's run failed before and train.retry_failed is false: it is not trained again."""


def _skip_failed(folder: RunFolder, record: dict[str, Any], multirun: bool) -> NoReturn:
    """A failed run (divergence, an error) is not retrained behind the user's back: rerunning a
    sweep redoes only what was interrupted. The job reports the failure as a failed job does (a
    multirun counts it failed, exit 1), so the sweep's outcome stays what it was."""
    reason = " ".join(str(record.get("failure") or "no reason recorded").split())
    line = (f"{folder.path.name}: failed before ({reason}); not trained again: add "
            f"train.retry_failed=true to resume it from its last good checkpoint")
    if not folder.read_only:  # under torchrun rank 0 reports for all
        print(line, file=sys.stderr, flush=True)
    if multirun:
        raise PreviouslyFailed(line)
    raise SystemExit(1)


def _log_model(tracker, model, plain: dict[str, Any]) -> None:
    """Artifact model/: model.safetensors + config.json with the run's data and train nodes, the
    format attnres.load(run_id) and the evaluation commands read."""
    import tempfile

    from attnres import save_pretrained

    with tempfile.TemporaryDirectory(prefix="attnres-model-") as tmp:
        folder = save_pretrained(model, Path(tmp) / "model", extra={"data": plain["data"], "train": plain["train"]})
        for path in sorted(folder.iterdir()):
            tracker.log_file(str(path), "model")


def _log_explorer(tracker, model, spec: RunSpec, data: TokenData) -> None:
    """Artifact explorer/depth.html: the depth-map explorer (evaluation.explorer) on prompts from
    the split the run validated on, so every run opens its depth maps in the MLflow UI. A page
    that cannot be built (no tokenizer for the vocabulary, say) is a warning: the run trained."""
    from evaluation.explorer import training_run_page

    try:
        html = training_run_page(model, spec.cfg.data, data.val, tracker.run_id)
    except Exception as e:  # noqa: BLE001 - the page is an extra; the run's result stands without it
        log.warning("no explorer page for this run (%s: %s); `python -m evaluation.explorer %s` makes one",
                    type(e).__name__, e, tracker.run_id)
        return
    if html is not None:
        tracker.log_text(html, "explorer/depth.html")


def _in_trial() -> bool:
    """Whether this job is an Optuna trial run in the sweeper's process."""
    return pruning.current_trial() is not None


def _end_on_error(tracker, folder: RunFolder, error: BaseException, interrupted: bool = False) -> None:
    """End the MLflow run and the record as `error` says. interrupted: resumable whatever the
    error (a collective broken by a lost process)."""
    if isinstance(error, pruning.TrialPruned):
        tracker.end("PRUNED", {"pruned": "true"})
        status = "pruned"
    elif interrupted or isinstance(error, (KeyboardInterrupt, StopRequested, SystemExit)):  # a launcher's exit: resumable
        reason = f"interrupted ({type(error).__name__}: {error})"
        if _in_trial():  # the Optuna sweeper voids the trial: its slot is sampled again, this run not resumed
            reason = (f"interrupted ({type(error).__name__}: {str(error).removesuffix(RESUME_HINT)}); the trial "
                      "is void: rerunning the sweep samples its slot again")
        tracker.end("KILLED", {"attnres.failure": reason})
        status = "interrupted"
    else:
        tags = {"attnres.failure": f"{type(error).__name__}: {error}"[:5000]}
        if isinstance(error, NonFiniteLoss):
            tags["attnres.failure_step"] = error.step
        tracker.end("FAILED", tags)
        status = "failed"
    try:
        folder.write_record(status=status, failure=f"{type(error).__name__}: {error}")
    except OSError as write_error:  # a full disk: MLflow has the outcome; the error that ended the run is the news
        log.warning("%s: run.json not updated (%s)", folder.path, write_error)


def _open_tracker(job: Job, record: dict[str, Any] | None, state: dict[str, Any] | None):
    """The run's MLflow run: resumed (by the id its record or checkpoint holds) or started."""
    c, spec = job.cfg, job.spec
    if not c.tracking.enabled or rank() != 0:
        return NullTracker()
    parent = c.tracking.parent_run_id or (os.environ.get(PARENT_ENV) if job.multirun else None)
    trial = pruning.current_trial()
    tags = {
        "attnres.role": "trial" if trial is not None else "job",
        "attnres.variant": c.residual.name,
        "attnres.model": c.model.name,
        "attnres.seed": c.train.seed,
        "attnres.sweep": c.sweep.name,
        "attnres.status": "RUNNING",
        "attnres.data_fingerprint": job.data.fingerprint.get("sha256", ""),
        "attnres.run_key": run_key(job.plain),
        "attnres.device": str(spec.device),
    }
    if job.output_dir:
        tags["attnres.hydra_output_dir"] = job.output_dir
    if trial is not None:
        tags["optuna.trial_number"] = getattr(trial, "number", "")
    # the checkpoint names the run too: a lost run.json must not split one training run over two MLflow runs
    resume_id = (record or {}).get("mlflow_run_id") or (state or {}).get("mlflow_run_id")
    tracker = MlflowTracker.start(
        c.tracking.uri, c.tracking.experiment or c.sweep.name, job.label,
        {k: str(v) for k, v in tags.items()}, parent_run_id=parent, resume_run_id=resume_id,
        system_metrics=c.tracking.system_metrics, flush_seconds=c.tracking.flush_seconds,
        pending_dir=job.folder.path,
    )
    if trial is not None:
        pruning.record_run(tracker.run_id)
    try:
        if tracker.resumed:
            tracker.set_tags({"attnres.status": "RUNNING", "attnres.resumed_at_step": (state or {}).get("step", 0)})
            _note_code_change(tracker, c, (state or {}).get("step", 0))
            _note_layout_change(tracker, spec, (state or {}).get("step", 0))
        else:
            _log_start(tracker, job)
    except BaseException as error:
        tracker.end("FAILED", {"attnres.failure": f"while logging the run's start: {error}"[:5000]})
        raise
    return tracker


def _log_start(tracker, job: Job) -> None:
    """A new MLflow run's params, resolved config, overrides, data fingerprint, code and environment."""
    c, spec, plain = job.cfg, job.spec, job.plain
    params = dict(flatten(plain), **spec.counts)
    params["train.accum_steps"] = spec.accum_steps  # derived: batch_size / (world_size · micro_batch_size)
    params["train.world_size"] = spec.world_size  # processes (torchrun); the batch is global whatever it is
    tracker.log_params(params)
    tracker.log_text(OmegaConf.to_yaml(OmegaConf.create(plain)), "config/resolved.yaml")
    tracker.log_text("\n".join(job.overrides) + "\n", "config/overrides.txt")
    tracker.log_dict(job.data.fingerprint, "data/fingerprint.json")
    if c.tracking.log_code:
        provenance.log_code(tracker)
        tracker.set_tags({"attnres.code_digest": provenance.code_state().digest,
                          "mlflow.source.git.commit": provenance.code_state().commit})
    if c.tracking.log_env:
        tracker.log_text(provenance.pip_freeze(), "env/pip_freeze.txt")


def _data_changed(record: dict | None, data: TokenData) -> str | None:
    """Why a recorded run cannot continue or stand for this data, or None. A run folder is keyed
    by the config, which names the data (a path, a corpus) but not its bytes: a file edited since
    the run started would be resumed, or answered with the old result, under the old fingerprint.
    A record that holds no fingerprint is not checked."""
    before, now = (record or {}).get("data_sha256"), data.fingerprint.get("sha256")
    if not before or not now or before == now:
        return None
    return (f"the data changed since this run started (fingerprint {before[:12]}… → {now[:12]}…); "
            "allowed: the data it started with, or train.resume=false to train it again on this data")


def _code_changed(record: dict | None, now: dict[str, str]) -> str | None:
    """What changed in the run's code (provenance.RUN_CODE) since a finished or resumable run
    recorded it, or None. A run folder is keyed by the config, not the code: without this a rerun
    answers "already finished" with the old code's number, or resumes it under new code silently.
    A record that holds no code files is not checked."""
    if not record or not record.get("code_files") or record.get("status") not in ("finished", "running", "interrupted"):
        return None
    files = provenance.changed_code_files(record["code_files"], now)
    if not files:
        return None
    shown = ", ".join(files[:6]) + (f" and {len(files) - 6} more" if len(files) > 6 else "")
    when = "finished" if record["status"] == "finished" else "started"
    return f"the code changed since this run {when} ({shown})"


def _note_layout_change(tracker, spec: RunSpec, step: int) -> None:
    """A run resumed on another number of processes (its identity does not include it): MLflow
    params are written once, so the new world size and per-process accumulation go into tags
    named by the step they start at, beside the params of the first attempt."""
    params = tracker.client.get_run(tracker.run_id).data.params
    now = {"world_size": spec.world_size, "accum_steps": spec.accum_steps}
    changed = {k: v for k, v in now.items() if params.get(f"train.{k}") not in (None, str(v))}
    if changed:
        log.warning("resumed with %s (the run started with %s)", changed,
                    {k: params[f"train.{k}"] for k in changed})
        tracker.set_tags({f"attnres.{k}_from_step_{step}": v for k, v in changed.items()})


def _note_code_change(tracker, c, step: int) -> None:
    """A resumed run whose code changed keeps both versions (code/resumed_step_N/...)."""
    if not c.tracking.log_code:
        return
    run = tracker.client.get_run(tracker.run_id)
    before = run.data.tags.get("attnres.code_digest")
    now = provenance.code_state().digest
    if before and before != now:
        log.warning("the code changed since this run started; logging the new code beside the old")
        provenance.log_code(tracker, prefix=f"code/resumed_step_{step:07d}")
