"""Full AttnRes against the baseline, judged with the study's own runs: its loss against the
learning rate, how sharply its depth weights choose beside Block's, Block at S = 1 (which computes
what Full computes, through the Block code path), and whether the gap survives its nuisance
settings. The words of the verdict come from :func:`verdict`, a rule over the intervals."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from .. import ablation as abl
from .. import figures
from ..significance import by_seed, compare, paired_t, tost
from .section import Section, _f, _img, _md, _write

TITLE = "Full AttnRes against the baseline: finding, recipe or fault"
VARIANTS = ("baseline", "block", "full")
# nats: Block at S = 1 is "beside Full" only when two one-sided tests put |S1 − Full| below this.
EQUIVALENCE_MARGIN = 0.03
NUISANCE = "its nuisance settings, the RMSNorm ε and the init scale"
KINDS = ("fault", "recipe", "finding", "undecided")


@dataclass
class Evidence:
    """What each part measured; None where the runs lack that part."""
    gap: float = np.nan  # full − baseline at the default settings, paired over the ablation's seeds
    gap_half: float = np.nan
    gap_n: int = 0
    above: bool | None = None  # Full at its best grid rate vs the baseline at its own (95%)
    s1: str | None = None  # "equivalent" | "different" | "neither" (Block at S = 1 against Full)
    flatter: bool | None = None  # Full's end entropy above Block's (True), below (False), neither (None)
    nuisance: str | None = None  # "survives" | "reverses" | "undecided" over the nuisance settings
    missing: list = field(default_factory=list)


def verdict(e: Evidence) -> tuple[str, str]:
    """(kind, words) from the evidence. *fault*: Block at S = 1 ends apart from Full (its interval
    excludes 0); *recipe*: Full at its own best learning rate ends below the baseline at its own;
    *finding*: Full above the baseline at its best rate, S = 1 shown equivalent to Full (TOST) and
    the gap surviving its nuisance settings; anything short of that is *undecided*, and the words
    say which part fell short."""
    if e.s1 == "different":
        return "fault", ("**A fault to find**: Block at S = 1 should compute what Full computes, "
                         "and its runs end apart from Full's beyond their interval.")
    if e.above is False:
        return "recipe", ("**The recipe**: at its own best learning rate Full ends below the "
                          "baseline at its own; the ablation's shared rate is not Full's.")
    short = []
    if e.above is None:
        short.append("the learning-rate grid cannot place Full at its best rate above or below the "
                     "baseline at its own")
    if e.s1 != "equivalent":
        short.append(f"Block at S = 1 is not shown within ±{EQUIVALENCE_MARGIN:g} nats of Full"
                     if e.s1 else "there is no Block at S = 1 to compare")
    if e.nuisance == "reverses":
        short.append("the gap resolves with the opposite sign at one of its nuisance settings "
                     "(the robustness section names it)")
    elif e.nuisance != "survives":
        short.append(f"the gap has not been shown to survive {NUISANCE}"
                     + (" (not varied in these runs)" if e.nuisance is None else ""))
    if not short:
        return "finding", ("**A finding at this scale**: Full trails with each at its best learning "
                           "rate, the Block code path at S = 1 reproduces it, and the gap keeps its "
                           "sign over the nuisance settings tried.")
    measured = (f"At the default settings Full − baseline = {_f(e.gap)} ± {_f(e.gap_half)} over "
                f"{e.gap_n} shared seeds, a measurement of this recipe; " if np.isfinite(e.gap) else "")
    return "undecided", (f"**Undecided as a claim about Full.** {measured}as a property of Full it "
                         f"is not decided: {'; '.join(short)}.")


def _seeds(runs: pd.DataFrame, variant: str) -> pd.Series:
    """A variant's final loss by seed (significance.by_seed)."""
    g = runs[runs["variant"] == variant]
    return by_seed(g["final_val_loss"], g["seed"])


def _by_lr(ablation: pd.DataFrame, tuned: pd.DataFrame) -> pd.DataFrame:
    runs = pd.concat([ablation, tuned], ignore_index=True)
    runs = runs[runs["variant"].isin(VARIANTS)].dropna(subset=["final_val_loss", "lr", "seed"])
    # Only seeds that were trained at every rate of the grid: a rate is then compared on equal seeds.
    rates = sorted(runs["lr"].unique())
    full = runs.groupby("seed")["lr"].nunique()
    runs = runs[runs["seed"].isin(full[full == len(rates)].index)]
    return runs.pivot_table(index=["lr", "seed"], columns="variant", values="final_val_loss")


def _diff_sd(ablation: pd.DataFrame, a: str, b: str) -> tuple[float, int]:
    """σ of same-seed differences a − b over the ablation's seeds, and its degrees of freedom."""
    d = (_seeds(ablation, a) - _seeds(ablation, b)).dropna()
    return (float(d.std(ddof=1)), len(d) - 1) if len(d) > 1 else (np.nan, 0)


