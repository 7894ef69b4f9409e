"""Adaptive seeds: add seeds to the comparisons that are not yet resolved, stop each when it is.

    python -m analysis.adaptive --compare block:baseline --recipe study_cpu --half-width 0.03

Each comparison is judged on same-seed pairs at planned looks, at level 1 − α/K over K looks, so
the interval where it stops stays valid; training goes through ``run.py -m`` and results are read
back from MLflow, so a rerun resumes. The rule is spelled out in docs/STUDY.md.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .significance import by_seed, paired_t

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Plan:
    comparisons: tuple[tuple[str, str], ...]  # (A, B): A − B
    start: int = 3
    step: int = 1
    max_seeds: int = 8
    half_width: float = 0.03
    level: float = 0.95
    stop: str = "either"  # sign | width | either
    first_seed: int = 0

    @property
    def looks(self) -> list[int]:
        looks = list(range(self.start, self.max_seeds + 1, self.step))
        return looks if looks and looks[-1] == self.max_seeds else looks + [self.max_seeds]

    @property
    def look_level(self) -> float:
        """Confidence level of each look's interval: Bonferroni over the planned looks."""
        return 1 - (1 - self.level) / len(self.looks)

    def seeds(self, n: int) -> list[int]:
        return list(range(self.first_seed, self.first_seed + n))

    def rule(self) -> str:
        stop = {"sign": "its interval excludes 0", "width": f"its half-width is ≤ {self.half_width:g}",
                "either": f"its interval excludes 0 or its half-width is ≤ {self.half_width:g}"}
        return (f"Paired t intervals over same-seed differences at planned looks n = "
                f"{', '.join(map(str, self.looks))} seeds, each at level {self.look_level:.4g} "
                f"(Bonferroni over the {len(self.looks)} looks, so every interval reported at the "
                f"look where a comparison stopped has coverage ≥ {self.level:.0%} under this "
                f"stopping rule); a comparison stops at the first look where {stop[self.stop]}.")


@dataclass
class Status:
    a: str
    b: str
    n: int = 0  # pairs at the last look evaluated
    diff: float = float("nan")
    half: float = float("nan")
    resolved: bool = False
    verdict: str = "not started"
    need: list[int] = field(default_factory=list)  # seeds to train for the next look


def evaluate(runs: pd.DataFrame, plan: Plan, metric: str = "final_val_loss") -> list[Status]:
    """Each comparison's state from finished runs: walk the planned looks in order, stop at the
    first that resolves; where a look lacks runs, ``need`` names its seeds."""
    out = []
    for a, b in plan.comparisons:
        st = Status(a, b)
        va, vb = (runs[runs["variant"] == v] for v in (a, b))
        sa, sb = by_seed(va[metric], va["seed"]), by_seed(vb[metric], vb["seed"])
        for n in plan.looks:
            seeds = [float(s) for s in plan.seeds(n)]
            missing = [int(s) for s in seeds if s not in sa.index or s not in sb.index]
            if missing:
                st.need = missing
                st.verdict = "running" if st.n else "not started"
                break
            d, h, _, k = paired_t(sa[seeds], sb[seeds], plan.look_level)
            st.n, st.diff, st.half = k, d, h
            sign = np.isfinite(h) and (d - h > 0 or d + h < 0)
            width = np.isfinite(h) and h <= plan.half_width
            if {"sign": sign, "width": width, "either": sign or width}[plan.stop]:
                st.resolved = True
                st.verdict = (f"{a} < {b}" if d + h < 0 else f"{a} > {b}" if d - h > 0
                              else f"|{a} − {b}| ≤ {abs(d) + h:.3g}")
                break
        else:
            st.verdict = f"not resolved at {plan.max_seeds} seeds"
        out.append(st)
    return out


def jobs(statuses: list[Status], runs: pd.DataFrame) -> dict[int, list[str]]:
    """{seed: variants to train} for the unresolved comparisons' next looks (a baseline shared by
    two comparisons is trained once)."""
    have = set(zip(runs["variant"], runs["seed"].astype(float)))
    need: dict[int, set[str]] = {}
    for st in statuses:
        if st.resolved:
            continue
        for s in st.need:
            for v in (st.a, st.b):
                if (v, float(s)) not in have:
                    need.setdefault(s, set()).add(v)
    return {s: sorted(v) for s, v in sorted(need.items())}


