"""The sweeper's configuration: its schema, its registration with Hydra, and its validation.

Selected with ``hydra/sweeper=attnres_optuna``; every field below is then ``hydra.sweeper.<field>``,
and a mistyped one is refused before anything runs. Hydra's plugin scan imports this module at every
start, so it imports nothing heavy, and has no ``from __future__ import annotations`` (dataclasses
cannot resolve string annotations while the scan runs it).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException

SAMPLERS = ("tpe", "gp", "cmaes", "random", "grid")
PRUNERS = ("median", "successive_halving", "hyperband", "none")
DIRECTIONS = ("minimize", "maximize")


class SweeperConfigError(CompactHydraException):
    """A configuration the sweeper cannot run; the message is the whole story, on one line.
    `exit_code`: where the app reports such errors itself (run.py, harness.composition_errors),
    the line alone and this exit status, the harness's for bad input."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(f"attnres_optuna sweeper: {message}")


class SweepAborted(CompactHydraException):
    """The sweep stopped on purpose (too many failed trials, an unusable objective: exit status 1;
    Ctrl-C: 130; SIGTERM: 75, as a stopped training run)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(f"attnres_optuna sweeper: {message}")
        self.exit_code = exit_code


@dataclass
class SamplerConf:
    # tpe (default) | gp | cmaes (needs the `cmaes` package) | random | grid (choice/range only)
    name: str = "tpe"
    # Trial n of every study draws from (seed, n): every grid cell then starts from the same points,
    # which is what a fair per-variant comparison wants, and a resumed study or a second worker
    # never repeats earlier trials' points (_strategy).
    seed: Optional[int] = None
    # Random trials before the model-based samplers take over (null: Optuna's default).
    n_startup_trials: Optional[int] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class PrunerConf:
    # median (default) | successive_halving | hyperband | none
    name: str = "median"
    # median: trials that finish before pruning starts (at most half the study's n_trials), steps
    # before a trial can be pruned, and how much worse than the median a trial must be to be
    # pruned, as a fraction of the median (0.02: 2% above the median loss)
    n_startup_trials: int = 5
    n_warmup_steps: int = 0
    interval_steps: int = 1
    margin: float = 0.02
    # successive_halving / hyperband: smallest resource (reported step) and the halving factor
    # (null: Optuna's default, 4 for successive halving, 3 for hyperband)
    min_resource: Any = "auto"
    reduction_factor: Optional[int] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class MlflowConf:
    # Also off when the task config says tracking.enabled: false.
    enabled: bool = True
    # null: the task config's tracking.uri, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    # in the directory the sweep was started from.
    tracking_uri: Optional[str] = None
    # null: the task config's tracking.experiment, else sweep.name, else "default"
    # (RUN_SCHEMA: the experiment is the sweep name); trial runs must land in the same one.
    experiment: Optional[str] = None
    # The override through which each job learns its parent run (forced with ++).
    parent_run_key: str = "tracking.parent_run_id"
    # Optuna's study plots as artifacts of the study's parent run.
    plots: bool = True


@dataclass
class AttnresOptunaSweeperConf:
    _target_: str = "hydra_plugins.attnres_optuna_sweeper.sweeper.AttnresOptunaSweeper"
    # Prefix of every study name: "<study_name>/<key>=<value>/..." per grid cell.
    # null: the task config's sweep.name, else the Hydra job name.
    study_name: Optional[str] = None
    direction: str = "minimize"
    # Trials per grid cell, counting complete, pruned and failed ones (interrupted do not count).
    n_trials: int = 20
    # SQLAlchemy URL; null: sqlite:///optuna.db in the directory the sweep was started from.
    storage: Optional[str] = None
    sampler: SamplerConf = field(default_factory=SamplerConf)
    pruner: PrunerConf = field(default_factory=PrunerConf)
    # The sweep stops once more than this fraction of a cell's n_trials has failed.
    max_failure_rate: float = 0.25
    # key -> value, in command-line syntax ("block,full", "tag(log, interval(1e-4, 3e-2))");
    # a command-line override of the same key wins.
    params: Dict[str, Any] = field(default_factory=dict)
    # Points to try first in a new study, e.g. [{optim.lr: 3e-3}] (the baseline's tuned value).
    enqueue: List[Dict[str, Any]] = field(default_factory=list)
    # Seconds between heartbeats of a running trial; a trial silent for grace_period (null: twice
    # the interval) belongs to a dead worker and is failed, not counted, and run again.
    heartbeat_interval: int = 60
    grace_period: Optional[int] = None
    mlflow: MlflowConf = field(default_factory=MlflowConf)


ConfigStore.instance().store(
    group="hydra/sweeper",
    name="attnres_optuna",
    node=AttnresOptunaSweeperConf,
    provider="attnres_optuna_sweeper",
)


def validate(conf: AttnresOptunaSweeperConf) -> None:
    """Raise ``SweeperConfigError`` naming the first bad option and what it accepts."""

    def one_of(option: str, value: str, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            raise SweeperConfigError(
                f"hydra.sweeper.{option}={value!r} is not one of {', '.join(allowed)}"
            )

    one_of("direction", conf.direction, DIRECTIONS)
    one_of("sampler.name", conf.sampler.name, SAMPLERS)
    one_of("pruner.name", conf.pruner.name, PRUNERS)
    if conf.n_trials < 1:
        raise SweeperConfigError(f"hydra.sweeper.n_trials={conf.n_trials} must be at least 1")
    if not 0.0 <= conf.max_failure_rate <= 1.0:
        raise SweeperConfigError(
            f"hydra.sweeper.max_failure_rate={conf.max_failure_rate} must be within [0, 1]"
        )
    if conf.heartbeat_interval < 1:
        raise SweeperConfigError(
            f"hydra.sweeper.heartbeat_interval={conf.heartbeat_interval} must be at least 1 s"
        )
    if conf.grace_period is not None and conf.grace_period <= conf.heartbeat_interval:
        raise SweeperConfigError(
            f"hydra.sweeper.grace_period={conf.grace_period} must exceed heartbeat_interval"
        )
    if conf.mlflow.enabled and not conf.mlflow.parent_run_key:
        raise SweeperConfigError("hydra.sweeper.mlflow.parent_run_key must name a config key")
