"""What a submitit job process does around the Hydra job: checkpoint before a requeue, return a
result the launching process can load.

Design decisions:
* **Checkpoint first, then requeue.** submitit's own handler of its preemption/timeout signal
  (USR2; SLURM sends it ``signal_delay_s`` before the time limit, ``--signal=USR2@…``) pickles
  the call, requeues the job (``scontrol requeue`` on SLURM; exit 144 locally, which submitit's
  local controller restarts) and exits at once — mid-step, losing the work since the last
  periodic checkpoint. While the job has a SIGTERM handler of its own (the harness installs one
  for the length of training: stop after this step, checkpoint, end the MLflow run KILLED, exit
  ``REQUEUE_EXIT``), the signal is handed to that handler instead, and submitit's requeue runs
  once the job has exited with ``REQUEUE_EXIT``. Outside training there is nothing to save:
  submitit requeues at once. The requeued job reruns the same config, whose run folder holds the
  checkpoint and the MLflow run id, so it resumes into the same MLflow run.
* **A plain SIGTERM is not requeued here.** SLURM sends it on preemption (and then requeues the
  job itself when its PreemptMode says so) and on ``scancel`` (which must stay cancelled); the
  job checkpoints and exits 75 either way, and SLURM decides.
* **Results that cross the process boundary must load.** A failed job's exception travels back
  pickled; one whose constructor takes other arguments than ``args`` and that does not say how
  to rebuild itself (``__reduce__``, as the harness's NonFiniteLoss does) cannot be unpickled,
  and the launching process would lose every result. Such an exception is replaced by a
  RuntimeError carrying its type name and message.
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
    """Route submitit's requeue signal through the job's own SIGTERM handler (see above)."""
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
    """The JobReturn, its exception replaced by a RuntimeError if it would not unpickle."""
    error = getattr(job_return, "_return_value", None)
    if isinstance(error, BaseException):
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:
            job_return._return_value = RuntimeError(f"{type(error).__name__}: {error}")
    return job_return