# --------------------------------------------------------------------------------------------
# Run in a child process, as training is: analysis imports no training code. Prints
# [[variant, seed, run key], ...] for `python run.py -m OVERRIDES`, or one line and exit 2.
_KEYS = """
import json, sys
from harness.checkpoint import run_key
from harness.config import ConfigError, to_plain
from harness.estimate import EstimateError, expand
try:
    jobs = expand(sys.argv[1:])
except (ConfigError, EstimateError) as error:
    print((str(error).strip().splitlines() or [type(error).__name__])[0], file=sys.stderr)
    sys.exit(2)
print(json.dumps([[j.spec.cfg.residual.name, j.spec.cfg.train.seed, run_key(to_plain(j.spec.cfg))]
                  for j in jobs]))
"""


class AdaptiveInputError(ValueError):
    """Arguments or a recipe that cannot run: one line, exit 2, before anything trains."""


def resolve_keys(plan: Plan, overrides: list[str]) -> dict[tuple[str, int], str]:
    """{(variant, seed): run key} of every run the plan may train, from the resolved config of
    ``run.py -m overrides`` (harness.checkpoint.run_key): the recipe a run must have to count. A
    variant or override that does not compose is AdaptiveInputError."""
    variants = sorted({v for c in plan.comparisons for v in c})
    seeds = plan.seeds(plan.max_seeds)
    cmd = [sys.executable, "-c", _KEYS, *overrides, f"residual={','.join(variants)}",
           f"train.seed={','.join(map(str, seeds))}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, MPLBACKEND="Agg"))
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        raise AdaptiveInputError(f"the recipe does not resolve: {lines[-1] if done.returncode != 2 else lines[0]}")
    return {(v, int(s)): k for v, s, k in json.loads(done.stdout.strip().splitlines()[-1])}


def _finished(uri: str, experiment: str, keys: dict[tuple[str, int], str] | None = None,
              log=None) -> pd.DataFrame:
    """The finished runs of the experiment that trained the recipe asked for: each run's
    ``attnres.run_key`` must be the key its (variant, seed) resolves to (``keys``); runs of
    another recipe, or without a key, are not this study's runs and are left out (said on
    ``log``)."""
    from .runs import AnalysisInputError, load_runs, latest_per_config

    try:
        runs = load_runs(uri, [experiment])
    except AnalysisInputError:  # no such experiment yet: nothing trained
        return pd.DataFrame(columns=["variant", "seed", "final_val_loss", "status", "run_key"])
    fin, _ = latest_per_config(runs[runs["status"] == "FINISHED"])
    fin = fin.dropna(subset=["final_val_loss", "seed"])
    if keys is None:
        return fin
    want = [keys.get((v, int(s))) for v, s in zip(fin["variant"], fin["seed"])]
    ours = fin["run_key"].eq(pd.Series(want, index=fin.index, dtype=object))
    studied = fin["variant"].isin({v for v, _ in keys})
    other = int((studied & ~ours).sum())
    if other and log is not None:
        print(f"note: {other} finished run(s) of experiment {experiment} were trained with another "
              "recipe (their run keys differ from this one's) and are not used", file=log, flush=True)
    return fin[ours]


def _launch(todo: dict[int, list[str]], overrides: list[str], lanes: int, log) -> int:
    """Train the jobs with `run.py -m`, one multirun per (variant, seed) so that ``lanes`` of them
    keep the cores busy whatever the count; the number of multiruns that failed."""
    queue = [(seed, v) for seed, variants in todo.items() for v in variants]
    running: list[subprocess.Popen] = []
    try:
        return _train(queue, running, overrides, lanes, log)
    except KeyboardInterrupt:  # stop the runs this call started; their checkpoints resume them
        for p in running:
            p.terminate()
        for p in running:
            p.wait()
        raise


def _train(queue, running: list, overrides: list[str], lanes: int, log) -> int:
    failed = 0
    env = dict(os.environ, MPLBACKEND="Agg")
    while queue or running:
        while queue and len(running) < lanes:
            seed, variant = queue.pop(0)
            cmd = [sys.executable, "run.py", "-m", f"residual={variant}", f"train.seed={seed}",
                   *overrides]
            print(f"train {variant} seed {seed}", file=log, flush=True)
            running.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True))
        for p in list(running):
            try:
                _, err = p.communicate(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue  # still training
            running.remove(p)
            if p.returncode:
                failed += 1
                tail = (err or "").strip().splitlines()[-3:]
                print(f"a run failed (exit {p.returncode}): {' | '.join(tail)}", file=log,
                      flush=True)
    return failed


def table(statuses: list[Status], plan: Plan) -> pd.DataFrame:
    return pd.DataFrame([{"comparison": f"{s.a} − {s.b}", "seeds": s.n, "diff": s.diff,
                          "half_width": s.half, "level": plan.look_level, "resolved": s.resolved,
                          "verdict": s.verdict} for s in statuses])


def run(plan: Plan, uri: str, experiment: str, overrides: list[str], lanes: int = 2,
        budget_runs: int | None = None, budget_minutes: float | None = None,
        log=sys.stdout, keys: dict[tuple[str, int], str] | None = None) -> tuple[list[Status], int]:
    """Train until every comparison has stopped; (statuses, runs trained by this call). Only runs
    whose run key is the one ``keys`` gives their (variant, seed) count (`resolve_keys`; None
    resolves them here), so a changed recipe trains its own runs, never reuses the old ones."""
    start, trained = time.monotonic(), 0
    base = [f"sweep.name={experiment}", f"tracking.uri={uri}", *overrides]
    keys = resolve_keys(plan, base) if keys is None else keys
    note = log
    while True:
        runs = _finished(uri, experiment, keys, note)
        note = None  # said once
        statuses = evaluate(runs, plan)
        todo = jobs(statuses, runs)
        if not todo:
            return statuses, trained
        n = sum(map(len, todo.values()))
        if budget_runs is not None and trained + n > budget_runs:
            print(f"budget: {n} more runs would pass --budget-runs {budget_runs}", file=log)
            return _out_of_budget(statuses), trained
        if budget_minutes is not None and time.monotonic() - start > 60 * budget_minutes:
            print(f"budget: --budget-minutes {budget_minutes:g} spent", file=log)
            return _out_of_budget(statuses), trained
        failed = _launch(todo, base, lanes, log)
        trained += n
        after_runs = _finished(uri, experiment, keys)
        if jobs(evaluate(after_runs, plan), after_runs) == todo:  # it would fail again: stop
            raise RuntimeError("no run of the last round finished with this recipe"
                               + ("; see the messages above" if failed else
                                  " (the runs' keys differ from the recipe's)"))


def _out_of_budget(statuses: list[Status]) -> list[Status]:
    for s in statuses:
        if not s.resolved:
            s.verdict = f"not resolvable within the budget (at {s.n} seeds)"
    return statuses


def _log_verdict(uri: str, experiment: str, plan: Plan, statuses: list[Status],
                 overrides: list[str] = ()) -> None:
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name="adaptive-verdict", tags={"attnres.role": "study",
                                                             "attnres.stopping_rule": plan.rule()}):
        mlflow.log_params({"comparisons": ",".join(f"{a}:{b}" for a, b in plan.comparisons),
                           "looks": ",".join(map(str, plan.looks)), "level": plan.level,
                           "look_level": plan.look_level, "half_width": plan.half_width,
                           "stop": plan.stop, "overrides": " ".join(overrides)[:6000]})
        for s in statuses:
            key = f"{s.a}_vs_{s.b}"
            mlflow.set_tag(f"verdict.{key}", s.verdict)
            for name, val in (("diff", s.diff), ("half_width", s.half), ("seeds", s.n),
                              ("resolved", float(s.resolved))):
                if np.isfinite(val):
                    mlflow.log_metric(f"{key}.{name}", float(val))


