"""Why Full AttnRes trails, judged with the study's own runs: its loss against the learning rate,
how sharply its depth weights choose over training beside Block's, and Block at S = 1 (which
computes what Full computes, through the Block code path) on the block-size curve."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from .. import ablation as abl
from .. import figures
from ..significance import by_seed, paired_t
from .section import Section, _f, _img, _md, _write

TITLE = "Why Full trails the baseline: a finding or a fault"
VARIANTS = ("baseline", "block", "full")


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


def _lr_part(ablation, tuned, out):
    """Each rate's same-seed mean of full − baseline (and full − block), its 95% interval from the
    ablation's σ of those differences (a grid point has two seeds or so, too few for its own σ;
    this assumes the scatter is the same at every rate). above: whether Full at its best rate of
    the grid ends above the baseline at its own (True), below (False), or the grid cannot tell (None)."""
    if tuned.empty or not {"baseline", "full"} <= set(tuned["variant"]):
        return "", [], None
    grid = _by_lr(ablation, tuned)
    if grid.empty or "full" not in grid or "baseline" not in grid:
        return "", [], None
    rows, sds = [], {b: _diff_sd(ablation, "full", b) for b in ("baseline", "block")}
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
    table = pd.DataFrame(rows)
    files = _write(table, out, "full_lr")
    best = table.loc[table["full"].idxmin()]
    edge = best["lr"] in (table["lr"].min(), table["lr"].max())
    # Each at its own best rate of the grid: a rate where the baseline fails is not one where Full
    # is better. Picking the best of a few points flatters both sides alike; the interval ignores it.
    base = table.loc[table["baseline"].idxmin()]
    sd, dof = sds["baseline"]
    gap = float(best["full"] - base["baseline"])
    half = float(stats.t.ppf(0.975, dof) * sd / np.sqrt(min(best["seeds"], base["seeds"]))) if dof else np.nan
    above = True if gap - half > 0 else False if gap + half < 0 else None
    text = ("**Learning rate.** Full, Block and the baseline at each rate of the grid (the ablation's "
            "runs at the shared rate and sweep `tuned_lr` at the others, the same recipe), on the seeds "
            "trained at every rate; full − baseline and full − block are same-seed means, ± the 95% "
            f"t half-width from the ablation's σ of those differences (full − baseline: {_f(sd)}, "
            f"{dof} degrees of freedom):\n\n" + _md(table) + "\n"
            f"Full's best rate on this grid is {best['lr']:g}{' (an end of the grid)' if edge else ''}, "
            f"the baseline's {base['lr']:g}; each at its own best rate, Full − baseline = {_f(gap)} ± "
            f"{_f(half)}: "
            + ("Full still ends above the baseline, so the shared learning rate does not explain the "
               "gap.\n\n" if above else
               "Full ends below the baseline, so the gap was the shared learning rate.\n\n"
               if above is False else "the grid cannot tell them apart.\n\n"))
    return text, files, above


def _entropy_part(ablation, histories, out):
    runs = ablation[ablation["variant"].isin(("block", "full"))]
    h = histories[(histories["key"] == "depth/entropy") & histories["run_id"].isin(runs["run_id"])]
    if h.empty:
        return "", [], None
    h = h.merge(runs[["run_id", "variant"]], on="run_id")
    curve = h.groupby(["variant", "step"])["value"].agg(["mean", "min", "max", "count"]).reset_index()
    last = h.sort_values("step").groupby("run_id").tail(1)
    end = last.groupby("variant")["value"].agg(["mean", "std", "count"])
    files = figures.depth_entropy(curve, out / "figures")
    text = ("**How sharply the depth weights choose.** `depth/entropy` over training: each reader's "
            "per-token entropy of its depth weights over the log of the sources it sees, averaged over "
            "readers (1 = the uniform mean a zero query starts from, 0 = one source); mean and range "
            "over the runs that logged it. At the end: "
            + "; ".join(f"{v} {_f(r['mean'], 3)} (sd {_f(r['std'], 3)}, {int(r['count'])} runs)"
                        for v, r in end.iterrows()) + ".\n\n")
    sharper = None
    if {"block", "full"} <= set(end.index):
        sharper = end.loc["full", "mean"] < end.loc["block", "mean"]
        text += ("Full's readers end *sharper* than Block's: it is not stuck at the uniform mean it "
                 "starts from.\n\n" if sharper else
                 "Full's readers end *flatter* than Block's: over its many sources it stays closer to "
                 "the uniform mean it starts from, a mean that dilutes each source as depth grows.\n\n")
    return text + _img(files, out, "depth-weight entropy"), files, sharper


def _s1_part(ablation, block_size):
    """Where Block at S = 1 lands: beside Full (the two code paths compute one function, so a
    trailing Full is the end of the block-size curve) or beside Block (Full's own path is at
    fault). Training amplifies rounding differences between the paths, so "beside" is the nearer of
    the two at the same seeds, not equality."""
    s1 = block_size[(block_size["variant"] == "block") & (abl.block_size_of(block_size) == 1)]
    full, block = _seeds(ablation, "full"), _seeds(ablation, "block")
    if s1.empty or full.empty or block.empty:
        return "", None
    a = _seeds(s1, "block")
    to_full, to_block = (a - full).dropna(), (a - block).dropna()
    seeds = to_full.index.intersection(to_block.index)
    if seeds.empty:
        return "", None
    near_full, near_block = float(to_full[seeds].mean()), float(to_block[seeds].mean())
    same = abs(near_full) < abs(near_block)
    curve = (block_size[block_size["variant"] == "block"].assign(S=abl.block_size_of(block_size))
             .groupby("S")["final_val_loss"].mean())
    text = ("**Block at S = 1.** A block of one sublayer is Full computed by the Block code path. "
            f"Over seeds {', '.join(f'{s:g}' for s in seeds)}, Block at S = 1 ends "
            f"{_f(near_full)} from Full and {_f(near_block)} from Block (S = 4) at the same seeds: "
            f"it lands beside {'Full' if same else 'Block'}. Mean loss by S on the block-size curve: "
            + ", ".join(f"S = {s:g}: {v:.4f}" for s, v in curve.items()) + ".\n\n")
    return text, same


KINDS = ("fault", "recipe", "finding", "undecided")


def diagnose(ablation: pd.DataFrame, tuned: pd.DataFrame, tuned_extra: pd.DataFrame,
             block_size: pd.DataFrame, histories: pd.DataFrame, out: Path) -> tuple[str, str, list[Path]]:
    """(kind, Markdown, files). kind (KINDS): *fault* when Block at S = 1 ends elsewhere than Full at
    the same seeds; else *recipe* when Full at its best learning rate of the grid ends below the
    baseline at its own (95%); else *finding* when above (95%) and S = 1 lands beside Full; else
    *undecided*.
    ablation: the ablation's runs; tuned, tuned_extra: the learning-rate grid and the ablation's
    runs of its recipe (report.py); block_size: block-size runs of the ablation's recipe."""
    gap, hw, _, n = paired_t(_seeds(ablation, "full"), _seeds(ablation, "baseline"))
    if not np.isfinite(gap):
        return "undecided", "No ablation runs of Full and the baseline at shared seeds.\n\n", []
    text = (f"In the ablation Full − baseline = {_f(gap)} ± {_f(hw)} nats over {n} shared seeds. "
            "Three of the study's runs tell whether that is the recipe, the code, or the variant:\n\n")
    lr_text, lr_files, above = _lr_part(tuned_extra, tuned, out)
    ent_text, ent_files, sharper = _entropy_part(ablation, histories, out)
    s1_text, same = _s1_part(ablation, block_size)
    text += lr_text + ent_text + s1_text
    missing = [name for name, part in (("the learning-rate grid", lr_text),
                                       ("the depth-weight entropy", ent_text),
                                       ("Block at S = 1", s1_text)) if not part]
    if same is False:
        kind, verdict = "fault", ("**A fault to find**: Block at S = 1 should compute what Full "
                                  "computes, and its runs end elsewhere.")
    elif above is False:
        kind, verdict = "recipe", ("**The recipe**: at its own best learning rate Full ends below the "
                                   "baseline at its own; the ablation's shared rate is not Full's.")
    elif above and same:
        kind, verdict = "finding", (
            "**A finding at this scale, not a fault**: Full trails with each at its best learning rate, "
            "and the Block code path at S = 1 reproduces it"
            + ("; its readers stay closer to uniform than Block's" if sharper is False else "")
            + ". What the study cannot say is whether it holds at the paper's scale.")
    else:
        kind, verdict = "undecided", "**Not decided** by these runs."
    if missing:
        verdict += f" Not available in these runs: {', '.join(missing)}."
    return kind, text + verdict + "\n\n", lr_files + ent_files


def full_section(*inputs) -> Section:
    """The section of :func:`diagnose`, same arguments."""
    _, text, files = diagnose(*inputs)
    return Section(TITLE, text, [], files)
