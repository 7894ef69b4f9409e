"""The sweep loop: for each grid cell, open its study and run trials as Hydra jobs until it is full.

Ask/tell, one ``launcher.launch`` per trial, so jobs get Hydra's usual folders, logs and callbacks,
with the live trial bound in ``harness.pruning``. Several workers share one storage (``_ledger``
keeps each study at ``n_trials``). A failed trial is recorded and the sweep goes on up to
``max_failure_rate``; a task returning ``None`` stops it, since every trial would fail alike.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import FrozenTrial, TrialState

from harness import pruning
from harness.config import changes_the_run
# A stopped sweep exits as a stopped training run does: 130 (Ctrl-C), 75 (SIGTERM: requeue me).
from harness.stopping import INTERRUPT_EXIT, REQUEUE_EXIT, on_sigterm
from harness.tracking import redact

from . import _summary
from ._ledger import FAILURE_ATTR, VOID_ATTR, Ledger, failure_budget, is_genuine_failure, rank
from ._space import Cell, Plan, build_plan, enqueued_points
from ._storage import (
    base_directory,
    fail_stale_trials,
    heartbeat,
    open_storage,
    resolve_url,
)
from ._strategy import describe, grid_size, make_pruner, make_sampler, scaled_pruner
from ._study_runs import PARENT_ATTR, StudyTracker, end_leftover_runs, last_run_id, resolve_tracking
from .settings import AttnresOptunaSweeperConf, SweepAborted, SweeperConfigError

log = logging.getLogger(__name__)

_FIXED_ATTR = "attnres.fixed_overrides"


def _identity(fixed) -> list[str]:
    """The fixed overrides that change what a trial computes (harness.config.changes_the_run:
    not tracking, progress, checkpoint folders, threads, ...)."""
    return [line for line in fixed if changes_the_run(line)]


class SweepRunner:
    def __init__(
        self,
        settings: AttnresOptunaSweeperConf,
        hydra_context: HydraContext,
        task_function: TaskFunction,
        config: DictConfig,
    ) -> None:
        self.settings = settings
        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        self.base_dir = base_directory(OmegaConf.select(config, "hydra.runtime.cwd"))
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        self._warned_silent = False

    # -- the whole sweep ------------------------------------------------------------------------

    def run(self, arguments: list[str]) -> list[_summary.CellSummary]:
        s = self.settings
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        plan = build_plan(arguments, s.params, parser)
        enqueue = enqueued_points(s.enqueue, plan)
        n_trials = s.n_trials
        if s.sampler.name == "grid":
            n_trials = min(n_trials, grid_size(plan.dimensions))
        make_sampler(s.sampler, plan.dimensions)  # refuse bad sampler options before any work
        make_pruner(scaled_pruner(s.pruner, n_trials))
        prefix = study_prefix(s, self.config)
        compose_jobs(self.hydra_context.config_loader, self.config, s, plan, prefix)

        storage_url = resolve_url(s.storage, self.base_dir)
        storage = open_storage(storage_url, s.heartbeat_interval, s.grace_period)
        tracking = resolve_tracking(s.mlflow, self.config, self.base_dir)
        tracker = None if tracking is None else StudyTracker(*tracking, plots=s.mlflow.plots)
        self._check_existing_studies(plan, prefix, storage)

        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, self.sweep_dir / "multirun.yaml")
        log.info(
            "attnres_optuna: %d stud%s x %d trials, %s, sampler %s, pruner %s, storage %s",
            len(plan.cells),
            "y" if len(plan.cells) == 1 else "ies",
            n_trials,
            s.direction,
            describe(s.sampler),
            describe(scaled_pruner(s.pruner, n_trials)),
            redact(storage_url),
        )
        try:
            with on_sigterm(_sigterm_as_interrupt):
                for cell in plan.cells:
                    self._run_cell(cell, plan, prefix, n_trials, storage, tracker, enqueue)
        except KeyboardInterrupt as interrupt:
            # One line instead of a traceback: stopping on request is not an error of the code.
            # SIGTERM (a scheduler's preemption) exits as a stopped training run does: "requeue me".
            raise SweepAborted(
                f"sweep interrupted ({str(interrupt) or 'Ctrl-C'}): run the same command again to "
                "finish the remaining trials",
                exit_code=REQUEUE_EXIT if str(interrupt) == "SIGTERM" else INTERRUPT_EXIT,
            ) from None
        finally:
            rows = self._write_summary(plan, prefix, n_trials, storage)
        return rows

    def _write_summary(
        self, plan: Plan, prefix: str, n_trials: int, storage: optuna.storages.BaseStorage
    ) -> list[_summary.CellSummary]:
        rows = []
        try:
            for cell in plan.cells:
                name = cell.study_name(prefix)
                try:
                    study = optuna.load_study(study_name=name, storage=storage)
                except KeyError:  # a cell this run never reached
                    continue
                rows.append(_summary.summarize(study, n_trials, study.user_attrs.get(PARENT_ATTR)))
            table = _summary.render(rows, self.settings.direction)
            text, data = _summary.write(rows, self.settings.direction, self.sweep_dir)
            print(f"\nOptuna sweep summary ({text}, {data.name}):\n{table}\n", flush=True)
        except Exception as error:  # the summary must never hide the sweep's own outcome
            log.error("could not write the sweep summary: %s", error)
        return rows

    # -- one grid cell --------------------------------------------------------------------------

    def _run_cell(
        self,
        cell: Cell,
        plan: Plan,
        prefix: str,
        n_trials: int,
        storage: optuna.storages.RDBStorage,
        tracker: StudyTracker | None,
        enqueue: list[dict[str, Any]],
    ) -> None:
        name = cell.study_name(prefix)
        study, created = self._open_study(name, plan, storage, enqueue, n_trials)
        parent = None
        if tracker is not None:
            parent = tracker.open_parent(
                study, created, cell.values(), self._parent_tags(cell, n_trials, storage)
            )
        ledger = Ledger.of(study.get_trials(deepcopy=False))
        log.info(
            "study %s: %d/%d trials done%s",
            name,
            ledger.done,
            n_trials,
            f", {ledger.running} running elsewhere" if ledger.running else "",
        )
        status = "FINISHED"
        try:
            if ledger.to_start(n_trials) > 0:  # a full study's failures stop nothing any more
                self._check_failures(study, name, n_trials)
            while True:
                for dead in fail_stale_trials(study):  # void; their MLflow runs end KILLED
                    log.warning(
                        "%s trial %d: its worker stopped (no heartbeat): void, run again", name, dead.number
                    )
                    if tracker is not None and parent is not None:
                        try:
                            tracker.record_trial(parent, name, dead, dead.user_attrs.get(pruning.RUN_ID_ATTR))
                        except Exception as error:
                            log.warning("trial %d: could not end its MLflow run: %s", dead.number, error)
                if Ledger.of(study.get_trials(deepcopy=False)).to_start(n_trials) == 0:
                    break
                with warnings.catch_warnings():
                    # Optuna warns that heartbeats are meant for optimize(); we beat ourselves.
                    warnings.filterwarnings("ignore", message="Heartbeat of storage")
                    trial = study.ask(plan.distributions)
                if rank(study.get_trials(deepcopy=False), trial.number) > n_trials:
                    trial.set_user_attr(VOID_ATTR, "surplus")
                    study.tell(trial, state=TrialState.FAIL)
                    break
                self._run_trial(study, trial, cell, plan, parent, tracker, storage)
                self._check_failures(study, name, n_trials)
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        except SweepAborted:
            status = "FAILED"
            raise
        finally:
            if tracker is not None and parent is not None:
                try:
                    _update_parent(tracker, parent, study, status, n_trials)
                except Exception as error:  # results are in the storage; MLflow is a view
                    log.warning("study %s: could not update its MLflow parent run: %s", name, error)

    def _open_study(
        self,
        name: str,
        plan: Plan,
        storage: optuna.storages.RDBStorage,
        enqueue: list[dict[str, Any]],
        n_trials: int,
    ) -> tuple[optuna.Study, bool]:
        s = self.settings
        sampler, pruner = make_sampler(s.sampler, plan.dimensions), make_pruner(scaled_pruner(s.pruner, n_trials))
        try:
            study = optuna.create_study(
                study_name=name,
                storage=storage,
                sampler=sampler,
                pruner=pruner,
                direction=s.direction,
            )
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(
                study_name=name, storage=storage, sampler=sampler, pruner=pruner
            )
            self._check_continues(study, plan)
            return study, False
        study.set_user_attr(_FIXED_ATTR, list(plan.fixed))
        for point in enqueue:
            study.enqueue_trial(point, skip_if_exists=True)
        return study, True

    def _check_continues(self, study: optuna.Study, plan: Plan) -> None:
        """An existing study may be continued by this command: same direction, same overrides."""
        s, name = self.settings, study.study_name
        if len(study.directions) != 1 or study.direction.name.lower() != s.direction:
            raise SweeperConfigError(
                f"study {name} exists with direction {study.directions[0].name.lower()}, "
                f"not {s.direction}: set hydra.sweeper.study_name to start a new study"
            ) from None
        started_with = study.user_attrs.get(_FIXED_ATTR)
        # Sorted: the order of the overrides on the command line changes nothing.
        before, now = sorted(_identity(started_with or [])), sorted(_identity(plan.fixed))
        if started_with is not None and before != now:
            raise SweeperConfigError(
                f"study {name} was started with the overrides {before}, this command gives {now}: their "
                "trials would not be comparable; run it with the same overrides, or set "
                "hydra.sweeper.study_name to start a new study"
            ) from None

    def _check_existing_studies(self, plan: Plan, prefix: str, storage: Any) -> None:
        """Every cell's study that exists already, checked before anything runs or is written: a
        refusal leaves no sweep folder or summary behind (it came after the first cells ran)."""
        for cell in plan.cells:
            try:
                study = optuna.load_study(study_name=cell.study_name(prefix), storage=storage)
            except KeyError:  # a new study
                continue
            self._check_continues(study, plan)

    def _parent_tags(self, cell: Cell, n_trials: int, storage: Any) -> dict[str, str]:
        s = self.settings
        values = cell.values()
        tags = {
            "attnres.sweep": study_prefix(s, self.config),
            "optuna.direction": s.direction,
            "optuna.n_trials": str(n_trials),
            "optuna.sampler": describe(s.sampler),
            "optuna.pruner": describe(scaled_pruner(s.pruner, n_trials)),
            "optuna.storage": redact(storage.url),
        }
        if "residual" in values:
            tags["attnres.variant"] = values["residual"]
        return tags

    def _check_failures(self, study: optuna.Study, name: str, n_trials: int) -> None:
        trials = study.get_trials(deepcopy=False)
        failed = [t for t in trials if is_genuine_failure(t)]
        budget = failure_budget(n_trials, self.settings.max_failure_rate)
        if len(failed) > budget:
            last = max(failed, key=lambda t: t.number)
            raise SweepAborted(
                f"study {name}: {len(failed)} of its {n_trials} trials failed, more than "
                f"hydra.sweeper.max_failure_rate={self.settings.max_failure_rate} allows ({budget}); "
                f"last, trial {last.number}: {last.user_attrs[FAILURE_ATTR]}"
            )

    # -- one trial ------------------------------------------------------------------------------

    def _run_trial(
        self,
        study: optuna.Study,
        trial: optuna.Trial,
        cell: Cell,
        plan: Plan,
        parent: str | None,
        tracker: StudyTracker | None,
        storage: optuna.storages.RDBStorage,
    ) -> None:
        s = self.settings
        overrides = [
            *plan.fixed,
            *cell.overrides,
            *(d.override(trial.params[d.name]) for d in plan.dimensions),
        ]
        if parent is not None:
            overrides.append(f"++{s.mlflow.parent_run_key}={parent}")
        trial.set_user_attr("attnres.overrides", overrides)
        before = last_run_id()
        # Optuna has no public trial id; it is the storage-wide unique number we want, so reruns and
        # workers sharing a sweep folder never write into each other's job folders.
        trial_id = trial._trial_id
        try:
            with heartbeat(storage, trial_id, s.heartbeat_interval), pruning.bind(trial):
                (job,) = self.launcher.launch([overrides], initial_job_idx=trial_id)
                _raise_wrapped_interrupt(job)
        except BaseException as error:
            # Ctrl-C, or the launcher itself broke: not the trial's fault, so it is void and the
            # next run of the sweep runs it again.
            reason = "interrupted" if isinstance(error, KeyboardInterrupt) else f"launch: {error!r}"
            end_leftover_runs("KILLED")
            self._finish(
                study, trial, TrialState.FAIL, None, {VOID_ATTR: reason}, before, parent, tracker
            )
            raise
        outcome = _outcome(job)
        end_leftover_runs("KILLED" if outcome.state == TrialState.PRUNED else "FAILED")
        attrs = {k: v for k, v in ((FAILURE_ATTR, outcome.failure), (VOID_ATTR, outcome.void)) if v is not None}
        frozen = self._finish(
            study, trial, outcome.state, outcome.value, attrs, before, parent, tracker
        )
        _log_outcome(study, trial, plan, outcome, frozen, job)
        if outcome.fatal:
            raise SweepAborted(f"{study.study_name} trial {trial.number}: {outcome.failure}")
        self._warn_if_nothing_reported(outcome, frozen, trial)

    def _warn_if_nothing_reported(self, outcome: _Outcome, frozen: FrozenTrial, trial: optuna.Trial) -> None:
        """Once per sweep: a pruner that cannot prune, since the task reports no intermediate values."""
        s = self.settings
        if (
            outcome.state == TrialState.COMPLETE
            and s.pruner.name != "none"
            and not frozen.intermediate_values
            and not self._warned_silent
        ):
            self._warned_silent = True
            log.warning(
                "trial %d reported no intermediate values, so nothing can be pruned: does the "
                "task call harness.pruning.report(step, value), and does the launcher run jobs "
                "in this process (the basic launcher does)?",
                trial.number,
            )

    def _finish(
        self,
        study: optuna.Study,
        trial: optuna.Trial,
        state: TrialState,
        value: float | None,
        attrs: Mapping[str, str],
        before: str | None,
        parent: str | None,
        tracker: StudyTracker | None,
    ) -> optuna.trial.FrozenTrial:
        """Annotate and tell the trial, then tag its MLflow run."""
        run_id = last_run_id()
        run_id = None if run_id == before else run_id
        # User attributes must be set before tell: a finished trial is read-only.
        for key, text in {**attrs, **({pruning.RUN_ID_ATTR: run_id} if run_id else {})}.items():
            trial.set_user_attr(key, text)
        frozen = study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
        if tracker is not None and parent is not None:
            try:
                tracker.record_trial(parent, study.study_name, frozen, run_id)
            except Exception as error:
                log.warning("trial %d: could not tag its MLflow run: %s", trial.number, error)
        return frozen


def _update_parent(
    tracker: StudyTracker, parent: str, study: optuna.Study, status: str, n_trials: int
) -> None:
    """Write this worker's view of the study (counts, best, status) on its parent run.

    A worker that is done while others still run trials leaves the parent RUNNING. If they finish
    while it writes, its older view can land after the last worker's FINISHED one and leave a
    finished study's parent RUNNING with stale best tags, so it looks again afterwards and, if the
    study is now complete, writes the final view itself. Whichever order the writes take, the last
    one then comes from a complete view (tests/test_sweeper_unit.py; two real workers:
    tests/test_reliability_postgres.py).
    """
    if status == "FINISHED" and not _complete(study, n_trials):
        tracker.update_parent(parent, study, "RUNNING")  # other workers are still on it
        if not _complete(study, n_trials):
            return
    tracker.update_parent(parent, study, status)


def _complete(study: optuna.Study, n_trials: int) -> bool:
    ledger = Ledger.of(study.get_trials(deepcopy=False))
    return ledger.done >= n_trials and not ledger.running


def study_prefix(settings: AttnresOptunaSweeperConf, config: DictConfig) -> str:
    prefix = settings.study_name or OmegaConf.select(config, "sweep.name", default=None)
    return str(prefix or config.hydra.job.name)


def compose_jobs(
    loader: Any, config: DictConfig, settings: AttnresOptunaSweeperConf, plan: Plan, prefix: str,
    check: Callable[[DictConfig], Any] | None = None,
) -> None:
    """Compose every cell's job config once, with a sample point, before anything runs; `check`
    (the app's own validation of a composed job config, if given) sees each, its errors raised as is."""
    sample = [d.override(_sample_value(d.distribution)) for d in plan.dimensions]
    if settings.mlflow.enabled:
        sample.append(f"++{settings.mlflow.parent_run_key}=check")
    for cell in plan.cells:
        try:
            job_cfg = loader.load_sweep_config(config, [*plan.fixed, *cell.overrides, *sample])
        except Exception as error:
            floats = _float_range_over_an_integer(loader, config, plan, cell, sample)
            if floats is not None:
                raise SweeperConfigError(floats) from None
            first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            # The cause stays attached: an app can print its own line from it (run.py does,
            # harness/composition_errors.py); Hydra's report prints this message only.
            raise SweeperConfigError(
                f"the jobs of study {cell.study_name(prefix)} do not compose: {first}"
            ) from error
        if check is not None:
            check(job_cfg)


def _float_range_over_an_integer(
    loader: Any, config: DictConfig, plan: Plan, cell: Cell, sample: list[str]
) -> str | None:
    """The line for `model.layers=interval(2,8)`: an interval samples floats, which an integer
    key refuses, and the config's own error would name the sampled `model.layers=2.0`, a value
    the user never typed. Found by composing again with that one value made an integer."""
    for i, d in enumerate(plan.dimensions):
        dist = d.distribution
        if not isinstance(dist, FloatDistribution) or dist.step is not None:
            continue
        low, high = math.ceil(dist.low), math.floor(dist.high)
        whole = [*sample[:i], f"{d.key}={low}", *sample[i + 1:]]
        try:
            loader.load_sweep_config(config, [*plan.fixed, *cell.overrides, *whole])
        except Exception:  # noqa: BLE001 - not this dimension (or not only): the general line
            continue
        return (
            f"{d.name}: interval(...) samples floats, but {d.name} takes integers; allowed: "
            f"tag(int, interval({low}, {high})) or range({low}, {high + 1})"
        )
    return None


@dataclass(frozen=True)
class _Outcome:
    state: TrialState
    value: float | None = None
    failure: str | None = None  # why the trial failed
    fatal: bool = False  # every trial would fail the same way: stop the sweep
    void: str | None = None  # why the trial did not run, through no fault of its config


def _outcome(job: JobReturn) -> _Outcome:
    # JobReturn.return_value re-raises a job's exception and prints it as an error even for a
    # pruned trial; the stored value is what we need.
    result = job._return_value
    if job.status != JobStatus.COMPLETED:
        if isinstance(result, (pruning.TrialPruned, optuna.TrialPruned)):
            return _Outcome(TrialState.PRUNED)
        if isinstance(result, pruning.TrialNotRun):
            return _Outcome(TrialState.FAIL, void=f"not run: {result}"[:1000])
        return _Outcome(TrialState.FAIL, failure=f"{type(result).__name__}: {result}"[:1000])
    try:
        value = float(result)
    except (TypeError, ValueError):
        failure = (
            f"the task returned {result!r}; an Optuna sweep needs it to return the objective "
            "(the final validation loss) as a float"
        )
        return _Outcome(TrialState.FAIL, failure=failure, fatal=True)
    if not math.isfinite(value):
        return _Outcome(TrialState.FAIL, failure=f"objective value is {value}")
    return _Outcome(TrialState.COMPLETE, value)


def _log_outcome(study: optuna.Study, trial: optuna.Trial, plan: Plan, outcome: _Outcome, frozen: FrozenTrial,
                 job: JobReturn) -> None:
    """One line for a trial's outcome: its value, pruned, void or failed (with the traceback)."""
    shown = " ".join(d.override(trial.params[d.name]) for d in plan.dimensions)
    if outcome.state == TrialState.COMPLETE:
        log.info(
            "%s trial %d: %s -> %.6g", study.study_name, trial.number, shown, outcome.value
        )
    elif outcome.state == TrialState.PRUNED:
        log.info(
            "%s trial %d: %s -> pruned at step %s",
            study.study_name,
            trial.number,
            shown,
            frozen.last_step,
        )
    elif outcome.void is not None:
        log.warning(
            "%s trial %d: %s -> void, does not count (%s)",
            study.study_name,
            trial.number,
            shown,
            outcome.void,
        )
    else:
        error = job._return_value
        log.warning(
            "%s trial %d: %s -> failed: %s",
            study.study_name,
            trial.number,
            shown,
            outcome.failure,
            exc_info=(type(error), error, error.__traceback__)
            if isinstance(error, BaseException)
            else None,
        )


def _raise_wrapped_interrupt(job: JobReturn) -> None:
    """A Ctrl-C that lands inside a library call can come back as that library's error: SQLAlchemy,
    interrupted mid-commit, raises "database is locked" with the KeyboardInterrupt as its context.
    It is still the user's interrupt, not the trial's failure: raise it again, as a KeyboardInterrupt."""
    error = job._return_value if job.status != JobStatus.COMPLETED else None
    seen: set[int] = set()
    while isinstance(error, BaseException) and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            raise KeyboardInterrupt(*error.args) from None
        seen.add(id(error))
        error = error.__cause__ or error.__context__


def _sample_value(distribution: Any) -> Any:
    if isinstance(distribution, CategoricalDistribution):
        return distribution.choices[0]
    return distribution.low


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    """SIGTERM (a scheduler's preemption, `kill`) is taken as Ctrl-C: void the trial and stop."""
    raise KeyboardInterrupt("SIGTERM")  # the name a trial's own stop request gives too
