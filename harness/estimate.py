"""What a sweep costs, from the model's own FLOPs accounting: `python -m harness.estimate ARGS`.

    python -m harness.estimate +sweep=ablation_gpu data=shards data.path=data/fineweb10B
    python -m harness.estimate +sweep=ablation --probe          # + wall time on this CPU
    python -m harness.estimate +sweep=ablation --recorded RUN_ID  # + wall time at a run's speed

ARGS are those of `python run.py -m ARGS`; the jobs are expanded and validated by the multirun's
own code, so their FLOPs are the ones each job would train (docs/REPRODUCE.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnres.config import reads
from harness.composition_errors import describe
from harness.config import ConfigError, RunSpec, register, validate

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
H100_BF16_DENSE_TFLOPS = 989.0
DEFAULT_MFU = 0.40
SECONDS_PER_DAY = 86_400
PFLOPS_DAY = 1e15 * SECONDS_PER_DAY  # FLOPs of one PFLOP/s sustained for a day


class EstimateError(ValueError):
    """Arguments or a sweep the estimate cannot expand; one line."""


@dataclass
class Job:
    """One run of the sweep (or, for an Optuna study, each of its `trials` runs)."""

    label: str  # the job's sweep overrides (those that differ between jobs)
    variant: str
    model: str
    params: int
    params_non_embedding: int
    steps: int
    tokens_per_step: int
    flops_per_token: int  # training FLOPs per token (forward + backward)
    train_flops: int  # steps × tokens_per_step × flops_per_token: one run
    trials: int = 1
    upper_bound: bool = False  # an Optuna study: pruned trials stop early
    tokens_per_s: float | None = None  # measured on this machine (--probe / --recorded)
    spec: RunSpec | None = field(default=None, repr=False, compare=False)  # what --probe builds

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def total_flops(self) -> int:
        return self.trials * self.train_flops

    @property
    def wall_hours(self) -> float | None:
        """Hours of training steps of all its trials at the measured speed."""
        if self.tokens_per_s is None:
            return None
        return self.trials * self.tokens / self.tokens_per_s / 3600

    def record(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "spec"}


def pflops_days(flops: float) -> float:
    return flops / PFLOPS_DAY


def gpu_hours(flops: float, peak_tflops: float = H100_BF16_DENSE_TFLOPS, mfu: float = DEFAULT_MFU) -> float:
    """Hours of one GPU sustaining `mfu` of its `peak_tflops` to compute `flops`."""
    return flops / (peak_tflops * 1e12 * mfu) / 3600


# --------------------------------------------------------------------------------------------
# Expanding a sweep into its jobs
# --------------------------------------------------------------------------------------------
def _one_line(error: BaseException) -> str:
    """A composition error as run.py words it (harness.composition_errors); any other of Hydra's
    on one line, with its cause (which names the value and the type), without the search path."""
    line = describe(error)
    if line:
        return line
    text = str(error)
    if error.__cause__ is not None and str(error.__cause__) not in text:
        text = f"{text}: {error.__cause__}"
    text = text.split("Config search path:")[0]
    return " ".join(text.split()) or type(error).__name__


def _job(spec: RunSpec, label: str, trials: int = 1, upper_bound: bool = False) -> Job:
    c = spec.counts
    return Job(
        label=label, variant=spec.cfg.residual.name, model=spec.cfg.model.name,
        params=int(c["count.params_total"]), params_non_embedding=int(c["count.params_non_embedding"]),
        steps=int(c["count.train_steps"]), tokens_per_step=spec.tokens_per_step,
        flops_per_token=int(c["count.flops_per_token"]), train_flops=int(c["count.train_flops"]),
        trials=trials, upper_bound=upper_bound, spec=spec,
    )


def _validate(job_cfg: DictConfig, where: str) -> RunSpec:
    from harness.callbacks import _without_hydra

    try:
        return validate(_without_hydra(job_cfg))
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def _varying(overrides: list[list[str]]) -> list[str]:
    """Keys whose value differs between jobs: what names a job in the table."""
    values: dict[str, set[str]] = {}
    for job in overrides:
        for line in job:
            key, _, value = line.partition("=")
            values.setdefault(key, set()).add(value)
    return [k for k, v in values.items() if len(v) > 1]


def _label(overrides: Sequence[str], keys: list[str], variant: str) -> str:
    """The job's varying overrides, less the residual knobs `variant` does not read."""
    def shown(key: str) -> bool:
        group, _, knob = key.partition(".")
        return key in keys and not (group == "residual" and knob and not reads(variant, knob))

    return " ".join(o for o in overrides if shown(o.partition("=")[0]))


