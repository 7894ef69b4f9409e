"""The Hydra ``Sweeper`` plugin class: a thin shell that Hydra can find and instantiate.

Design decision: Hydra's plugin scan imports this module (and ``config``) at the start of every
Hydra app, so the class only stores its settings; Optuna, MLflow and the sweep loop are imported
in ``setup``, i.e. only when a multirun actually uses this sweeper.
"""

from __future__ import annotations

from typing import Any, List

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from .config import AttnresOptunaSweeperConf, validate


class AttnresOptunaSweeper(Sweeper):
    # Read by harness.callbacks: this sweeper makes one MLflow parent run per study, so the
    # multirun callback must not make its own parent for the whole multirun.
    manages_mlflow_runs = True

    def __init__(self, **settings: Any) -> None:
        # Hydra instantiates the class from `hydra.sweeper`, which it already checked against
        # AttnresOptunaSweeperConf; turning it back into the dataclass gives typed access.
        merged = OmegaConf.merge(OmegaConf.structured(AttnresOptunaSweeperConf), settings)
        self.settings: AttnresOptunaSweeperConf = OmegaConf.to_object(merged)  # type: ignore
        self._runner: Any = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        # Validated here, not in __init__: Hydra wraps errors raised during instantiation in a
        # multi-line "Error in call to target" report; from setup the message stays one line.
        validate(self.settings)
        from ._runner import SweepRunner

        self.hydra_context = hydra_context
        self.config = config
        self._runner = SweepRunner(
            settings=self.settings,
            hydra_context=hydra_context,
            task_function=task_function,
            config=config,
        )
        self.launcher = self._runner.launcher

    def sweep(self, arguments: List[str]) -> Any:
        assert self._runner is not None, "setup() must run before sweep()"
        return self._runner.run(arguments)
