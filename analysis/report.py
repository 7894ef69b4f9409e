"""The ``report`` command: runs → every table, figure and ``REPORT.md`` in one folder.

Runs reach sections by sweep name (``ablation``, ``block_size``, ``scaling``, ``arch``,
``multihop``, ``tuned_lr``, or ``--role SWEEP=SECTION``); only FINISHED runs of one configuration
enter the statistics, the rest are listed. A failing section is reported and the command exits
non-zero after writing everything else. Output is deterministic for a given input and seed.
"""
from __future__ import annotations


import json
import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from . import ablation as abl
from . import markup
from .significance import holm
from . import sections as sec
from .paper import load_paper
from .runs import RunSet, latest_per_config

ROLES = ("ablation", "block_size", "scaling", "arch", "multihop", "tuned_lr", "robustness")


@dataclass
class Options:
    n_boot: int = 1000
    seed: int = 0
    level: float = 0.95
    multiplier_at: float | None = None  # PFLOP/s-days; None: our largest scaling run
    roles: dict[str, str] = field(default_factory=dict)  # sweep name -> section
    paper_dir: Path | None = None
    target_delta: float = 0.03  # nats: the effect the noise study sizes seeds for


# Sweep-name prefixes that feed a section under another name: the Optuna learning-rate studies
# (`+sweep=lr`) are each variant's search over its learning rate, as the `tuned_lr` grid is.
# `study_cpu` is the ablation at the CPU study's recipe (sweeps/study_cpu.yaml, docs/STUDY.md).
PREFIXES = {**{r: r for r in ROLES}, "lr": "tuned_lr", "study_cpu": "ablation"}


def assign_roles(runs: pd.DataFrame, overrides: dict[str, str] | None = None) -> pd.Series:
    """Section of each run: an explicit override for its sweep, else the section of the known
    sweep name its sweep starts with (PREFIXES), else ``other``."""
    overrides = overrides or {}

    def role(sweep):
        if sweep in overrides:
            return overrides[sweep]
        s = str(sweep or "")
        return next((PREFIXES[p] for p in sorted(PREFIXES, key=len, reverse=True) if s.startswith(p)), "other")

    return runs["sweep"].map(role)


# What runs compared as seeds of one table must share: the model and the training recipe. Only
# the residual (what the comparison varies) and the seed may differ; runs at another learning
# rate, budget, batch, context or corpus are a different experiment, not more seeds. Columns a
# run set lacks (an older snapshot) are left out.
CONFIG_COLUMNS = ("model", "d_model", "layers", "n_heads", "d_ff", "tokens", "lr", "batch_size",
                  "seq_len", "data", "data_fingerprint", "norm_eps", "prenorm_eps",
                  "residual_norm_eps", "final_norm_eps", "init_std", "embed_std")


def _text(x) -> str:
    return "?" if pd.isna(x) else f"{x:g}" if isinstance(x, float) else str(x)


def _config_key(runs, columns=CONFIG_COLUMNS) -> pd.Series:
    """The `columns` of each run as one string ("?" where not logged)."""
    cols = [c for c in columns if c in runs]
    return runs[cols].apply(lambda c: c.map(_text)).agg("/".join, axis=1)


