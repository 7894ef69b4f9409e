"""Trial accounting: which trials count toward a cell's ``n_trials``, and its failure budget.

Design decisions:
* **Done = complete + pruned + failed.** A failed trial is an honest attempt (a diverging learning
  rate is a result, not an accident); rerunning it forever would waste the budget.
* **Void trials do not count.** A trial is void when it was stopped by something other than its
  own configuration: the user's Ctrl-C / SIGTERM (``interrupted``), a dead worker found by the
  heartbeat check, or a surplus trial (see below). Void trials stay in the study as FAIL, which
  samplers ignore, and the next run of the sweep replaces them. The sweeper marks a *genuine*
  failure with the user attribute ``attnres.failure`` (the reason); a FAIL without it is void.
  That also covers trials failed by Optuna's stale-trial check, which cannot be annotated.
* **Several workers, exactly n_trials.** A worker starts a trial only while done + running is
  below n_trials; two workers can still pass that check at the same moment. Trial numbers are
  assigned by the storage, one per trial, so each worker then checks its trial's rank among the
  counting trials: past n_trials it is surplus and is voided before any job runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

FAILURE_ATTR = "attnres.failure"
VOID_ATTR = "attnres.void"


def is_genuine_failure(trial: FrozenTrial) -> bool:
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
    """1-based position of trial ``number`` among the counting trials, in trial-number order."""
    return sum(1 for t in trials if t.number <= number and counts(t))


def failure_budget(n_trials: int, max_failure_rate: float) -> int:
    """How many failed trials a cell may have before the sweep stops."""
    # The epsilon keeps 0.3 * 10 at 3, not 2.9999999999999996 -> 2.
    return math.floor(max_failure_rate * n_trials + 1e-9)
