"""The Hydra ``Sweeper`` plugin class: a thin shell that Hydra can find and instantiate.

Design decision: Hydra's plugin scan imports this module (and ``config``) at the start of every
Hydra app, so the class only stores its settings; Optuna, MLflow and the sweep loop are imported
in ``setup``, i.e. only when a multirun actually uses this sweeper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, List

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from .settings import AttnresOptunaSweeperConf, validate


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

    @staticmethod
    def check_jobs(config: DictConfig, check: Callable[[DictConfig], Any] | None = None) -> None:
        """Refuse bad options, or grid cells whose jobs do not compose, from the multirun config
        alone (SweeperConfigError); `check`, the app's validation of a job config, sees each
        cell's job (its errors raised as they are). For a multirun callback that writes before Hydra sets the
        sweeper up (harness.callbacks creates the MLflow store): a refused sweep leaves nothing."""
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from ._runner import compose_jobs, study_prefix
        from ._space import build_plan, enqueued_points
        from ._storage import base_directory, resolve_url
        from ._strategy import make_pruner, make_sampler

        merged = OmegaConf.merge(OmegaConf.structured(AttnresOptunaSweeperConf), config.hydra.sweeper)
        settings: AttnresOptunaSweeperConf = OmegaConf.to_object(merged)  # type: ignore
        validate(settings)
        loader = GlobalHydra.instance().config_loader()
        arguments = OmegaConf.to_container(config.hydra.overrides.task)  # what Hydra passes to sweep()
        plan = build_plan(arguments, settings.params, OverridesParser.create(config_loader=loader))
        enqueued_points(settings.enqueue, plan)
        make_sampler(settings.sampler, plan.dimensions)
        make_pruner(settings.pruner)
        compose_jobs(loader, config, settings, plan, study_prefix(settings, config), check)
        resolve_url(settings.storage, base_directory(OmegaConf.select(config, "hydra.runtime.cwd")))

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
