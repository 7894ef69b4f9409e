"""What a submitit job process does around the Hydra job: checkpoint before a requeue, return a
result the launching process can load.

submitit's own USR2 handler would requeue mid-step, losing the work since the last checkpoint; while
the job has its own SIGTERM handler, USR2 goes there, and submitit requeues once the job exits with
REQUEUE_EXIT. A plain SIGTERM is not requeued here: SLURM decides (docs/RELIABILITY.md).
"""
from __future__ import annotations

import pickle
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from harness.stopping import REQUEUE_EXIT  # "checkpointed on request; run me again" (no torch)


def _is_submitit_handler(handler: Any) -> bool:
    from submitit.core.job_environment import SignalHandler

    return isinstance(getattr(handler, "__self__", None), SignalHandler)


@contextmanager
def checkpoint_before_requeue() -> Iterator[None]:
    """Route submitit's requeue signal through the job's own SIGTERM handler; outside training
    (no handler of the job's) there is nothing to save and submitit requeues at once."""
    from submitit.core.job_environment import JobEnvironment

    usr_signal = JobEnvironment._usr_sig()
    requeue = signal.getsignal(usr_signal)
    if not _is_submitit_handler(requeue) or threading.current_thread() is not threading.main_thread():
        yield  # not inside a submitit job (or not where signals arrive): nothing to route
        return
    received: list[int] = []

    def on_requeue_signal(signum: int, frame: Any) -> None:
        job_handler = signal.getsignal(signal.SIGTERM)
        if callable(job_handler) and not _is_submitit_handler(job_handler):
            received.append(signum)
            job_handler(signum, frame)  # the job's "checkpoint and stop" (told which signal came)
        else:
            requeue(signum, frame)

    signal.signal(usr_signal, on_requeue_signal)
    try:
        yield
    except SystemExit as stop:
        signal.signal(usr_signal, requeue)
        if received and stop.code == REQUEUE_EXIT:
            requeue(received[0], None)  # submitit: pickle, requeue and exit (or refuse: raises)
        raise
    finally:
        signal.signal(usr_signal, requeue)


def export_torch_distributed() -> None:
    """With several tasks per job (one per GPU), give each torchrun's variables (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which the harness reads. CUDA_VISIBLE_DEVICES
    is left as SLURM set it: each task picks cuda:LOCAL_RANK."""
    import submitit

    if submitit.JobEnvironment().num_tasks > 1:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def loadable(job_return: Any) -> Any:
    """The JobReturn, its exception replaced by a RuntimeError if it would not unpickle: one such
    exception (other constructor arguments, no __reduce__) would lose the launcher every result."""
    error = getattr(job_return, "_return_value", None)
    if isinstance(error, BaseException):
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:
            job_return._return_value = RuntimeError(f"{type(error).__name__}: {error}")
    return job_return