def _basic_jobs(master: DictConfig) -> list[Job]:
    """The grid's jobs; one that is an earlier job's run again (it sets a residual knob its variant
    does not read, which validate drops) trains nothing: it returns that run's result."""
    from harness.callbacks import job_configs
    from harness.checkpoint import run_key
    from harness.config import to_plain

    jobs = job_configs(master)
    keys = _varying([o for o, _ in jobs])
    out, first = [], {}
    for i, (o, cfg) in enumerate(jobs):
        spec = _validate(cfg, f"job {i} ({' '.join(o) or 'no overrides'})")
        key = run_key(to_plain(spec.cfg))
        if key in first:  # an earlier job's run again (a knob its variant does not read): run.py reuses it
            out.append(_job(spec, f"{_label(o, keys, spec.cfg.residual.name)} (= job {first[key]})", trials=0))
        else:
            first[key] = i
            out.append(_job(spec, _label(o, keys, spec.cfg.residual.name)))
    return out


def _corners(dimension: Any) -> list[str]:
    """The overrides at the ends of one searched key (every choice of a categorical)."""
    from optuna.distributions import CategoricalDistribution

    d = dimension.distribution
    values = list(d.choices) if isinstance(d, CategoricalDistribution) else [d.low, d.high]
    return [dimension.override(v) for v in values]


def _optuna_jobs(master: DictConfig) -> list[Job]:
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.attnres_optuna_sweeper._space import build_plan
    from hydra_plugins.attnres_optuna_sweeper._strategy import grid_size

    loader = GlobalHydra.instance().config_loader()
    settings = master.hydra.sweeper
    plan = build_plan(list(master.hydra.overrides.task),
                      OmegaConf.to_container(settings.params, resolve=False) or {},
                      OverridesParser.create(config_loader=loader))
    n_trials = int(settings.n_trials)
    if settings.sampler.name == "grid":
        n_trials = min(n_trials, grid_size(plan.dimensions))
    corners = list(itertools.product(*(_corners(d) for d in plan.dimensions)))
    jobs = []
    for cell in plan.cells:
        where = f"study {' '.join(cell.labels) or '(one cell)'}"
        specs = [_validate(loader.load_sweep_config(master, [*plan.fixed, *cell.overrides, *corner]), where)
                 for corner in corners]
        largest = max(specs, key=lambda s: s.counts["count.train_flops"])
        jobs.append(_job(largest, " ".join(cell.labels), trials=n_trials, upper_bound=True))
    return jobs