def _one_configuration(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs of the configuration (CONFIG_COLUMNS) with the most runs."""
    if runs.empty:
        return runs
    key = _config_key(runs)
    return runs[key == key.value_counts().sort_index().idxmax()]


def _restricted(runs: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """(the runs of the configuration with the most runs, a note naming it by the columns that
    differ between configurations; "" when there is one configuration)."""
    key = _config_key(runs)
    if key.nunique() <= 1:
        return runs, ""
    chosen = _one_configuration(runs)
    cols = [c for c in CONFIG_COLUMNS if c in runs and runs[c].map(_text).nunique() > 1]
    first = chosen.iloc[0]
    named = ", ".join(f"{c} = {markup.md(_text(first[c]))}" for c in cols)
    return chosen, (f"restricted to the configuration with the most runs ({named}; "
                    f"{key.nunique()} configurations present, {len(runs) - len(chosen)} runs left out)")


# A variant's own settings: two block runs at S = 2 and S = 4 are two variants, not two seeds.
RESIDUAL_COLUMNS = ("block_size", "num_blocks", "window", "residual_heads")


def _one_setting_per_variant(runs: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """(each variant's runs at its setting (RESIDUAL_COLUMNS) with the most runs, a note naming
    the variants that had several; "" when none had)."""
    cols = [c for c in RESIDUAL_COLUMNS if c in runs]
    if runs.empty or not cols:
        return runs, ""
    key = runs[cols].apply(lambda c: c.map(_text)).agg("/".join, axis=1)
    keep, notes = pd.Series(False, index=runs.index), []
    for variant, k in key.groupby(runs["variant"]):
        top = k.value_counts().sort_index().idxmax()
        keep[k.index] = k == top
        if k.nunique() > 1:
            first = runs.loc[k[k == top].index[0]]
            varied = [c for c in cols if runs.loc[k.index, c].map(_text).nunique() > 1]
            n = int((k != top).sum())
            notes.append(f"{markup.md(variant)} at {', '.join(f'{c} = {markup.md(_text(first[c]))}' for c in varied)} "
                         f"({n} run{'s' if n > 1 else ''} at other settings left out)")
    return runs[keep], "; ".join(notes)


# A learning-rate grid varies the learning rate only: its points share the rest of the recipe.
RECIPE_COLUMNS = tuple(c for c in CONFIG_COLUMNS if c != "lr")


def _tuned_lr_runs(fin: pd.DataFrame, abl_runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """(the grid's runs of the recipe (RECIPE_COLUMNS) with the most runs, the ablation's runs of
    that recipe, which add their learning rate to the grid, a note on what was left out)."""
    tuned = fin[fin["section"] == "tuned_lr"]
    if tuned.empty:
        return tuned, abl_runs.iloc[:0], ""
    key = _config_key(tuned, RECIPE_COLUMNS)
    top = key.value_counts().sort_index().idxmax()
    notes = []
    if key.nunique() > 1:
        cols = [c for c in RECIPE_COLUMNS if c in tuned and tuned[c].map(_text).nunique() > 1]
        first = tuned[key == top].iloc[0]
        notes.append(f"the grid's runs are restricted to the recipe with the most runs "
                     f"({', '.join(f'{c} = {markup.md(_text(first[c]))}' for c in cols)}; {int((key != top).sum())} "
                     "runs of other recipes left out)")
    extra = abl_runs[_config_key(abl_runs, RECIPE_COLUMNS) == top] if len(abl_runs) else abl_runs
    if len(abl_runs) and extra.empty:
        notes.append("the ablation's runs were trained with another recipe than the grid's and do not "
                     "extend it")
    return tuned[key == top], extra, "; ".join(notes)


def _same_recipe(runs: pd.DataFrame, of: pd.DataFrame) -> pd.DataFrame:
    """The runs of ``runs`` trained with a recipe (CONFIG_COLUMNS) that one of ``of`` has."""
    if runs.empty or of.empty:
        return runs.iloc[:0]
    return runs[_config_key(runs).isin(set(_config_key(of)))]


def _repeats(runs: pd.DataFrame, of: pd.DataFrame) -> frozenset:
    """Run ids of ``runs`` that repeat a run of ``of``: same recipe, variant, variant settings
    and seed (another sweep's copy of the same training)."""
    if runs.empty or of.empty:
        return frozenset()
    cols = [c for c in CONFIG_COLUMNS + RESIDUAL_COLUMNS + ("variant", "seed") if c in runs and c in of]
    key = _config_key(runs, cols)
    return frozenset(runs.loc[key.isin(set(_config_key(of, cols))), "run_id"])


def _ablation_runs(fin: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    sel = fin[fin["section"] == "ablation"]
    # Optuna trials are a search over hyper-parameters, not replicates of one configuration.
    runs = sel if len(sel) else fin[(fin["section"] == "other") & (fin["role"] != "trial")]
    if runs.empty:
        return runs, ""
    chosen, restriction = _restricted(runs)
    chosen, settings = _one_setting_per_variant(chosen)
    settings = f"runs compared as seeds share their variant's settings: {settings}" if settings else ""
    if len(sel):
        notes = [f"The ablation runs are {restriction}." if restriction else "",
                 f"{settings[0].upper()}{settings[1:]}." if settings else ""]
        return chosen, " ".join(n for n in notes if n)
    note = ("No `ablation` sweep: this table compares the finished runs of other sweeps "
            f"({', '.join(markup.md(s) for s in sorted(chosen['sweep'].unique()))})")
    return chosen, "; ".join(n for n in (note + (", " + restriction if restriction else ""), settings) if n) + "."


def _inputs(runset: RunSet, roles: pd.Series, opts: Options, repeated: pd.DataFrame,
            unusable: pd.DataFrame | None = None) -> str:
    runs = runset.runs
    lines = [f"Source: {markup.md(runset.source)}. {len(runs)} training runs in "
             f"{runs['experiment'].nunique()} experiment(s); bootstrap: {opts.n_boot} resamples, "
             f"seed {opts.seed}; intervals at {int(opts.level * 100)}%.\n"]
    counts = (runs.assign(section=roles).groupby(["sweep", "section", "status"]).size()
              .rename("runs").reset_index())
    lines.append(abl.to_markdown(counts))
    bad = runs[runs["status"] != "FINISHED"]
    if len(bad):
        show = bad[["run_id", "sweep", "variant", "model", "seed", "status", "failure"]].copy()
        show["run_id"] = show["run_id"].str[:12]
        show["seed"] = show["seed"].map(lambda x: "–" if pd.isna(x) else f"{x:g}")
        show["failure"] = show["failure"].map(  # absent: None, or NaN where a frame mixed them
            lambda f: "–" if not isinstance(f, str) else f if len(f) <= 200 else f[:199] + "…")
        lines.append(f"\n**{len(bad)} run(s) did not finish** and are left out of every "
                     "statistic:\n")
        lines.append(abl.to_markdown(show.fillna("–")))
    else:
        lines.append("\nEvery run finished.\n")
    lines += _left_out(runset, unusable)
    if len(repeated):
        show = repeated[["run_id", "sweep", "variant", "model", "seed", "run_key"]].copy()
        show["run_id"] = show["run_id"].str[:12]
        show["seed"] = show["seed"].map(lambda x: "–" if pd.isna(x) else f"{x:g}")
        lines.append(f"\n**{len(repeated)} finished run(s) repeat the config and seed of a later run** "
                     "(the same `attnres.run_key`: trained again with `train.resume=false` or into another "
                     "checkpoint folder; or the same trained values under another spelling, such as "
                     "`train.steps` for `train.tokens`) and are left out of every statistic; the latest "
                     "of each counts once:\n")
        lines.append(abl.to_markdown(show.fillna("–")))
    return "\n".join(lines)


def _left_out(runset: RunSet, unusable: pd.DataFrame | None) -> list[str]:
    """Lines naming what reading the input dropped, and every finished run without a usable
    final loss, with its value."""
    lines = [f"\nLeft out while reading the input: {markup.md(n)}.\n" for n in runset.notes]
    stale = _adaptive_for(runset)[1]
    if stale:
        lines.append(f"\n{stale}\n")
    if unusable is not None and len(unusable):
        show = unusable[["run_id", "sweep", "variant", "model", "seed"]].copy()
        show["run_id"] = show["run_id"].str[:12]
        show["seed"] = show["seed"].map(lambda x: "–" if pd.isna(x) else f"{x:g}")
        show["final_val_loss"] = unusable["final_val_loss"].map(
            lambda x: "missing or not a number" if pd.isna(x) else f"{x:g}")
        lines.append(f"\n**{len(unusable)} finished run(s) have no finite final validation loss** "
                     "and are left out of every statistic:\n")
        lines.append(abl.to_markdown(show.fillna("–")))
    return lines


def _adaptive_for(runset: RunSet) -> tuple[dict | None, str]:
    """(adaptive.json beside the snapshot if its verdicts rest on runs of this snapshot, else None;
    a note when they do not). The file records the run keys of the runs its verdicts rest on; a
    verdict of another recipe's runs would be quoted beside a table it did not judge. A file
    without them (written before they were recorded) is quoted as it is."""
    adaptive = runset.adaptive
    if not adaptive or not adaptive.get("run_keys"):
        return adaptive, ""
    missing = set(adaptive["run_keys"]) - set(runset.runs["run_key"].dropna())
    if not missing:
        return adaptive, ""
    return None, (f"adaptive.json beside the input is not quoted: {len(missing)} of the "
                  f"{len(adaptive['run_keys'])} runs its verdicts rest on are not among these runs "
                  "(another recipe's study, or a snapshot exported before it).")


def _unless_reversed(c: "sec.Claim", outcome: str | None) -> "sec.Claim":
    if outcome != "reverses" or c.verdict not in ("agrees", "does not agree"):
        return c
    return replace(c, verdict="inconclusive", ours=c.ours + "; resolves with the other sign at "
                               "another nuisance setting (robustness section): no verdict")


def _summary(sections, nuisance: dict[str, str | None] | None = None) -> str:
    """``nuisance``: {variant: how variant − baseline fared over the robustness runs' settings}; a
    verdict against the baseline that resolves the other way at one of them is no verdict."""
    rows = [(s.title, _unless_reversed(c, (nuisance or {}).get(c.against_baseline)))
            for s in sections for c in s.claims]
    if not rows:
        return "No claim of the paper could be checked with these runs.\n"
    df = pd.DataFrame([{"Section": t, "Paper's claim": c.claim, "Ours": c.ours,
                        "Verdict": c.verdict} for t, c in rows])
    # Each verdict is a 5%-level test of its own; across a couple of dozen of them one or two
    # come out "significant" by chance, so the p-values behind them are shown with Holm's
    # family-wise adjustment over every tested check that has one (bootstrap intervals and counts
    # have none and are not in the family).
    p = pd.Series([c.p if c.verdict != "not tested" else float("nan") for _, c in rows], dtype=float)
    adj = holm(p.to_numpy())
    df.insert(3, "p (Holm)", [f"{x:.2g} ({a:.2g})" if pd.notna(x) else "–" for x, a in zip(p, adj)])
    df["Verdict"] = [sec.held_after_holm(c.verdict, a) for (_, c), a in zip(rows, adj)]
    n = df["Verdict"].value_counts()
    head = (f"Of {len(df)} checks, {n.get('agrees', 0)} agree with the paper, "
            f"{n.get('does not agree', 0)} do not, {n.get('inconclusive', 0)} are inconclusive at "
            f"our run count and {n.get('not tested', 0)} could not be tested with these runs; "
            "a verdict with a p-value stands only where its Holm-adjusted p is below 5%. "
            "*Inconclusive* means our 95% interval admits both directions: more seeds or a larger "
            "scale could settle it (the ablation section says how many seeds a difference of the "
            "paper's size needs at our noise level); *does not agree* means our runs show the "
            "opposite at that level, at our scale.")
    # Only verdicts with a p-value are in the family: one that rests on a bootstrap interval or a
    # count (no p) is neither kept nor dropped by the adjustment, and is not counted as dropped.
    decided = [i for i, (_, c) in enumerate(rows)
               if c.verdict in ("agrees", "does not agree") and pd.notna(p[i])]
    untested = sum(c.verdict in ("agrees", "does not agree") and pd.isna(p[i]) for i, (_, c) in enumerate(rows))
    tested = int(p.notna().sum())
    if tested > 1 and decided:
        kept = [rows[i][1].claim for i in decided if adj[i] < 0.05]
        head += (f" Each verdict is a test at 5% of its own: p (Holm) gives its two-sided p-value "
                 f"and, in brackets, the p-value adjusted by Holm's method over the {tested} "
                 f"checks with a p-value (family-wise 5%); of the {len(decided)} with a p-value that "
                 f"agree or do not agree, {len(kept)} hold after the adjustment"
                 + (f" ({'; '.join(kept)})" if kept else "")
                 + (f"; {untested} more rest on an interval or a count without a p-value, outside "
                    "the adjustment" if untested else "") + ".")
    return head + "\n\n" + abl.to_markdown(df)


def build_report(runset: RunSet, out, opts: Options | None = None) -> tuple[Path, list[str]]:
    """Write tables/, figures/ and REPORT.md into ``out``; return (REPORT.md, section errors).

    Everything is written into a staging folder inside ``out`` and moved into place once the
    report is whole (REPORT.md last), so a report that stops half-way (an error outside the
    sections, a full disk, Ctrl-C) leaves ``out`` as it was."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".report-", dir=out))
    try:
        errors = _write_report(runset, staging, opts or Options())
        files = sorted((f for f in staging.rglob("*") if f.is_file()), key=lambda f: f.name == "REPORT.md")
        for file in files:
            target = out / file.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(file, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out / "REPORT.md", errors


def _write_report(runset: RunSet, out: Path, opts: Options) -> list[str]:
    paper = load_paper(opts.paper_dir)
    runs = runset.runs.copy()
    runs["section"] = assign_roles(runs, opts.roles)
    fin, repeated = latest_per_config(runs[runs["status"] == "FINISHED"])
    unusable = fin[~np.isfinite(fin["final_val_loss"])]  # NaN, inf, or text read as NaN
    fin = fin.drop(index=unusable.index)
    abl_runs, abl_note = _ablation_runs(fin)
    # Figs. 5 and 8 compare variants at one depth: the ablation's runs when there are any, else
    # the finished runs of the configuration with the most runs (profiles of different depths
    # must not be averaged or compared as replicates).
    dyn_runs = abl_runs if len(abl_runs) else _one_configuration(fin)
    tuned, tuned_extra, tuned_note = _tuned_lr_runs(fin, abl_runs)

    robust = fin[fin["section"] == "robustness"]
    nuisance = {v: sec.robustness.outcome(pd.concat([abl_runs, robust]), v, opts.level) for v in ("full", "block")}
    jobs = [
        ("Ablation (paper Table 4)", lambda: sec.ablation_section(abl_runs, paper, out, abl_note,
                                                                  opts.n_boot, opts.seed,
                                                                  _adaptive_for(runset)[0], runset.pilot)),
        ("Noise study (the ablation's recipe)", lambda: sec.noise_section(
            abl_runs, out, opts.target_delta, histories=runset.histories)),
        ("Ablation at each variant's tuned learning rate", lambda: sec.tuned_lr_section(
            tuned, tuned_extra, paper, out, tuned_note)),
        (sec.full.TITLE, lambda: sec.full_section(
            abl_runs, tuned, tuned_extra, _same_recipe(fin[fin["section"] == "block_size"], abl_runs),
            runset.histories, out, nuisance["full"])),
        ("Block size (paper Fig. 6)", lambda: sec.block_size_section(
            fin[fin["section"] == "block_size"], paper, out,
            _repeats(fin[fin["section"] == "block_size"], abl_runs))),
        ("Scaling (paper Fig. 4 and Table 2)", lambda: sec.scaling_section(
            fin[fin["section"] == "scaling"], paper, out, n_boot=opts.n_boot, seed=opts.seed,
            at=opts.multiplier_at, level=opts.level)),
        ("Architecture (paper Fig. 7)", lambda: sec.arch_section(fin[fin["section"] == "arch"],
                                                                 paper, out)),
        ("Multi-hop probe", lambda: sec.multihop_section(fin[fin["section"] == "multihop"], out)),
        ("Training dynamics (paper Fig. 5)", lambda: sec.dynamics_section(
            dyn_runs, runset.instrumentation, out)),
        ("Depth weights (paper Fig. 8)", lambda: sec.depth_section(
            dyn_runs, runset.instrumentation, out)),
        ("Training curves", lambda: sec.curves_section(runset, out)),
    ]
    if len(robust):  # only where such runs exist: a study without them reads as it did
        jobs.insert(4, (sec.robustness.TITLE, lambda: sec.robustness_section(
            pd.concat([abl_runs, robust]), out, opts.level)))
    sections, errors = [], []
    for title, job in jobs:
        try:
            sections.append(job())
        except Exception as exc:  # one broken section must not cost the rest of the report
            msg = f"{title}: {type(exc).__name__}: {exc}"
            errors.append(msg)
            traceback.print_exc(file=sys.stderr)
            sections.append(sec.Section(title, f"**This section failed:** {markup.md(msg)}\n"))

    if paper.folder is None:
        paper_note = "The paper's numbers were not found (results/paper/); paper columns are empty."
    else:
        paper_note = ("Paper: Kimi Team, *Attention Residuals*, arXiv 2603.15031 (2026); its "
                      "numbers are in `results/paper/`.")
    parts = ["# Attention Residuals: our runs beside the paper\n", paper_note + "\n",
             "## Runs\n", _inputs(runset, runs["section"], opts, repeated, unusable),
             "## Where we agree with the paper and where we do not\n", _summary(sections, nuisance)]
    for i, s in enumerate(sections, 1):
        parts += [f"## {i}. {s.title}\n", s.text]
    (out / "REPORT.md").write_text("\n".join(p.rstrip("\n") + "\n" for p in parts))
    (out / "versions.json").write_text(json.dumps(versions(), indent=1, sort_keys=True) + "\n")
    return errors


# The libraries whose numerics the tables depend on: a later release may move a fit in its
# sixth digit, so the versions a report was made with are written beside it.
LIBRARIES = ("numpy", "scipy", "pandas", "statsmodels", "matplotlib")


def versions() -> dict[str, str]:
    """Python's and each of LIBRARIES' version, as installed."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return {"python": sys.version.split()[0], **{n: installed(n) for n in LIBRARIES}}
