"""The Hydra callback of a multirun: check every job, create the MLflow store once, open the parent.

Before any job, every job's config is composed and validated (a bad one stops the multirun with
one line and exit 2, nothing written), the tracking store is created once under the inter-process
lock, and the parent run is created or reopened on resume; jobs find it through
ATTNRES_PARENT_RUN_ID. At the end the parent ends FINISHED, FAILED or KILLED from its children.
"""
from __future__ import annotations

import atexit
import copy
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from harness.checkpoint import creatable
from harness.config import ConfigError, check_folder_name, rank, validate
from harness.job import PARENT_ENV
from harness.config import PROJECT_ROOT

log = logging.getLogger(__name__)


def _without_hydra(cfg: DictConfig) -> DictConfig:
    """The task's view of a composed config (as Hydra's run_job makes it: a deep copy, no `hydra`)."""
    cfg = copy.deepcopy(cfg)
    with read_write(cfg), open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


def _sweep_arguments(config: DictConfig) -> list[str]:
    # As written, not resolved: an override holding ${...} is the job's to resolve (or refuse with one line).
    params = OmegaConf.to_container(OmegaConf.select(config, "hydra.sweeper.params") or OmegaConf.create({}))
    return [f"{k}={v}" for k, v in params.items()] + OmegaConf.to_container(config.hydra.overrides.task)


# Keys that say how to rerun a sweep, not what it is: `train.retry_failed=true` added to a
# multirun's command retrains its failed jobs under the same parent run, which then ends FINISHED
# once they all have.
RERUN_KEYS = ("train.retry_failed",)


def _sweep_key(arguments: list[str], base: DictConfig) -> str:
    """The parent run's identity: the sweep arguments and the base config, minus RERUN_KEYS."""
    kept = [a for a in arguments if a.lstrip("+~").split("=", 1)[0] not in RERUN_KEYS]
    tree = OmegaConf.to_container(base, resolve=False)
    for key in RERUN_KEYS:
        section, name = key.split(".", 1)
        tree.get(section, {}).pop(name, None)
    return hashlib.sha256(json.dumps([sorted(kept), tree], sort_keys=True, default=str).encode()).hexdigest()[:16]


def _is_basic_sweeper(config: DictConfig) -> bool:
    return str(OmegaConf.select(config, "hydra.sweeper._target_") or "").endswith("BasicSweeper")


def _sweeper_class(config: DictConfig) -> type | None:
    """The class of a sweeper other than Hydra's basic one, if it imports."""
    target = str(OmegaConf.select(config, "hydra.sweeper._target_") or "")
    if not target or _is_basic_sweeper(config):
        return None
    from hydra.utils import get_class

    try:
        return get_class(target)
    except Exception:  # an unimportable sweeper fails on its own, with its own message
        return None


def _sweeper_manages_runs(config: DictConfig) -> bool:
    return bool(getattr(_sweeper_class(config), "manages_mlflow_runs", False))


def check_sweeper_jobs(config: DictConfig) -> None:
    """A sweeper that composes its own jobs (Optuna: a study per grid cell) checks them here, before
    the MLflow store exists (Hydra sets a sweeper up only after this callback): a bad option or a
    job that does not compose is one line and exit 2, nothing left behind. Its own one-line
    errors (Hydra's CompactHydraException) count as bad input; anything else is left to the sweep."""
    from hydra.errors import CompactHydraException

    from harness.composition_errors import exit_if_composition_error

    check = getattr(_sweeper_class(config), "check_jobs", None)
    if check is None:
        return
    try:
        # each cell's job config is also validated as run.py would (a value no trial could run:
        # residual.num_blocks not dividing L), not only composed
        check(config, check=lambda job_cfg: validate(_without_hydra(job_cfg)))
    except CompactHydraException as error:
        exit_if_composition_error(error)
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def job_configs(config: DictConfig) -> list[tuple[list[str], DictConfig]]:
    """(overrides, composed config) of every job of a basic-sweeper multirun."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader()
    parser = OverridesParser.create(config_loader=loader)
    batches = BasicSweeper.split_arguments(parser.parse_overrides(_sweep_arguments(config)), None)
    return [(list(o), loader.load_sweep_config(config, list(o))) for o in batches[0]]


def _search_range(config: DictConfig) -> str | None:
    """The line for a search range (`interval(...)`, `tag(log, interval(...))`) under Hydra's basic
    sweeper, which only runs grids: the README's sweeper example without its
    `hydra/sweeper=attnres_optuna` is a likely slip, and Hydra's own words ("BasicSweeper does not
    support sweep type : INTERVAL_SWEEP", exit 1) name neither the override nor the fix."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    try:
        overrides = OverridesParser.create().parse_overrides(_sweep_arguments(config))
    except Exception:  # not ours to report: Hydra's error stands
        return None
    for override in overrides:
        if override.value_type == ValueType.INTERVAL_SWEEP:
            return (f"{override.input_line}: a search range needs the Optuna sweeper; allowed: add "
                    "hydra/sweeper=attnres_optuna (docs/SWEEPER.md), or a comma list for a grid")
    return None


