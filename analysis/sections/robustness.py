"""Robustness: each ablation verdict re-judged at the nuisance settings (an epsilon, an init scale,
a learning rate) that runs of a `robustness*` sweep cover, one knob changed at a time."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from .. import robustness as rob
from ..adaptive import Plan
from .section import Section, _md, _write

TITLE = "Robustness to nuisance settings"
# The plan of `python -m analysis robustness` when a declaration names none: its looks set the level.
DEFAULT_LOOKS = dict(start=4, step=2, max_seeds=8, half_width=0.03)


def _declaration(runs: pd.DataFrame, level: float) -> tuple[rob.Declaration, int]:
    """The comparisons (each variant against the baseline) and one-knob settings the runs cover;
    and how many runs changed several knobs at once (left out)."""
    settings = runs.apply(rob.setting_of, axis=1)
    found = sorted({s for s in settings if s is not None and s.knob is not None},
                   key=lambda s: (list(rob.KNOBS).index(s.knob), s.value))
    at_default = set(runs.loc[[s == rob.Setting() for s in settings], "variant"])
    elsewhere = set(runs.loc[[s is not None and s.knob is not None for s in settings], "variant"])
    base = "baseline"
    comparisons = tuple((v, base) for v in sorted((at_default & elsewhere) - {base})
                        if base in at_default & elsewhere)
    plan = Plan(comparisons, level=level, **DEFAULT_LOOKS)
    decl = rob.Declaration("", "", "", comparisons, (rob.Setting(), *found), plan)
    return decl, int(sum(s is None for s in settings))


def outcome(runs: pd.DataFrame, variant: str, level: float = 0.95) -> str | None:
    """How `variant` − baseline fared over the nuisance settings the runs cover: "survives",
    "reverses" or "undecided"; None when no setting besides the default pairs it with the baseline."""
    decl, _ = _declaration(runs, level)
    comparison = f"{variant} − baseline"
    if len(decl.settings) < 2 or (variant, "baseline") not in decl.comparisons:
        return None
    verdicts = rob.survival(rob.judge(runs, decl, sweeps=False), decl.plan)
    said = verdicts.loc[verdicts["comparison"] == comparison, "outcome"].iloc[0]
    return "survives" if said == "survives" else "reverses" if said.startswith("reverses") else "undecided"


def robustness_section(runs: pd.DataFrame, out: Path, level: float = 0.95) -> Section:
    """``runs``: the ablation's finished runs (the default setting) and the robustness sweeps'."""
    decl, several = _declaration(runs, level)
    if not decl.comparisons or len(decl.settings) < 2:
        return Section(TITLE, "The robustness runs pair no variant with the baseline at both the "
                       "default and another setting: nothing to re-judge.\n")
    table = rob.judge(runs, decl, sweeps=False)
    verdicts = rob.survival(table, decl.plan)
    cells = table[["comparison", "setting", "seeds", "diff", "half_width", "level", "verdict"]]
    files = _write(cells, out, "robustness")
    text = ("Each comparison of the ablation judged again at every setting the robustness runs "
            "cover: one knob changed, every other at its default, the rest of the recipe the "
            f"ablation's. {decl.plan.rule()} A comparison *survives* when every setting resolves "
            "with the default's sign, *reverses* when some setting resolves with the opposite sign, "
            "and is otherwise *undecided* at each setting left open, with the seeds a paired test "
            f"needs to detect a difference of {decl.plan.half_width:g} (80% power, the σ of that "
            "setting's same-seed differences, else the default's)"
            + (f"; {several} run(s) that changed several knobs at once are left out" if several else "")
            + ".\n\n" + _md(verdicts) + "\n" + _md(cells) + "\n")
    return Section(TITLE, text, [], files)