def _lr_table(grid: pd.DataFrame, sds: dict) -> pd.DataFrame:
    rows = []
    for lr, g in grid.groupby(level="lr"):
        g = g.droplevel("lr")
        row = {"lr": lr, "seeds": len(g)}
        for v in VARIANTS:
            row[v] = float(g[v].mean()) if v in g else np.nan
        for b, col in (("baseline", "±"), ("block", "± ")):
            if b in g:
                sd, dof = sds[b]
                row[f"full − {b}"] = float((g["full"] - g[b]).mean())
                row[col] = float(stats.t.ppf(0.975, dof) * sd / np.sqrt(len(g))) if dof else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def _lr_part(ablation, tuned, out, e: Evidence):
    """Each rate's same-seed mean of full − baseline (and full − block), its 95% interval from the
    ablation's σ of those differences (a grid point has two seeds or so, too few for its own σ;
    this assumes the scatter is the same at every rate); sets ``e.above``."""
    if tuned.empty or not {"baseline", "full"} <= set(tuned["variant"]):
        return "", []
    grid = _by_lr(ablation, tuned)
    if grid.empty or "full" not in grid or "baseline" not in grid:
        return "", []
    sds = {b: _diff_sd(ablation, "full", b) for b in ("baseline", "block")}
    table = _lr_table(grid, sds)
    files = _write(table, out, "full_lr")
    best, base = table.loc[table["full"].idxmin()], table.loc[table["baseline"].idxmin()]
    edge = best["lr"] in (table["lr"].min(), table["lr"].max())
    # Each at its own best rate of the grid: a rate where the baseline fails is not one where Full
    # is better. Picking the best of a few points flatters both sides alike; the interval ignores it.
    sd, dof = sds["baseline"]
    gap = float(best["full"] - base["baseline"])
    half = float(stats.t.ppf(0.975, dof) * sd / np.sqrt(min(best["seeds"], base["seeds"]))) if dof else np.nan
    e.above = True if gap - half > 0 else False if gap + half < 0 else None
    seeds = sorted(grid.index.get_level_values("seed").unique())
    text = ("**Learning rate.** Full, Block and the baseline at each rate of the grid (the ablation's "
            "runs at the shared rate and sweep `tuned_lr` at the others, the same recipe), on the seeds "
            "trained at every rate; full − baseline and full − block are same-seed means, ± the 95% "
            f"t half-width from the ablation's σ of those differences (full − baseline: {_f(sd)}, "
            f"{dof} degrees of freedom):\n\n" + _md(table) + "\n"
            f"The grid is {len(table)} rates × {len(seeds)} seeds ({', '.join(f'{s:g}' for s in seeds)})"
            + _typical(ablation, tuned, seeds) +
            f" Full's best rate on it is {best['lr']:g}{' (an end of the grid)' if edge else ''}, "
            f"the baseline's {base['lr']:g}; each at its own best rate, Full − baseline = {_f(gap)} ± "
            f"{_f(half)}: " + ("Full ends above the baseline" if e.above else
                               "Full ends below the baseline" if e.above is False else
                               "the grid cannot tell them apart")
            + f"; a difference inside ±{_f(half)} would go unseen by it.\n\n")
    return text, files


def _typical(ablation, tuned, seeds) -> str:
    """How the grid's seeds compare with the ablation's, at the ablation's own rate."""
    rate = set(ablation["lr"].dropna()) - set(tuned["lr"].dropna()) if "lr" in ablation else set()
    d = (_seeds(ablation, "full") - _seeds(ablation, "baseline")).dropna()
    if len(rate) != 1 or d.empty or not set(seeds) <= set(d.index):
        return "."
    return (f": at the ablation's rate {rate.pop():g} these seeds put full − baseline at "
            f"{_f(d[list(seeds)].mean(), 3)}, against {_f(d.mean(), 3)} over all {len(d)} seeds.")


def _entropy_part(ablation, histories, out, e: Evidence):
    runs = ablation[ablation["variant"].isin(("block", "full"))]
    h = histories[(histories["key"] == "depth/entropy") & histories["run_id"].isin(runs["run_id"])]
    if h.empty:
        return "", []
    h = h.merge(runs[["run_id", "variant", "seed"]], on="run_id")
    curve = h.groupby(["variant", "step"])["value"].agg(["mean", "min", "max", "count"]).reset_index()
    last = h.sort_values("step").groupby("run_id").tail(1)
    end = last.groupby("variant")["value"].agg(["mean", "std", "count"])
    files = figures.depth_entropy(curve, out / "figures")
    logged = ", ".join(f"{int(r['count'])} of {int((runs['variant'] == v).sum())} {v} runs"
                       for v, r in end.iterrows())
    text = ("**How sharply the depth weights choose.** `depth/entropy` over training: each reader's "
            "per-token entropy of its depth weights over the log of the sources it sees, averaged over "
            "readers (1 = the uniform mean a zero query starts from, 0 = one source); mean and range "
            f"over the runs that logged it ({logged}). At the end: "
            + "; ".join(f"{v} {_f(r['mean'], 3)} (sd {_f(r['std'], 3)}, {int(r['count'])} runs)"
                        for v, r in end.iterrows()) + ".")
    if {"block", "full"} <= set(end.index):
        f, b = last[last["variant"] == "full"], last[last["variant"] == "block"]
        c = compare(f["value"], b["value"], f["seed"], b["seed"])
        e.flatter = True if c.lo > 0 else False if c.hi < 0 else None
        how = f"paired over {c.n} seeds" if c.design == "paired" else "Welch"
        text += (f" Full − Block at the end = {_f(c.diff, 3)} ± {_f(c.half, 3)} ({how}): "
                 + ("Full's readers end flatter than Block's, closer to the uniform mean it starts "
                    "from." if e.flatter else "Full's readers end sharper than Block's."
                    if e.flatter is False else "the interval admits both, so neither is said to "
                    "choose more sharply."))
    return text + "\n\n" + _img(files, out, "depth-weight entropy"), files