# --------------------------------------------------------------------------------------------
def _comparison(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(":")
    if not sep or not a or not b or a == b:
        raise argparse.ArgumentTypeError("expected VARIANT:BASELINE, e.g. block:baseline")
    return a, b


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m analysis.adaptive", description=__doc__.split("\n")[0])
    ap.add_argument("--compare", type=_comparison, action="append", required=True,
                    metavar="A:B", help="comparison A − B; repeat for several")
    ap.add_argument("--recipe", default=None, metavar="SWEEP",
                    help="a recipe file of sweeps/ (e.g. study_cpu): +sweep=SWEEP")
    ap.add_argument("--experiment", default=None,
                    help="MLflow experiment (= sweep.name) of the runs (default: the recipe's name, "
                         "else adaptive)")
    ap.add_argument("--tracking-uri", default=None, help="MLflow store (default: "
                    "$MLFLOW_TRACKING_URI, else <project root>/mlflow.db)")
    ap.add_argument("--half-width", type=float, default=0.03, help="target half-width (default 0.03)")
    ap.add_argument("--stop", choices=("sign", "width", "either"), default="either")
    ap.add_argument("--start-seeds", type=int, default=3, help="seeds at the first look (default 3)")
    ap.add_argument("--step", type=int, default=1, help="seeds added per look (default 1)")
    ap.add_argument("--max-seeds", type=int, default=8, help="seeds at the last look (default 8)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--budget-runs", type=int, default=None, help="most runs to train in this call")
    ap.add_argument("--budget-minutes", type=float, default=None,
                    help="start no new round after this many minutes")
    ap.add_argument("--lanes", type=int, default=2, help="training processes at once (default 2)")
    ap.add_argument("--out", default=None, help="folder for adaptive.json and adaptive.md")
    ap.add_argument("overrides", nargs="*", help="run.py overrides for every run, e.g. "
                                                 "train.threads=1 (after --)")
    return ap


# What the study sets itself for every run: an override of these would train another study.
_OWN = {"residual": "--compare", "train.seed": "--first-seed and the looks", "sweep.name": "--experiment",
        "tracking.uri": "--tracking-uri"}


def _check(args) -> None:
    """Every argument, before anything trains or is created (AdaptiveInputError, one line)."""
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in (
        ("start_seeds", args.start_seeds), ("step", args.step), ("lanes", args.lanes)) if v < (2 if k == "start_seeds" else 1)]
    if args.max_seeds < args.start_seeds:
        bad.append(f"--max-seeds {args.max_seeds} (below --start-seeds)")
    if args.first_seed < 0:
        bad.append(f"--first-seed {args.first_seed} (seeds are ≥ 0)")
    if not args.half_width > 0:
        bad.append(f"--half-width {args.half_width}")
    if args.budget_runs is not None and args.budget_runs < 1:
        bad.append(f"--budget-runs {args.budget_runs} (at least 1 run)")
    if args.budget_minutes is not None and not 0 < args.budget_minutes < float("inf"):
        bad.append(f"--budget-minutes {args.budget_minutes:g} (a positive number of minutes)")
    if args.recipe is not None and not (ROOT / "sweeps" / f"{args.recipe}.yaml").is_file():
        bad.append(f"--recipe {args.recipe} (no sweeps/{args.recipe}.yaml)")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        bad.append(f"--out {args.out} (a file, not a folder)")
    for line in args.overrides:
        key = line.lstrip("+~").split("=", 1)[0]
        if key in _OWN:
            bad.append(f"override {line} (the study sets {key}: use {_OWN[key]})")
    if bad:
        raise AdaptiveInputError(f"invalid {', '.join(bad)}: seeds ≥ 2 at the first look, step and "
                                 "lanes ≥ 1, seeds from 0, a positive half-width and budget, a "
                                 "recipe of sweeps/")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from .__main__ import _default_tracking_uri

    uri = args.tracking_uri or _default_tracking_uri()
    experiment = args.experiment or args.recipe or "adaptive"
    overrides = ([f"+sweep={args.recipe}"] if args.recipe else []) + list(args.overrides)
    try:
        _check(args)
        plan = Plan(tuple(args.compare), args.start_seeds, args.step, args.max_seeds,
                    args.half_width, stop=args.stop, first_seed=args.first_seed)
        keys = resolve_keys(plan, [f"sweep.name={experiment}", f"tracking.uri={uri}", *overrides])
        print(plan.rule(), flush=True)
        t0 = time.monotonic()
        statuses, trained = run(plan, uri, experiment, overrides, args.lanes, args.budget_runs,
                                args.budget_minutes, keys=keys)
        _report(args, plan, statuses, trained, time.monotonic() - t0, uri, experiment, overrides,
                used_keys(plan, statuses, keys))
    except AdaptiveInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the runs started were stopped (a rerun resumes them); no verdict logged",
              file=sys.stderr)
        return 130
    return 0