def validate_jobs(config: DictConfig) -> int:
    """Validate every job (config and data); on the first bad one print one line and exit 2."""
    from harness.composition_errors import exit_if_composition_error
    from harness.data import DataError, load_data

    try:
        jobs = job_configs(config)
    except Exception as error:  # a sweep value Hydra cannot compose (residual=blok,block)
        exit_if_composition_error(error)
        line = _search_range(config)
        if line is not None:
            print(f"error: {line}", file=sys.stderr, flush=True)
            sys.exit(2)
        raise
    seen_data, seen_roots = set(), set()
    for i, (overrides, job_cfg) in enumerate(jobs):
        where = f"job {i} ({' '.join(overrides) or 'no overrides'})"
        try:
            spec = validate(_without_hydra(job_cfg))
            root = spec.cfg.train.checkpoint_dir
            if root not in seen_roots:  # as a single run refuses it, before any job starts
                seen_roots.add(root)
                folder = Path(root or PROJECT_ROOT / "checkpoints").expanduser()
                error = creatable(folder)
                if error is not None:
                    raise ConfigError(f"train.checkpoint_dir={root}: cannot create {folder} ({error.strerror}); "
                                      "allowed: a writable folder (null = <project root>/checkpoints)")
            data_key = json.dumps([OmegaConf.to_container(OmegaConf.structured(spec.cfg.data)),
                                   spec.cfg.train.seq_len], default=str)
            if data_key not in seen_data:
                seen_data.add(data_key)
                load_data(spec.cfg.data, spec.cfg.train.seq_len)
        except (ConfigError, DataError) as error:
            print(f"error: {where}: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
    return len(jobs)


class MLflowMultirunCallback(Callback):
    def __init__(self) -> None:
        self.client = None
        self.parent_id: str | None = None
        self._atexit = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # before Hydra makes hydra.run.dir (outputs/<sweep.name>/...): a name that leaves it is refused there
        try:
            check_folder_name("sweep.name", OmegaConf.select(config, "sweep.name", default="default",
                                                             throw_on_resolution_failure=False))
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra turns an exception raised here into a UserWarning and launches every job anyway,
        # unchecked and without the parent run (hydra/_internal/callbacks.py): stop the multirun.
        try:
            self._start(config)
        except Exception as error:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                import traceback

                traceback.print_exc()
            reason = " ".join(str(error).split())
            print(f"error: the multirun could not start ({type(error).__name__}: {reason})", file=sys.stderr, flush=True)
            sys.exit(1)

    def _start(self, config: DictConfig) -> None:
        n_jobs = None
        if _is_basic_sweeper(config):
            n_jobs = validate_jobs(config)
        else:
            check_sweeper_jobs(config)
        base = _without_hydra(config)
        if not base.tracking.enabled or rank() != 0:
            return
        from harness.tracking import TrackingUnreachable, check_tracking_uri, client_for, experiment_id

        uri = base.tracking.uri
        try:
            check_tracking_uri(uri)  # a dead server or a bad URI: one line, exit 2, no job started
        except TrackingUnreachable as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
        self.client = client_for(uri)
        exp_id = experiment_id(self.client, base.tracking.experiment or base.sweep.name, uri)
        if base.tracking.parent_run_id or _sweeper_manages_runs(config):  # a parent exists or comes per study
            return
        arguments = _sweep_arguments(config)
        key = _sweep_key(arguments, base)
        self.parent_id = self._reuse(exp_id, key) if base.train.resume else None
        if self.parent_id is None:
            self.parent_id = self._create(exp_id, key, base, arguments, n_jobs)
        os.environ[PARENT_ENV] = self.parent_id
        self._atexit = atexit.register(self._finish)
        print(f"MLflow parent run {self.parent_id} ({uri})", file=sys.stderr)

    def _reuse(self, exp_id: str, key: str) -> str | None:
        found = self.client.search_runs(
            [exp_id], filter_string=f"tags.`attnres.sweep_key` = '{key}' and tags.`attnres.role` = 'parent'",
            order_by=["attributes.start_time DESC"], max_results=1,
        )
        if not found:
            return None
        run_id = found[0].info.run_id
        self.client.update_run(run_id, status="RUNNING")
        self.client.set_tag(run_id, "attnres.status", "RUNNING")
        return run_id

    def _create(self, exp_id: str, key: str, base: DictConfig, arguments: list[str], n_jobs) -> str:
        from mlflow.entities import Param

        name = f"{base.sweep.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        run = self.client.create_run(exp_id, run_name=name, tags={
            "attnres.role": "parent", "attnres.sweep": base.sweep.name, "attnres.sweep_key": key,
            "attnres.status": "RUNNING",
        })
        run_id = run.info.run_id
        params = [Param("sweep.arguments", " ".join(arguments)[:6000])]
        if n_jobs is not None:
            params.append(Param("sweep.jobs", str(n_jobs)))
        self.client.log_batch(run_id, params=params)
        self.client.log_text(run_id, OmegaConf.to_yaml(base), "config/multirun.yaml")
        return run_id

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish()

    def _finish(self) -> None:
        if self.parent_id is None:
            return
        run_id, self.parent_id = self.parent_id, None
        if self._atexit is not None:
            atexit.unregister(self._finish)
            self._atexit = None
        os.environ.pop(PARENT_ENV, None)
        children = self.client.search_runs(
            [self.client.get_run(run_id).info.experiment_id],
            filter_string=f"tags.`mlflow.parentRunId` = '{run_id}'", max_results=10000,
        )
        if not children:
            self.client.delete_run(run_id)  # nothing ran under it (e.g. the sweeper parents its own)
            return
        statuses = [c.info.status for c in children]
        done = statuses.count("FINISHED")
        # Interrupted (a child KILLED: Ctrl-C, SIGTERM) without a failure is KILLED, as the child:
        # rerunning the command resumes it. Any failed child makes the multirun FAILED.
        status = ("FINISHED" if done == len(statuses) else "FAILED" if "FAILED" in statuses else "KILLED")
        self.client.set_tag(run_id, "attnres.status", status)
        self.client.set_tag(run_id, "attnres.jobs_finished", str(done))
        self.client.set_tag(run_id, "attnres.jobs_total", str(len(statuses)))
        self.client.set_terminated(run_id, status=status)