def expand(overrides: Sequence[str]) -> list[Job]:
    """Every job `python run.py -m OVERRIDES` would launch, validated, with its FLOPs."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="run"):
        try:
            master = GlobalHydra.instance().hydra.compose_config(
                "config", overrides=list(overrides), run_mode=RunMode.MULTIRUN)
        except Exception as error:  # Hydra's composition errors: a bad key, group option or syntax
            raise EstimateError(_one_line(error)) from None
        target = str(OmegaConf.select(master, "hydra.sweeper._target_") or "")
        try:
            if target.endswith("BasicSweeper"):
                return _basic_jobs(master)
            if target.endswith("AttnresOptunaSweeper"):
                return _optuna_jobs(master)
        except ConfigError:
            raise
        except Exception as error:  # composing one job's overrides (a bad comma-list value)
            raise EstimateError(_one_line(error)) from None
    raise EstimateError(f"hydra.sweeper._target_={target!r}: the estimate knows Hydra's basic sweeper "
                        "and attnres_optuna; allowed: hydra/sweeper=basic, hydra/sweeper=attnres_optuna")


# --------------------------------------------------------------------------------------------
# Measured speed
# --------------------------------------------------------------------------------------------
def _probe_key(spec: RunSpec) -> str:
    c, t = spec.cfg, spec.cfg.train
    return repr((c.model, c.residual, c.optim.name, spec.micro_batch_size, spec.accum_steps, t.seq_len, t.threads))


def probe_tokens_per_s(spec: RunSpec, steps: int) -> float:
    """Training tokens per second of the job's model on this CPU: `steps` timed optimizer steps
    after one untimed one."""
    import torch

    from attnres import DecoderLM
    from harness.optim import build_optimizer

    cfg, t = spec.cfg, spec.cfg.train
    threads = torch.get_num_threads()
    if t.threads:
        torch.set_num_threads(t.threads)
    try:
        torch.manual_seed(0)
        model = DecoderLM(cfg.model, cfg.residual).train()
        optimizer = build_optimizer(model, cfg.optim)
        x = torch.randint(0, cfg.model.vocab_size, (spec.micro_batch_size, t.seq_len + 1))

        def step() -> None:
            for _ in range(spec.accum_steps):
                _, loss = model(x[:, :-1], x[:, 1:])
                (loss / spec.accum_steps).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # first-use costs (the C kernels' build, allocator warm-up) are not the run's pace
        tic = time.perf_counter()
        for _ in range(steps):
            step()
        return steps * spec.tokens_per_step / (time.perf_counter() - tic)
    finally:
        torch.set_num_threads(threads)


def probe(jobs: list[Job], steps: int, log=print) -> None:
    """Set every job's tokens_per_s from a probe of its model (each distinct model once)."""
    speeds: dict[str, float] = {}
    for job in jobs:
        if job.spec is None:
            continue
        key = _probe_key(job.spec)
        if key not in speeds:
            speeds[key] = probe_tokens_per_s(job.spec, steps)
            log(f"probe: {job.variant} ({job.model}): {speeds[key]:,.0f} tokens/s over {steps} steps")
        job.tokens_per_s = speeds[key]


def recorded_flops_per_s(run_id: str, tracking_uri: str | None) -> float:
    """Training FLOP/s of a finished run: the median of its logged train/tokens_per_s times its
    count.flops_per_token."""
    import statistics

    from harness.config import absolute_sqlite, default_tracking_uri

    uri = absolute_sqlite(tracking_uri) if tracking_uri else default_tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        raise EstimateError(f"--recorded {run_id}: no MLflow store at {uri} (no such file); "
                            "allowed: --tracking-uri or $MLFLOW_TRACKING_URI naming the run's store")
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=uri)
    try:
        run = client.get_run(run_id)
        history = client.get_metric_history(run_id, "train/tokens_per_s")
    except MlflowException:
        raise EstimateError(f"--recorded {run_id}: no such run in {uri}; allowed: the id of a run.py run") from None
    flops_per_token = run.data.params.get("count.flops_per_token")
    speeds = [m.value for m in history if math.isfinite(m.value) and m.value > 0]
    if not speeds or flops_per_token is None:
        raise EstimateError(f"--recorded {run_id}: the run logged no train/tokens_per_s or count.flops_per_token; "
                            "allowed: a run.py training run that logged at least one step")
    return statistics.median(speeds) * float(flops_per_token)


def at_flops_per_s(jobs: list[Job], flops_per_s: float) -> None:
    for job in jobs:
        job.tokens_per_s = flops_per_s / job.flops_per_token


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def summary(jobs: list[Job], peak_tflops: float, mfu: float) -> dict[str, Any]:
    flops = sum(j.total_flops for j in jobs)
    return {
        "jobs": sum(j.trials for j in jobs),
        "upper_bound": any(j.upper_bound for j in jobs),
        "train_flops": flops,
        "pflops_days": pflops_days(flops),
        "gpu_hours": gpu_hours(flops, peak_tflops, mfu),
        "peak_tflops": peak_tflops,
        "mfu": mfu,
        "wall_hours": (sum(j.wall_hours for j in jobs if j.wall_hours is not None)
                       if any(j.tokens_per_s is not None for j in jobs) else None),
    }


def _si(value: float, unit: str = "") -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "B" if unit == "tok" else "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g}{prefix}"
    return f"{value:.3g}"


