"""The ``local_gpus`` launcher's configuration, registered with Hydra as ``hydra/launcher=local_gpus``.

A structured config, so a misspelt option is refused while Hydra composes. Hydra's plugin scan
imports this module at every start of every app: nothing heavy here, and no
``from __future__ import annotations`` (dataclasses cannot resolve string annotations during the scan).
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
    # Minutes before submitit stops a job (USR2 signal_delay_s before: checkpoint, requeue); a week,
    # since one's own machine has no scheduler's time limit to respect.
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