def used_keys(plan: Plan, statuses: list[Status], keys: dict[tuple[str, int], str]) -> list[str]:
    """The run keys of the runs each verdict rests on (its seeds at the look where it stopped):
    a report quoting the verdict beside a snapshot checks that these runs are the snapshot's."""
    return sorted({keys[(v, s)] for st in statuses for v in (st.a, st.b) for s in plan.seeds(st.n)
                   if (v, s) in keys})


def _report(args, plan: Plan, statuses: list[Status], trained: int, seconds: float, uri: str,
            experiment: str, overrides: list[str], run_keys: list[str] = ()) -> None:
    """The verdict: in the terminal, in MLflow and, with --out, in adaptive.md/.json."""
    t = table(statuses, plan)
    from .ablation import to_markdown

    md = to_markdown(t.assign(diff=t["diff"].map(lambda x: f"{x:+.4f}"),
                              half_width=t["half_width"].map(lambda x: f"{x:.4f}"),
                              level=t["level"].map(lambda x: f"{x:.4g}")))
    print(html.unescape(md), end="")  # a terminal shows text, not Markdown's entities
    print(f"{trained} runs trained in {seconds:.0f} s; store {uri}, experiment {experiment}")
    _log_verdict(uri, experiment, plan, statuses, overrides)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "adaptive.md").write_text(plan.rule() + "\n\n" + md)
        (out / "adaptive.json").write_text(json.dumps(
            {"plan": {**asdict(plan), "looks": plan.looks, "look_level": plan.look_level},
             "rule": plan.rule(), "overrides": overrides, "run_keys": list(run_keys),
             "comparisons": [asdict(s) for s in statuses]}, indent=2, default=float) + "\n")


if __name__ == "__main__":
    sys.exit(main())
