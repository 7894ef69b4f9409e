"""Do the study's verdicts survive its nuisance knobs? Each comparison re-judged at every setting a
declaration names (an RMSNorm epsilon, an init scale, a learning rate), one knob at a time.

    python -m analysis robustness --declare sweeps/robustness/norm_eps.yaml --no-train

A setting's runs are the recipe's runs with that one knob changed and every other knob at its
default; the study's own runs (the declared study sweep, from --snapshot or the store) are the
default setting. Each setting is judged with the adaptive stage's rule (`adaptive.Plan`, same-seed
pairs at planned looks); with --train the missing seeds are trained through `adaptive`'s launcher
into the declared experiment, and runs already there at the setting are found, not trained again.
docs/ANALYSIS.md gives the declaration's format and the verdict rule.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from . import adaptive
from .adaptive import Plan
from .runs import AnalysisInputError, _client, latest_per_config, load_runs
from .significance import by_seed, seeds_needed_paired, t_interval

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Knob:
    column: str  # the run column (analysis/runs.py) holding the resolved value
    default: float
    low: float  # allowed values: low < v <= high
    high: float
    follows: tuple[str, ...] = ()  # columns that take this knob's value when they name none


_EPS = dict(low=0.0, high=0.1)
KNOBS = {
    "model.norm_eps": Knob("norm_eps", 1e-6, **_EPS,
                           follows=("prenorm_eps", "residual_norm_eps", "final_norm_eps")),
    "model.prenorm_eps": Knob("prenorm_eps", 1e-6, **_EPS),
    "model.residual_norm_eps": Knob("residual_norm_eps", 1e-6, **_EPS),
    "model.final_norm_eps": Knob("final_norm_eps", 1e-6, **_EPS),
    "model.init_std": Knob("init_std", 0.02, 0.0, 2.0, follows=("embed_std",)),
    "model.embed_std": Knob("embed_std", 0.02, 0.0, 2.0),
    "optim.lr": Knob("lr", 3e-3, 0.0, 1.0),  # conf/optim: every recipe of sweeps/ keeps it
}
KNOB_COLUMNS = tuple(k.column for k in KNOBS.values())


@dataclass(frozen=True)
class Setting:
    knob: str | None = None  # None: every knob at its default
    value: float | None = None

    @property
    def label(self) -> str:
        return "default" if self.knob is None else f"{self.knob}={self.value:.8g}"

    @property
    def overrides(self) -> list[str]:
        return [] if self.knob is None else [f"{self.knob}={self.value!r}"]

    def columns(self) -> dict[str, float]:
        """Each knob column's value in a run at this setting."""
        cols = {k.column: k.default for k in KNOBS.values()}
        if self.knob is not None:
            knob = KNOBS[self.knob]
            for c in (knob.column, *knob.follows):
                cols[c] = self.value
        return cols


@dataclass(frozen=True)
class Declaration:
    recipe: str  # sweeps/<recipe>.yaml
    study_sweep: str  # sweep.name of the study's runs (the default setting)
    experiment: str  # sweep.name and MLflow experiment of the runs this command trains
    comparisons: tuple[tuple[str, str], ...]
    settings: tuple[Setting, ...]  # the default first
    plan: Plan
    overrides: tuple[str, ...] = ()

    def run_overrides(self, setting: Setting) -> list[str]:
        return [f"+sweep={self.recipe}", *self.overrides, *setting.overrides]


# --------------------------------------------------------------------------------------------
# The declaration
# --------------------------------------------------------------------------------------------
def _variants() -> set[str]:
    return {p.stem for p in (ROOT / "conf" / "residual").glob("*.yaml")}


