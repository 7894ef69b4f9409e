"""Adaptive seeds: add seeds to the comparisons that are not yet resolved, stop each when it is.

    python -m analysis.adaptive --compare block:baseline --recipe study_cpu --half-width 0.03

Each comparison is judged on same-seed pairs at planned looks, at level 1 − α/K over K looks, so
the interval where it stops stays valid; training goes through ``run.py -m`` and results are read
back from MLflow, so a rerun resumes. The rule is spelled out in docs/STUDY.md.
"""
from __future__ import annotations

import argparse
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
def _finished(uri: str, experiment: str) -> pd.DataFrame:
    from .runs import AnalysisInputError, load_runs, latest_per_config

    try:
        runs = load_runs(uri, [experiment])
    except AnalysisInputError:  # no such experiment yet: nothing trained
        return pd.DataFrame(columns=["variant", "seed", "final_val_loss", "status"])
    fin, _ = latest_per_config(runs[runs["status"] == "FINISHED"])
    return fin.dropna(subset=["final_val_loss", "seed"])


def _launch(todo: dict[int, list[str]], overrides: list[str], lanes: int, log) -> int:
    """Train the jobs with `run.py -m`, one multirun per (variant, seed) so that ``lanes`` of them
    keep the cores busy whatever the count; the number of multiruns that failed."""
    queue = [(seed, v) for seed, variants in todo.items() for v in variants]
    running: list[subprocess.Popen] = []
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
        log=sys.stdout) -> tuple[list[Status], int]:
    """Train until every comparison has stopped; (statuses, runs trained by this call)."""
    start, trained = time.monotonic(), 0
    base = [f"sweep.name={experiment}", f"tracking.uri={uri}", *overrides]
    while True:
        runs = _finished(uri, experiment)
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
        if failed:  # a failing recipe would fail again: stop, and say so
            after = jobs(evaluate(_finished(uri, experiment), plan), _finished(uri, experiment))
            if after == todo:
                raise RuntimeError("no run of the last round finished; see the messages above")


def _out_of_budget(statuses: list[Status]) -> list[Status]:
    for s in statuses:
        if not s.resolved:
            s.verdict = f"not resolvable within the budget (at {s.n} seeds)"
    return statuses


def _log_verdict(uri: str, experiment: str, plan: Plan, statuses: list[Status]) -> None:
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name="adaptive-verdict", tags={"attnres.role": "study",
                                                             "attnres.stopping_rule": plan.rule()}):
        mlflow.log_params({"comparisons": ",".join(f"{a}:{b}" for a, b in plan.comparisons),
                           "looks": ",".join(map(str, plan.looks)), "level": plan.level,
                           "look_level": plan.look_level, "half_width": plan.half_width,
                           "stop": plan.stop})
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


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in (
        ("start_seeds", args.start_seeds), ("step", args.step), ("lanes", args.lanes)) if v < (2 if k == "start_seeds" else 1)]
    if args.max_seeds < args.start_seeds:
        bad.append(f"--max-seeds {args.max_seeds} (below --start-seeds)")
    if not args.half_width > 0:
        bad.append(f"--half-width {args.half_width}")
    if args.recipe is not None and not (ROOT / "sweeps" / f"{args.recipe}.yaml").is_file():
        bad.append(f"--recipe {args.recipe} (no sweeps/{args.recipe}.yaml)")
    if bad:
        print(f"error: invalid {', '.join(bad)}: seeds ≥ 2 at the first look, step and lanes ≥ 1, "
              "a positive half-width, a recipe of sweeps/", file=sys.stderr)
        return 2
    from .__main__ import _default_tracking_uri

    uri = args.tracking_uri or _default_tracking_uri()
    experiment = args.experiment or args.recipe or "adaptive"
    plan = Plan(tuple(args.compare), args.start_seeds, args.step, args.max_seeds, args.half_width,
                stop=args.stop, first_seed=args.first_seed)
    overrides = ([f"+sweep={args.recipe}"] if args.recipe else []) + list(args.overrides)
    print(plan.rule(), flush=True)
    t0 = time.monotonic()
    try:
        statuses, trained = run(plan, uri, experiment, overrides, args.lanes, args.budget_runs,
                                args.budget_minutes)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    t = table(statuses, plan)
    from .ablation import to_markdown

    md = to_markdown(t.assign(diff=t["diff"].map(lambda x: f"{x:+.4f}"),
                              half_width=t["half_width"].map(lambda x: f"{x:.4f}"),
                              level=t["level"].map(lambda x: f"{x:.4g}")))
    print(md, end="")
    print(f"{trained} runs trained in {time.monotonic() - t0:.0f} s; store {uri}, experiment "
          f"{experiment}")
    _log_verdict(uri, experiment, plan, statuses)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "adaptive.md").write_text(plan.rule() + "\n\n" + md)
        (out / "adaptive.json").write_text(json.dumps(
            {"plan": {**asdict(plan), "looks": plan.looks, "look_level": plan.look_level},
             "rule": plan.rule(), "comparisons": [asdict(s) for s in statuses]},
            indent=2, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
