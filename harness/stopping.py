"""How a job stops: the exit codes it stops with and where SIGTERM and Ctrl-C go.

A job stops at a step boundary with a checkpoint, never mid-write (harness.job uses these; the
Optuna sweeper and the launchers route their own signals into the same handler).
"""
from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from harness.train import Trainer

# Exit status of a run stopped by SIGTERM after checkpointing: sysexits' EX_TEMPFAIL ("temporary
# failure, the user is invited to retry"), distinct from 1 (an error: do not retry blindly), 2 (bad
# input), 124 (timeout(1)) and 137 (SIGKILL). A launcher or batch script requeues on it.
REQUEUE_EXIT = 75
INTERRUPT_EXIT = 130  # Ctrl-C (128 + SIGINT, the shell's convention), after the same checkpoint


class StopSignals:
    """Where SIGTERM and Ctrl-C go while a job holds its run: to the trainer as "checkpoint after
    this step and stop" rather than "die now" (a KeyboardInterrupt raised anywhere could land
    inside a write to the tracking store or the checkpoint; in an Optuna trial SQLAlchemy turns
    one caught mid-commit into "database is locked"). A signal that comes before the trainer
    exists (the checkpoint loading, the MLflow run opening) waits for it: training stops before its
    first step (Trainer.fit), KILLED, exit 75; with the default action the job died with 143,
    which no requeueing script reads as "requeue me", and its MLflow run stayed RUNNING. One that
    comes after training (plots, model) lets the job finish and then stops the process (exit 75,
    or 130 for Ctrl-C), as one during training does. A second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.received: str | None = None  # the last signal's name

    def attach(self, trainer: Trainer) -> Trainer:
        self.trainer = trainer
        if self.received:
            trainer.request_stop(self.received)
        return trainer

    def __call__(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C
        self.received = name
        if self.trainer is not None:
            self.trainer.request_stop(name)


@contextmanager
def stop_on_signals(stops: StopSignals):
    """SIGTERM and SIGINT go to `stops` (main thread only: Python delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        yield stops
        return
    previous = {s: signal.signal(s, stops) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stops
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def on_sigterm(handler: Callable[[int, Any], None]):
    """SIGTERM calls `handler` inside the block and the previous handler is back after it (main
    thread only: Python delivers signals there, and elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def requeue_on_sigterm():
    """Before a job holds its run (validation, data loading, taking the run folder) there is
    nothing to checkpoint: SIGTERM ends it at once with exit 75 ("requeue me") instead of the
    default action's 143. Left alone where a handler is already set (the Optuna sweeper's, which
    voids the trial)."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        print(f"stopped before training (SIGTERM); exit {REQUEUE_EXIT} = requeue me", file=sys.stderr, flush=True)
        raise SystemExit(REQUEUE_EXIT)

    with on_sigterm(stop):
        yield
