"""The jobs of a multirun on a fixed set of GPUs: one job per GPU at a time, the next job starting
as soon as a GPU is free (submitit's own local executor starts every job at once on the same GPUs).

Each job is a fresh submitit process: CUDA_VISIBLE_DEVICES only counts if set before CUDA starts in
the process, so neither a thread nor a fork would do. No job outlives the multirun: SIGTERM is
passed on, the jobs checkpoint and are waited for, and the multirun exits 75, as a single run does.
"""
from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides

from harness.stopping import on_sigterm

from ._job_side import REQUEUE_EXIT

log = logging.getLogger(__name__)
STOP_WAIT_SECONDS = 300  # a stopping job writes its checkpoint first: minutes for a large model


class _Terminated(Exception):
    """SIGTERM reached the launching process."""


def run_on_gpus(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int,
                gpus: list[int], settings: dict[str, Any]) -> list[JobReturn]:
    import submitit

    executor = submitit.LocalExecutor(folder=settings["submitit_folder"], max_num_timeout=settings["max_num_timeout"])
    Path(str(launcher.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    log.info(f"local_gpus: {len(job_overrides)} jobs on GPUs {gpus}, one job per GPU at a time; "
             f"output in {launcher.config.hydra.sweep.dir}")
    free = list(gpus)
    running: dict[int, tuple[Any, int]] = {}  # job's position -> (submitit job, its GPU)
    results: list[Any] = [None] * len(job_overrides)

    def reap() -> None:
        for i, (job, gpu) in list(running.items()):
            if job.done():
                results[i] = _result(job, job_overrides[i])
                free.append(gpu)
                del running[i]

    try:
        with on_sigterm(_raise_terminated):
            for i, overrides in enumerate(job_overrides):
                reap()
                while not free:
                    time.sleep(settings["poll_seconds"])
                    reap()
                gpu = free.pop(0)
                executor.update_parameters(
                    timeout_min=settings["timeout_min"], signal_delay_s=settings["signal_delay_s"],
                    stderr_to_stdout=settings["stderr_to_stdout"], tasks_per_node=1, gpus_per_node=1,
                    visible_gpus=[gpu],
                )
                idx = initial_job_idx + i
                job = executor.submit(launcher, list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}",
                                      Singleton.get_state())
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))} (GPU {gpu}, pid {job.job_id})")
                running[i] = (job, gpu)
            while running:
                time.sleep(settings["poll_seconds"])
                reap()
    except BaseException as stop:
        _stop([job for job, _ in running.values()])
        if isinstance(stop, _Terminated):
            print(f"local_gpus: SIGTERM; {len(running)} running job(s) checkpointed and stopped; "
                  f"exit {REQUEUE_EXIT} = rerun the same command to resume", file=sys.stderr, flush=True)
            raise SystemExit(REQUEUE_EXIT) from None
        raise
    return results


def _result(job: Any, overrides: Sequence[str]) -> JobReturn:
    try:
        return job.result()
    except Exception as error:  # no result: killed, exited 75, or submitit refused to requeue
        return JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=error)


def _stop(jobs: list[Any]) -> None:
    """SIGTERM to each job's controller (which passes it on to the job), again every few seconds
    (a job still starting up ignores it: submitit's handler; training installs the job's own);
    wait for them to end; cancel what is left after STOP_WAIT_SECONDS."""
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    while time.monotonic() < deadline:
        alive = [job for job in jobs if job._process is not None and job._process.poll() is None]
        if not alive:
            break
        for job in alive:
            job._process.send_signal(signal.SIGTERM)
        for _ in range(25):
            if all(job._process.poll() is not None for job in alive):
                break
            time.sleep(0.2)
    for job in jobs:
        if not job.done():
            job.cancel(check=False)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()
