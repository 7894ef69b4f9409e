"""Trial accounting: which trials count toward a cell's ``n_trials``, and its failure budget.

Done = complete + pruned + failed: a diverging learning rate is a result, not an accident. Void
trials (interrupted, a dead worker, surplus) stay in the study as FAIL without ``attnres.failure``,
which samplers ignore, and are run again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

FAILURE_ATTR = "attnres.failure"
VOID_ATTR = "attnres.void"


def is_genuine_failure(trial: FrozenTrial) -> bool:
    # Marked by the sweeper; a FAIL without the mark is void (also one failed by Optuna's stale check).
    return trial.state == TrialState.FAIL and FAILURE_ATTR in trial.user_attrs


def counts(trial: FrozenTrial) -> bool:
    """Whether the trial uses up one of the cell's n_trials (running ones included)."""
    return trial.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING) or (
        is_genuine_failure(trial)
    )


@dataclass(frozen=True)
class Ledger:
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    void: int = 0
    running: int = 0

    @classmethod
    def of(cls, trials: Iterable[FrozenTrial]) -> "Ledger":
        tally = dict(complete=0, pruned=0, failed=0, void=0, running=0)
        for trial in trials:
            if trial.state == TrialState.COMPLETE:
                tally["complete"] += 1
            elif trial.state == TrialState.PRUNED:
                tally["pruned"] += 1
            elif trial.state == TrialState.RUNNING:
                tally["running"] += 1
            elif is_genuine_failure(trial):
                tally["failed"] += 1
            elif trial.state == TrialState.FAIL:
                tally["void"] += 1
            # WAITING (enqueued, not started) trials are neither: ask() will start them.
        return cls(**tally)

    @property
    def done(self) -> int:
        return self.complete + self.pruned + self.failed

    def to_start(self, n_trials: int) -> int:
        """How many more trials a worker may start now."""
        return max(0, n_trials - self.done - self.running)


def rank(trials: Iterable[FrozenTrial], number: int) -> int:
    """1-based position of trial ``number`` among the counting trials, in trial-number order.

    Two workers can both pass `to_start` at once; the storage numbers trials uniquely, so a trial
    ranked past n_trials is surplus and is voided before its job runs."""
    return sum(1 for t in trials if t.number <= number and counts(t))


def failure_budget(n_trials: int, max_failure_rate: float) -> int:
    """How many failed trials a cell may have before the sweep stops."""
    # The epsilon keeps 0.3 * 10 at 3, not 2.9999999999999996 -> 2.
    return math.floor(max_failure_rate * n_trials + 1e-9)
