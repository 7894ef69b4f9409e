"""The one thing a training loop needs to know about hyper-parameter search: report and maybe stop.

After each validation the loop calls ``pruning.report(step, val_loss)``, which raises
``TrialPruned`` when the trial should stop and does nothing outside a sweep. The Optuna sweeper
binds the live trial here around each in-process launch; a module global, not a context variable,
so a helper thread sees it too. Nothing here imports Optuna (docs/SWEEPER.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

__all__ = ["TrialPruned", "TrialNotRun", "active", "report", "record_run", "current_trial", "bind"]


class TrialPruned(Exception):
    """Raised by ``report`` when the pruner decided this trial is hopeless. Re-raise it."""


class TrialNotRun(RuntimeError):
    """The job did not train this trial's config, and the config is not to blame: another process
    holds that exact run (two workers that drew the same point). The sweeper voids the trial, so
    it counts neither as a trial nor against ``max_failure_rate``; the other process's own trial
    records the result."""


class _Trial(Protocol):
    number: int

    def report(self, value: float, step: int) -> None: ...

    def should_prune(self) -> bool: ...


_trial: _Trial | None = None
RUN_ID_ATTR = "mlflow.run_id"  # the trial's user attribute naming its job's MLflow run


def active() -> bool:
    """True while a sweeper trial is bound, i.e. inside a job launched by the Optuna sweeper."""
    return _trial is not None


def current_trial() -> Any | None:
    """The bound ``optuna.Trial`` (for tags such as its number), or None outside a sweep."""
    return _trial


def report(step: int, value: float) -> None:
    """Give the trial one intermediate objective value; raise ``TrialPruned`` if it should stop.

    ``step`` is the loop's own step counter (the same axis as ``val/loss`` in MLflow) and must
    grow; Optuna ignores a second report for the same step. A non-finite value is passed on as is:
    the median pruner prunes it, and the loop raises ``FloatingPointError`` on a non-finite loss
    anyway.
    """
    trial = _trial
    if trial is None:
        return
    value = float(value)
    trial.report(value, int(step))
    if trial.should_prune():
        shown = f"{value:.6g}" if math.isfinite(value) else str(value)
        raise TrialPruned(f"trial {trial.number} pruned at step {int(step)} (value {shown})")


def record_run(run_id: str) -> None:
    """Note the job's MLflow run on the bound trial as soon as the run starts (user attribute
    ``mlflow.run_id``). A worker killed hard never tells its trial; the worker that later fails
    the trial as stale finds its run here and ends it, which would otherwise stay RUNNING."""
    trial = _trial
    if trial is not None and hasattr(trial, "set_user_attr"):
        trial.set_user_attr(RUN_ID_ATTR, run_id)


@contextmanager
def bind(trial: _Trial) -> Iterator[None]:
    """Make ``trial`` the current one for the duration of a job. Used by the sweeper only."""
    global _trial
    if _trial is not None:
        # Two bound trials would mean two jobs in one process at once: their reports would mix.
        raise RuntimeError("harness.pruning: a trial is already bound in this process")
    _trial = trial
    try:
        yield
    finally:
        _trial = None