def _s1_part(ablation, block_size, e: Evidence) -> str:
    """Where Block at S = 1 lands against Full at the same seeds: equivalent within ±MARGIN
    (two one-sided tests), apart (the interval excludes 0), or neither. Below MIN_OWN_PAIRS pairs
    the σ is that of same-seed differences pooled over the ablation's variants."""
    s1 = block_size[(block_size["variant"] == "block") & (abl.block_size_of(block_size) == 1)]
    if s1.empty or ablation[ablation["variant"] == "full"].empty:
        return ""
    full = ablation[ablation["variant"] == "full"]
    c = compare(s1["final_val_loss"], full["final_val_loss"], s1["seed"], full["seed"],
                pooled=abl.pooled_differences(ablation))
    if c.design != "paired" and c.n < 2:
        return ""
    se = c.half / stats.t.ppf(0.975, c.dof) if c.dof and np.isfinite(c.half) else np.nan
    p_eq, equal = tost(c.diff, se, c.dof, EQUIVALENCE_MARGIN)
    e.s1 = "equivalent" if equal else "different" if (c.lo > 0 or c.hi < 0) else "neither"
    sd = "the σ of same-seed differences pooled over the ablation's variants" if c.sd_from == "pooled" else "their own σ"
    curve = (block_size[block_size["variant"] == "block"].assign(S=abl.block_size_of(block_size))
             .groupby("S")["final_val_loss"].mean())
    return ("**Block at S = 1.** A block of one sublayer is Full computed by the Block code path. "
            f"Block at S = 1 − Full = {_f(c.diff)} ± {_f(c.half)} over {c.n} shared seeds ({sd}, "
            f"{c.dof} degrees of freedom); two one-sided tests of |S1 − Full| < {EQUIVALENCE_MARGIN:g} "
            f"nats give p = {_f(p_eq, 3)}: "
            + {"equivalent": "within the margin, so S = 1 lands beside Full.",
               "different": "apart from Full beyond the interval.",
               "neither": "neither shown within the margin nor apart, so where S = 1 lands is not "
                          "claimed."}[e.s1]
            + " Mean loss by S on the block-size curve: "
            + ", ".join(f"S = {s:g}: {v:.4f}" for s, v in curve.items()) + ".\n\n")


def diagnose(ablation: pd.DataFrame, tuned: pd.DataFrame, tuned_extra: pd.DataFrame,
             block_size: pd.DataFrame, histories: pd.DataFrame, out: Path,
             nuisance: str | None = None) -> tuple[str, str, list[Path]]:
    """(kind, Markdown, files), the kind and its words from :func:`verdict`.
    ablation: the ablation's runs; tuned, tuned_extra: the learning-rate grid and the ablation's
    runs of its recipe (report.py); block_size: block-size runs of the ablation's recipe;
    nuisance: how full − baseline fared over the nuisance settings (robustness runs), None when
    they were not varied."""
    gap, hw, _, n = paired_t(_seeds(ablation, "full"), _seeds(ablation, "baseline"))
    if not np.isfinite(gap):
        return "undecided", "No ablation runs of Full and the baseline at shared seeds.\n\n", []
    e = Evidence(gap, hw, n, nuisance=nuisance)
    text = (f"In the ablation Full − baseline = {_f(gap)} ± {_f(hw)} nats over {n} shared seeds. "
            "What the study's other runs say about whether that is the recipe, the code, or the "
            "variant:\n\n")
    lr_text, lr_files = _lr_part(tuned_extra, tuned, out, e)
    ent_text, ent_files = _entropy_part(ablation, histories, out, e)
    s1_text = _s1_part(ablation, block_size, e)
    text += lr_text + ent_text + s1_text
    kind, words = verdict(e)
    missing = [name for name, part in (("the learning-rate grid", lr_text),
                                       ("the depth-weight entropy", ent_text),
                                       ("Block at S = 1", s1_text)) if not part]
    if missing:
        words += f" Not available in these runs: {', '.join(missing)}."
    return kind, text + words + "\n\n", lr_files + ent_files


def full_section(*inputs) -> Section:
    """The section of :func:`diagnose`, same arguments."""
    _, text, files = diagnose(*inputs)
    return Section(TITLE, text, [], files)
