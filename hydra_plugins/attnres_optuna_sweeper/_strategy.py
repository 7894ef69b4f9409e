"""The search strategy: Optuna sampler and pruner objects built from ``hydra.sweeper`` settings.

Each study gets a fresh sampler; a seeded one draws trial n from the seed (seed, n), so a resumed
study or a second worker never repeats earlier trials' points. The sweeper, not Optuna, bounds the
grid, and the median pruner prunes only beyond a margin (docs/SWEEPER.md).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import statistics
from typing import Any, Callable

import optuna
from optuna.pruners import BasePruner
from optuna.samplers import BaseSampler
from optuna.trial import TrialState

from ._ledger import counts
from ._space import Dimension
from .settings import PrunerConf, SamplerConf, SweeperConfigError


class _BoundedGridSampler(optuna.samplers.GridSampler):
    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        # The sweeper stops at n_trials <= grid size itself; Optuna's version would call
        # Study.stop(), which only works inside Study.optimize.
        return None

    def _get_unvisited_grid_ids(self, study: Any) -> list[int]:
        # Optuna takes every finished trial's point as visited, a void one too (interrupted, a dead
        # worker's, surplus: FAIL without attnres.failure). Its point was never evaluated: it must
        # be run again, not replaced by a repeat of a finished point.
        visited, running = set(), set()
        for t in study._storage.get_all_trials(study._study_id, deepcopy=False):
            if "grid_id" not in t.system_attrs or not self._same_search_space(
                t.system_attrs["search_space"]
            ):
                continue
            if t.state == TrialState.RUNNING:
                running.add(t.system_attrs["grid_id"])
            elif t.state.is_finished() and counts(t):
                visited.add(t.system_attrs["grid_id"])
        every = set(range(self._n_min_trials))
        return sorted(every - visited - running) or sorted(every - visited)


def grid_size(dimensions: tuple[Dimension, ...]) -> int:
    return math.prod(len(d.grid_values()) for d in dimensions)


class _PerTrialSeedSampler(BaseSampler):
    """The sampler ``build(seed)`` makes, made afresh for each trial with the seed (seed, number)."""

    def __init__(self, build: Callable[[int], BaseSampler], seed: int) -> None:
        self._build, self._seed = build, seed
        self._inner = build(trial_seed(seed, 0))

    def before_trial(self, study: Any, trial: Any) -> None:
        self._inner = self._build(trial_seed(self._seed, trial.number))
        self._inner.before_trial(study, trial)

    def infer_relative_search_space(self, study: Any, trial: Any) -> Any:
        return self._inner.infer_relative_search_space(study, trial)

    def sample_relative(self, study: Any, trial: Any, search_space: Any) -> Any:
        return self._inner.sample_relative(study, trial, search_space)

    def sample_independent(self, study: Any, trial: Any, name: str, distribution: Any) -> Any:
        return self._inner.sample_independent(study, trial, name, distribution)

    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        self._inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._inner.reseed_rng()


def trial_seed(seed: int, number: int) -> int:
    import numpy as np

    return int(np.random.SeedSequence([seed % 2**32, number]).generate_state(1)[0])


def make_sampler(conf: SamplerConf, dimensions: tuple[Dimension, ...]) -> BaseSampler:
    if conf.seed is None or conf.name == "grid":
        # The grid sampler's seed shuffles the grid: a grid id names one point only under one seed.
        return _make_sampler(conf, dimensions, conf.seed)
    _make_sampler(conf, dimensions, conf.seed)  # bad options are refused here, not at the 1st trial
    # One stream per trial number: a stream restarted in every process would repeat earlier trials.
    return _PerTrialSeedSampler(lambda seed: _make_sampler(conf, dimensions, seed), conf.seed)


def _make_sampler(
    conf: SamplerConf, dimensions: tuple[Dimension, ...], seed: int | None
) -> BaseSampler:
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
        return _construct("sampler", _BoundedGridSampler, space, seed=seed, **kwargs)
    return _construct("sampler", factories[conf.name], seed=seed, **kwargs)


class MarginMedianPruner(optuna.pruners.MedianPruner):
    """Optuna's median pruner, which also needs the trial to be worse than the median by
    ``margin`` × |median| at the step it reports."""

    def __init__(self, *args: Any, margin: float = 0.0, **kwargs: Any) -> None:
        if not (margin >= 0 and math.isfinite(margin)):
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        super().__init__(*args, **kwargs)
        self._margin = margin

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        if not super().prune(study, trial):
            return False
        step = trial.last_step
        values = [v for v in trial.intermediate_values.values() if not math.isnan(v)]
        if not values:  # only NaN reported: Optuna prunes it, and so do we
            return True
        maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
        best = max(values) if maximize else min(values)
        others = [
            t.intermediate_values[step]
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if step in t.intermediate_values and not math.isnan(t.intermediate_values[step])
        ]
        median = float(statistics.median(others))
        gap = self._margin * abs(median)
        return best < median - gap if maximize else best > median + gap


def scaled_pruner(conf: PrunerConf, n_trials: int) -> PrunerConf:
    """The pruner settings a study of ``n_trials`` uses: the median pruner's warm-up is at most
    half of the study."""
    if conf.name != "median":
        return conf
    return dataclasses.replace(conf, n_startup_trials=min(conf.n_startup_trials, max(1, n_trials // 2)))


def make_pruner(conf: PrunerConf) -> BasePruner:
    kwargs: dict[str, Any] = dict(conf.kwargs)
    if conf.reduction_factor is not None and conf.name in ("successive_halving", "hyperband"):
        kwargs["reduction_factor"] = conf.reduction_factor
    if conf.name == "median":
        return _construct(
            "pruner",
            MarginMedianPruner,
            n_startup_trials=conf.n_startup_trials,
            n_warmup_steps=conf.n_warmup_steps,
            interval_steps=conf.interval_steps,
            margin=conf.margin,
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
    "median": ("n_startup_trials", "n_warmup_steps", "interval_steps", "margin"),
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