def _amount(value: float) -> str:
    """Hours and days: whole numbers once large, three significant digits below (a CPU sweep)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def table(jobs: list[Job], peak_tflops: float, mfu: float) -> str:
    head = ["job", "variant", "model", "params", "non-emb", "steps", "tokens", "FLOPs/token",
            "train FLOPs", "trials", "GPU-h"]
    rows = [[j.label or "-", j.variant, j.model, _si(j.params), _si(j.params_non_embedding), str(j.steps),
             _si(j.tokens, "tok"), f"{j.flops_per_token:.3e}",
             f"{'≤' if j.upper_bound else ''}{j.total_flops:.3e}", str(j.trials),
             _amount(gpu_hours(j.total_flops, peak_tflops, mfu))] for j in jobs]
    if any(j.tokens_per_s is not None for j in jobs):
        head += ["tokens/s", "wall-h"]
        for row, j in zip(rows, jobs):
            row += ["-", "-"] if j.wall_hours is None else [f"{j.tokens_per_s:,.0f}", _amount(j.wall_hours)]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


def totals_text(s: dict[str, Any]) -> str:
    at_most = "at most " if s["upper_bound"] else ""
    return (f"{s['jobs']} job{'' if s['jobs'] == 1 else 's'}, {at_most}{s['train_flops']:.4e} training FLOPs = "
            f"{_amount(s['pflops_days'])} PFLOP/s-days = {_amount(s['gpu_hours'])} GPU-hours "
            f"({_amount(s['gpu_hours'] / 24)} GPU-days) at MFU {s['mfu']:g} of {s['peak_tflops']:g} TFLOP/s"
            + ("" if s["wall_hours"] is None else
               f"; {at_most}{_amount(s['wall_hours'])} hours of training steps on this machine, one job at a time"))


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, not usage + message
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m harness.estimate",
                description="Jobs, training FLOPs, GPU-hours (and wall time here) of `python run.py -m ARGS`.")
    p.add_argument("overrides", nargs="*", help="run.py's Hydra overrides, e.g. +sweep=ablation_gpu")
    p.add_argument("-m", "--multirun", action="store_true", help="ignored (run.py's flag)")
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                   help="dense bf16 peak of one GPU in TFLOP/s (default: H100/H200 SXM, 989)")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="model FLOPs utilisation (default 0.40)")
    p.add_argument("--json", metavar="PATH", help="also write the jobs and totals as JSON")
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--probe", type=int, nargs="?", const=3, metavar="STEPS",
                       help="time STEPS (default 3) training steps of each distinct model on this CPU: wall time")
    speed.add_argument("--recorded", metavar="RUN_ID",
                       help="wall time at the training FLOP/s a finished run logged")
    p.add_argument("--tracking-uri", help="the store of --recorded's run (default: $MLFLOW_TRACKING_URI, else run.py's)")
    args = p.parse_intermixed_args(argv)
    if args.probe is not None and not 1 <= args.probe <= 1000:
        p.error(f"--probe={args.probe} must be a number of steps in 1..1000")
    if not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        p.error(f"--peak-tflops={args.peak_tflops} must be a positive number of TFLOP/s")
    if not (math.isfinite(args.mfu) and 0 < args.mfu <= 1):
        p.error(f"--mfu={args.mfu} must lie in (0, 1]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        jobs = expand(args.overrides)
        if args.recorded:
            at_flops_per_s(jobs, recorded_flops_per_s(args.recorded, args.tracking_uri))
    except (ConfigError, EstimateError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    if args.probe:
        probe(jobs, args.probe, log=lambda line: print(line, file=sys.stderr, flush=True))
    totals = summary(jobs, args.peak_tflops, args.mfu)
    print(table(jobs, args.peak_tflops, args.mfu))
    print(totals_text(totals))
    if args.json:
        document = {
            "arguments": list(args.overrides),
            "flops": "DecoderLM.flops_per_token: training (3 × forward) matmul + full-square attention "
                     "+ residual mixing; no eval, norms, elementwise or optimizer FLOPs",
            "jobs": [{**j.record(), "tokens": j.tokens, "total_flops": j.total_flops, "wall_hours": j.wall_hours,
                      "gpu_hours": gpu_hours(j.total_flops, args.peak_tflops, args.mfu)} for j in jobs],
            "totals": totals,
        }
        try:
            Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
        except OSError as error:
            print(f"error: --json={args.json}: cannot write ({error.strerror}); allowed: a writable file path",
                  file=sys.stderr, flush=True)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