def _comparisons(raw, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise AnalysisInputError(f"{where}: comparisons must be a list of A:B, e.g. [block:baseline]")
    known, out = _variants(), []
    for item in raw:
        a, sep, b = str(item).partition(":")
        if not sep or a == b or a not in known or b not in known:
            raise AnalysisInputError(f"{where}: comparison {item!r} is not VARIANT:VARIANT of two "
                                     f"different variants of conf/residual ({', '.join(sorted(known))})")
        out.append((a, b))
    return tuple(out)


def _settings(raw, where: str) -> tuple[Setting, ...]:
    if not isinstance(raw, dict) or not raw:
        raise AnalysisInputError(f"{where}: knobs must map a knob to a list of values "
                                 f"(knobs: {', '.join(KNOBS)})")
    out = [Setting()]
    for name, values in raw.items():
        knob = KNOBS.get(name)
        if knob is None:
            raise AnalysisInputError(f"{where}: unknown knob {name!r} (allowed: {', '.join(KNOBS)})")
        if not isinstance(values, list) or not values:
            raise AnalysisInputError(f"{where}: knob {name} needs a list of values")
        for v in values:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or not knob.low < v <= knob.high or math.isclose(v, knob.default, rel_tol=1e-9):
                raise AnalysisInputError(f"{where}: {name}={v!r} is out of range (a number in "
                                         f"({knob.low:g}, {knob.high:g}], not the default {knob.default:g})")
            out.append(Setting(name, float(v)))
    return tuple(out)


def _plan(raw: dict, comparisons, where: str) -> Plan:
    seeds = raw.get("seeds") or {}
    try:
        plan = Plan(comparisons, start=int(seeds.get("start", 4)), step=int(seeds.get("step", 2)),
                    max_seeds=int(seeds.get("max", 8)), half_width=float(raw.get("half_width", 0.03)),
                    level=float(raw.get("level", 0.95)), first_seed=int(seeds.get("first", 0)))
    except (TypeError, ValueError, AttributeError):
        plan = None
    if (plan is None or plan.start < 2 or plan.step < 1 or plan.max_seeds < plan.start
            or not plan.half_width > 0 or not 0 < plan.level < 1 or plan.first_seed < 0):
        raise AnalysisInputError(f"{where}: seeds must be {{start: n >= 2, step: >= 1, max: >= start, "
                                 "first: >= 0}, half_width > 0 and 0 < level < 1")
    return plan


def load_declaration(path) -> Declaration:
    """The declaration at ``path``, checked whole; AnalysisInputError names the first problem."""
    path = Path(path)
    where = str(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise AnalysisInputError(f"--declare {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise AnalysisInputError(f"{where}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise AnalysisInputError(f"{where}: expected a mapping with recipe, comparisons and knobs")
    unknown = set(raw) - {"recipe", "study_sweep", "experiment", "comparisons", "knobs", "seeds",
                          "half_width", "level", "overrides"}
    if unknown:
        raise AnalysisInputError(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}")
    recipe = raw.get("recipe")
    if not isinstance(recipe, str) or not (ROOT / "sweeps" / f"{recipe}.yaml").is_file():
        raise AnalysisInputError(f"{where}: recipe {recipe!r} is not a recipe of sweeps/ "
                                 "(recipe: NAME for sweeps/NAME.yaml)")
    comparisons = _comparisons(raw.get("comparisons"), where)
    overrides = raw.get("overrides") or []
    if not isinstance(overrides, list) or any(str(o).split("=")[0].lstrip("+~") in KNOBS
                                               for o in overrides):
        raise AnalysisInputError(f"{where}: overrides must be a list of run.py overrides that set "
                                 "no declared knob")
    return Declaration(recipe, str(raw.get("study_sweep") or recipe),
                       str(raw.get("experiment") or f"robustness_{recipe}"), comparisons,
                       _settings(raw.get("knobs"), where), _plan(raw, comparisons, where),
                       tuple(map(str, overrides)))


# --------------------------------------------------------------------------------------------
# Which runs are at a setting
# --------------------------------------------------------------------------------------------
def setting_of(run) -> Setting | None:
    """The one-knob setting a run was trained at (its knob columns), None when it changed several."""
    for name, knob in KNOBS.items():
        value = float(run.get(knob.column, np.nan))
        for s in (Setting(), Setting(name, value)):
            if all(np.isclose(float(run.get(c, np.nan)), v, rtol=1e-6, atol=0.0)
                   for c, v in s.columns().items()):
                return s
    return None


def _recipe_key(runs: pd.DataFrame) -> pd.Series:
    from .report import CONFIG_COLUMNS, _config_key

    return _config_key(runs, tuple(c for c in CONFIG_COLUMNS if c not in KNOB_COLUMNS))


def _at(runs: pd.DataFrame, setting: Setting) -> pd.Series:
    mask = pd.Series(True, index=runs.index)
    for col, value in setting.columns().items():
        have = runs[col] if col in runs else pd.Series(np.nan, index=runs.index)
        mask &= np.isclose(have.astype(float), value, rtol=1e-6, atol=0.0)
    return mask


def candidates(runs: pd.DataFrame, decl: Declaration | None = None) -> pd.DataFrame:
    """The finished runs of the study sweep and the experiment (all of ``runs`` without a
    declaration), one per config, at the recipe of the study's default runs (all recipe columns
    but the knobs); another model, budget, corpus or variant setting never enters."""
    from .report import _one_setting_per_variant

    if decl is not None:
        runs = runs[runs["sweep"].isin({decl.study_sweep, decl.experiment})]
    runs = runs[runs["status"] == "FINISHED"].dropna(subset=["final_val_loss", "seed"])
    runs = latest_per_config(runs)[0]
    if runs.empty:
        return runs
    key = _recipe_key(runs)
    default = key[_at(runs, Setting())]
    pool = default if len(default) else key
    runs = runs[key == pool.value_counts().sort_index().idxmax()]
    return _one_setting_per_variant(runs)[0]


# --------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------
def _sign(st: adaptive.Status) -> int | None:
    """+1 / −1 where the interval at the stopping look excludes 0, 0 where it resolved by width
    around 0, None where it did not resolve."""
    if not st.resolved:
        return None
    return -1 if st.diff + st.half < 0 else 1 if st.diff - st.half > 0 else 0


def _diffs(runs: pd.DataFrame, a: str, b: str, seeds) -> pd.Series:
    """Same-seed differences a − b over the plan's ``seeds`` that both have."""
    va, vb = (runs[runs["variant"] == v] for v in (a, b))
    d = by_seed(va["final_val_loss"], va["seed"]) - by_seed(vb["final_val_loss"], vb["seed"])
    return d.reindex([float(x) for x in seeds]).dropna()


def _keyed(at: pd.DataFrame, decl: Declaration, keys: dict | None) -> pd.DataFrame:
    """The runs of ``at`` the setting's resolved run keys allow: the experiment's must carry the
    key their (variant, seed) resolves to (adaptive.resolve_keys); None allows every run."""
    if keys is None or at.empty:
        return at
    want = [keys.get((v, int(s))) for v, s in zip(at["variant"], at["seed"])]
    ours = at["run_key"].eq(pd.Series(want, index=at.index, dtype=object))
    return at[(at["sweep"] != decl.experiment) | ours]


def judge(runs: pd.DataFrame, decl: Declaration, sweeps: bool = True,
          keys: dict[str, dict] | None = None) -> pd.DataFrame:
    """One row per comparison × setting: the adaptive rule's state at that setting, the σ of its
    same-seed differences (over the seeds of the plan) and its sign (+1, −1, 0, or NaN: open).
    Before its first look a setting shows the pairs it has, at the look level (not a verdict).
    ``sweeps=False``: every run of ``runs`` is a candidate, whatever its sweep; ``keys``: {setting
    label: resolved run keys} (`resolve`), which the experiment's runs must carry."""
    pool = candidates(runs, decl if sweeps else None)
    plan, rows = decl.plan, []
    for setting in decl.settings:
        at = _keyed(pool[_at(pool, setting)], decl, (keys or {}).get(setting.label))
        for st in adaptive.evaluate(at, plan):
            d = _diffs(at, st.a, st.b, plan.seeds(plan.max_seeds))
            if not st.n and len(d):
                st.diff, st.half, st.n = t_interval(d, plan.look_level)
            rows.append({"comparison": f"{st.a} − {st.b}", "a": st.a, "b": st.b,
                         "setting": setting.label, "knob": setting.knob or "",
                         "seeds": st.n, "diff": st.diff, "half_width": st.half,
                         "level": plan.look_level,
                         "sd_diff": float(d.std(ddof=1)) if len(d) >= 2 else float("nan"),
                         "sign": np.nan if _sign(st) is None else _sign(st),
                         "verdict": st.verdict, "need": st.need})
    return pd.DataFrame(rows)


def _undecided(row, default_sd: float, plan: Plan) -> str:
    sd = row["sd_diff"] if np.isfinite(row["sd_diff"]) else default_sd
    k = seeds_needed_paired(sd, plan.half_width, plan.look_level)
    need = (f"needs about {k:.0f} seeds to detect {plan.half_width:g}" if np.isfinite(k)
            else "seeds needed unknown (no σ of differences yet)")
    half = f"± {row['half_width']:.3g}" if np.isfinite(row["half_width"]) else "± –"
    return f"undecided at {row['setting']}: {row['seeds']} seeds, {half}; {need}"


def survival(table: pd.DataFrame, plan: Plan) -> pd.DataFrame:
    """Per comparison: *survives* (every setting resolves with the default's sign), *reverses*
    (some setting resolves with the opposite sign), else *undecided at* each open setting."""
    rows = []
    for comp, t in table.groupby("comparison", sort=False):
        base = t[t["setting"] == "default"].iloc[0]
        others = t[t["setting"] != "default"]
        d = base["sign"]
        if np.isfinite(d) and d != 0 and (others["sign"] == -d).any():
            flip = others[others["sign"] == -d]["setting"]
            outcome = "reverses at " + ", ".join(flip)
        elif np.isfinite(d) and d != 0 and (others["sign"] == d).all():
            outcome = "survives"
        else:
            open_ = t[t["sign"] != d] if np.isfinite(d) and d != 0 else t[t["sign"].isna() | (t["sign"] == 0)]
            outcome = "; ".join(_undecided(r, base["sd_diff"], plan) for _, r in open_.iterrows())
        default = (f"{comp.split(' − ')[0]} {'<' if d < 0 else '>'} {comp.split(' − ')[1]}"
                   if np.isfinite(d) and d != 0 else base["verdict"])
        rows.append({"comparison": comp, "default": default, "outcome": outcome})
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame, verdicts: pd.DataFrame, plan: Plan) -> str:
    from .ablation import to_markdown

    cells = table.assign(diff=table["diff"].map(lambda x: "–" if not np.isfinite(x) else f"{x:+.4f}"),
                         half_width=table["half_width"].map(lambda x: "–" if not np.isfinite(x) else f"{x:.4f}"))
    return (plan.rule() + "\n\n" + to_markdown(verdicts) + "\n"
            + to_markdown(cells[["comparison", "setting", "seeds", "diff", "half_width", "verdict"]]))


# --------------------------------------------------------------------------------------------
# Training the missing seeds
# --------------------------------------------------------------------------------------------
def _store_runs(uri: str, experiment: str) -> pd.DataFrame:
    try:
        return load_runs(uri, [experiment])
    except AnalysisInputError:  # no store or experiment yet: nothing trained there
        return pd.DataFrame()


def _all_runs(known: pd.DataFrame, uri: str, decl: Declaration) -> pd.DataFrame:
    """The runs of ``known`` (a snapshot) and of the store's experiment and study sweep."""
    parts = [p for p in (known, *(_store_runs(uri, e) for e in {decl.experiment, decl.study_sweep}))
             if len(p)]
    if not parts:
        return pd.DataFrame(columns=["run_id", "sweep", "variant", "seed", "status", "final_val_loss"])
    return pd.concat(parts, ignore_index=True).drop_duplicates("run_id", keep="last")


def resolve(decl: Declaration, uri: str) -> dict[str, dict]:
    """{setting label: {(variant, seed): run key}} that --train would train, resolved by the
    harness in a child process; a declaration whose runs do not compose is AnalysisInputError."""
    out = {}
    for setting in decl.settings:
        try:
            out[setting.label] = adaptive.resolve_keys(decl.plan, [*_base(decl, uri), *decl.run_overrides(setting)])
        except adaptive.AdaptiveInputError as exc:
            raise AnalysisInputError(f"setting {setting.label}: {exc}") from None
    return out


def _base(decl: Declaration, uri: str) -> list[str]:
    return [f"sweep.name={decl.experiment}", f"tracking.uri={uri}"]


def _todo(decl: Declaration, setting: Setting, known: pd.DataFrame, uri: str, keys: dict) -> dict[int, list[str]]:
    """{seed: variants} the setting's next looks still need."""
    pool = candidates(_all_runs(known, uri, decl), decl)
    at = _keyed(pool[_at(pool, setting)], decl, keys[setting.label])
    return adaptive.jobs(adaptive.evaluate(at, decl.plan), at)


def train(decl: Declaration, uri: str, known: pd.DataFrame, keys: dict, lanes: int = 2,
          budget_minutes: float | None = None, log=sys.stdout) -> int:
    """Train each setting's missing seeds, setting by setting, until its comparisons stop (or the
    budget is spent: no new round starts after it); the number of runs launched. A run of the
    experiment counts only with the run key ``keys`` (`resolve`) gives it."""
    start, trained = time.monotonic(), 0
    base = _base(decl, uri)
    for setting in decl.settings:
        todo = _todo(decl, setting, known, uri, keys)
        while todo:
            if budget_minutes is not None and time.monotonic() - start > 60 * budget_minutes:
                print(f"budget: --budget-minutes {budget_minutes:g} spent", file=log)
                return trained
            n = sum(map(len, todo.values()))
            print(f"{setting.label}: training {n} runs", file=log, flush=True)
            failed = adaptive._launch(todo, base + decl.run_overrides(setting), lanes, log)
            trained += n
            before, todo = todo, _todo(decl, setting, known, uri, keys)
            if todo == before:  # nothing new finished: another round would do the same
                raise RuntimeError(f"no run of {setting.label} was found finished after training "
                                   f"({failed} failed); see the messages above")
    return trained


# --------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--declare", required=True, metavar="YAML",
                   help="the declaration: recipe, comparisons, knobs → values, seeds, half-width")
    p.add_argument("--snapshot", default=None, help="run CSV of the study's runs (results/runs.csv)")
    p.add_argument("--tracking-uri", default=None, help="the store of the experiment's runs, where "
                   "--train trains (default: $MLFLOW_TRACKING_URI, else <project root>/mlflow.db)")
    p.add_argument("--train", action=argparse.BooleanOptionalAction, default=False,
                   help="train the missing seeds (default: judge what exists)")
    p.add_argument("--budget-minutes", type=float, default=None,
                   help="start no new round of training after this many minutes")
    p.add_argument("--lanes", type=int, default=2, help="training processes at once (default 2)")
    p.add_argument("--out", default=None, help="folder for robustness.md, .csv and .json")


def main(args, default_uri: str) -> int:
    """The `robustness` command; raises AnalysisInputError on bad input (before any training)."""
    from .runs import import_snapshot

    if args.lanes < 1 or (args.budget_minutes is not None and not args.budget_minutes > 0):
        raise AnalysisInputError("--lanes must be >= 1 and --budget-minutes positive")
    decl = load_declaration(args.declare)
    uri = args.tracking_uri or default_uri
    known = import_snapshot(args.snapshot).runs if args.snapshot else pd.DataFrame()
    if not args.train and args.tracking_uri:
        _client(uri)  # a store named explicitly must exist (a typo would read as "no runs")
    trained, keys = 0, resolve(decl, uri) if args.train else None
    if args.train:
        print(decl.plan.rule(), flush=True)
        try:
            trained = train(decl, uri, known, keys, args.lanes, args.budget_minutes)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    table = judge(_all_runs(known, uri, decl), decl, keys=keys)
    verdicts = survival(table, decl.plan)
    md = markdown(table, verdicts, decl.plan)
    print(md, end="")
    print(f"{trained} runs trained; store {uri}, experiment {decl.experiment}")
    if args.out:
        _write(Path(args.out), decl, table, verdicts, md)
    return 0


def _write(out: Path, decl: Declaration, table: pd.DataFrame, verdicts: pd.DataFrame, md: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "robustness.md").write_text(md)
    table.drop(columns=["need"]).to_csv(out / "robustness.csv", index=False, float_format="%.6g")
    (out / "robustness.json").write_text(json.dumps(
        {"declaration": {**asdict(decl), "settings": [s.label for s in decl.settings],
                         "plan": {**asdict(decl.plan), "looks": decl.plan.looks,
                                  "look_level": decl.plan.look_level}},
         "rule": decl.plan.rule(), "verdicts": verdicts.to_dict("records")},
        indent=2, default=float) + "\n")
