"""The search strategy: Optuna sampler and pruner objects built from ``hydra.sweeper`` settings.

Design decisions:
* A fresh sampler per study. Samplers carry state (random generator, CMA-ES's population), and a
  seeded sampler per study means every grid cell starts from the same points.
* The grid sampler is bounded by the sweeper, not by Optuna: the sweeper caps ``n_trials`` at the
  grid's size, and the sampler's own "grid exhausted" hook is switched off, because it calls
  ``Study.stop()``, which raises outside ``Study.optimize`` (the sweeper uses ask/tell).
* Options that only make sense for some classes are passed to those classes only; ``kwargs`` goes
  to the chosen class, and a wrong keyword comes back as one configuration error line.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Callable

import optuna
from optuna.pruners import BasePruner
from optuna.samplers import BaseSampler

from ._space import Dimension
from .config import PrunerConf, SamplerConf, SweeperConfigError


class _BoundedGridSampler(optuna.samplers.GridSampler):
    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        # The sweeper stops at n_trials <= grid size itself; Optuna's version would call
        # Study.stop(), which only works inside Study.optimize.
        return None


def grid_size(dimensions: tuple[Dimension, ...]) -> int:
    return math.prod(len(d.grid_values()) for d in dimensions)


def make_sampler(conf: SamplerConf, dimensions: tuple[Dimension, ...]) -> BaseSampler:
    kwargs: dict[str, Any] = dict(conf.kwargs)
    if conf.name in ("tpe", "gp", "cmaes") and conf.n_startup_trials is not None:
        kwargs["n_startup_trials"] = conf.n_startup_trials
    factories: dict[str, Callable[..., BaseSampler]] = {
        "tpe": optuna.samplers.TPESampler,
        "gp": optuna.samplers.GPSampler,
        "cmaes": optuna.samplers.CmaEsSampler,
        "random": optuna.samplers.RandomSampler,
    }
    if conf.name == "cmaes" and importlib.util.find_spec("cmaes") is None:
        # Optuna only imports it at the first sampled trial; say it before anything runs.
        raise SweeperConfigError("sampler cmaes needs the 'cmaes' package: pip install cmaes")
    if conf.name == "grid":
        space = {d.name: d.grid_values() for d in dimensions}
        return _construct("sampler", _BoundedGridSampler, space, seed=conf.seed, **kwargs)
    return _construct("sampler", factories[conf.name], seed=conf.seed, **kwargs)


def make_pruner(conf: PrunerConf) -> BasePruner:
    kwargs: dict[str, Any] = dict(conf.kwargs)
    if conf.reduction_factor is not None and conf.name in ("successive_halving", "hyperband"):
        kwargs["reduction_factor"] = conf.reduction_factor
    if conf.name == "median":
        return _construct(
            "pruner",
            optuna.pruners.MedianPruner,
            n_startup_trials=conf.n_startup_trials,
            n_warmup_steps=conf.n_warmup_steps,
            interval_steps=conf.interval_steps,
            **kwargs,
        )
    if conf.name == "successive_halving":
        return _construct(
            "pruner",
            optuna.pruners.SuccessiveHalvingPruner,
            min_resource=conf.min_resource,
            **kwargs,
        )
    if conf.name == "hyperband":
        # Hyperband's min_resource is an integer (no "auto"); its own default is 1.
        if conf.min_resource != "auto":
            kwargs["min_resource"] = conf.min_resource
        return _construct("pruner", optuna.pruners.HyperbandPruner, **kwargs)
    return optuna.pruners.NopPruner()


_RELEVANT = {
    "tpe": ("seed", "n_startup_trials"),
    "gp": ("seed", "n_startup_trials"),
    "cmaes": ("seed", "n_startup_trials"),
    "random": ("seed",),
    "grid": ("seed",),
    "median": ("n_startup_trials", "n_warmup_steps", "interval_steps"),
    "successive_halving": ("min_resource", "reduction_factor"),
    "hyperband": ("min_resource", "reduction_factor"),
    "none": (),
}


def describe(conf: SamplerConf | PrunerConf) -> str:
    """A short text for MLflow tags and the log, e.g. ``tpe(seed=0)``."""
    fields = {k: getattr(conf, k) for k in _RELEVANT[conf.name] if getattr(conf, k) is not None}
    fields.update(conf.kwargs)
    return f"{conf.name}({', '.join(f'{k}={v}' for k, v in fields.items())})"


def _construct(kind: str, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return factory(*args, **kwargs)
    except (TypeError, ValueError) as error:
        raise SweeperConfigError(f"{kind} {factory.__name__.lstrip('_')}: {error}") from None
