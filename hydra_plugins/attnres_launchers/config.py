"""The ``local_gpus`` launcher's configuration, registered with Hydra as ``hydra/launcher=local_gpus``.

Design decisions:
* A structured config (a dataclass), so that a misspelt option (``hydra.launcher.gpu=[0]``) is
  refused while Hydra composes, before any job starts.
* ``gpus`` holds the indices CUDA_VISIBLE_DEVICES understands (physical ones, as nvidia-smi
  numbers them); each job is started with CUDA_VISIBLE_DEVICES set to one of them, so it sees a
  single GPU, ``cuda:0``. null: every GPU this machine shows.
* ``timeout_min`` defaults to a week: submitit's local executor stops a job at its timeout, and
  a run on one's own machine has no scheduler's time limit to respect.
* Hydra's plugin scan imports this module at every start of every Hydra app: nothing heavy here.
  No ``from __future__ import annotations``: dataclasses cannot resolve string annotations while
  the scan runs the module.
"""

from dataclasses import dataclass
from typing import List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class LocalGpusConf:
    _target_: str = "hydra_plugins.attnres_launchers.launchers.LocalGpusLauncher"
    # GPU indices, one job at a time on each; null: all the GPUs CUDA_VISIBLE_DEVICES (or, unset,
    # the driver) shows. A list of n GPUs runs n jobs at once.
    gpus: Optional[List[int]] = None
    # Minutes before submitit stops a job (USR2 signal_delay_s before: checkpoint, requeue).
    timeout_min: int = 10080
    signal_delay_s: int = 120
    # Times a job that reached timeout_min is started again (it resumes from its checkpoint).
    max_num_timeout: int = 3
    # Seconds between looks at the running jobs (a finished job frees its GPU within this time).
    poll_seconds: float = 0.5
    # submitit's folder: each job's pickled call, result and stdout/stderr logs.
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"
    stderr_to_stdout: bool = False


ConfigStore.instance().store(
    group="hydra/launcher", name="local_gpus", node=LocalGpusConf, provider="attnres_launchers"
)
