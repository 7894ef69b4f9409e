"""The Hydra ``Launcher`` classes: hydra-submitit-launcher's, with the harness's requeue contract.

Both keep its pickling of the Hydra job and its SLURM parameters; each job runs inside
``_job_side.checkpoint_before_requeue`` and returns a result that loads in the launching process, and
``LocalGpusLauncher`` launches through the one-job-per-GPU queue (``_gpu_queue``). Imported by
Hydra's plugin scan at every start, so submitit loads only when a job is launched.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn
from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_submitit_launcher import submitit_launcher as _submitit
from omegaconf import DictConfig


class _CheckpointBeforeRequeue:
    """Mixin: the job-side call of a submitit launcher (runs in the job's own process)."""

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        from ._job_side import (
            checkpoint_before_requeue,
            export_torch_distributed,
            loadable,
        )

        export_torch_distributed()
        with checkpoint_before_requeue():
            return loadable(super().__call__(*args, **kwargs))  # type: ignore[misc]


class AttnresSlurmLauncher(_CheckpointBeforeRequeue, _submitit.SlurmLauncher):
    """``hydra/launcher=slurm`` (conf/hydra/launcher/slurm.yaml): one SLURM array task per job."""


class LocalGpusLauncher(_CheckpointBeforeRequeue, _submitit.LocalLauncher):
    """``hydra/launcher=local_gpus``: the jobs in parallel on this machine, one GPU each."""

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.gpus = gpu_list(self.params.get("gpus"))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from ._gpu_queue import run_on_gpus

        return run_on_gpus(self, job_overrides, initial_job_idx, self.gpus, self.params)


def gpu_list(value: Any) -> list[int]:
    """hydra.launcher.gpus, checked; null: the GPUs this machine shows. Bad value: one line, exit 2."""
    allowed = "allowed: a non-empty list of distinct GPU indices, e.g. hydra.launcher.gpus=[0,1,2,3]"
    if value is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            entries = [v.strip() for v in visible.split(",") if v.strip()]
            if not all(v.isdigit() for v in entries):
                _refuse(f"hydra.launcher.gpus=null and CUDA_VISIBLE_DEVICES={visible!r} is not a list of "
                        f"indices; {allowed}")
            gpus = [int(v) for v in entries]
        else:
            import torch

            gpus = list(range(torch.cuda.device_count()))
        if not gpus:
            _refuse(f"hydra.launcher.gpus=null: this machine shows no GPU; {allowed}")
        return gpus
    gpus = list(value) if isinstance(value, (list, tuple)) else None
    if not gpus or len(set(gpus)) != len(gpus) or not all(isinstance(g, int) and g >= 0 for g in gpus):
        _refuse(f"hydra.launcher.gpus={value}: {allowed}")
    return gpus


def _refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)
