"""Training curves: validation loss against tokens, one line per run."""
from __future__ import annotations

from pathlib import Path

from .. import figures
from .section import Section, _img


def curves_section(runset, out: Path) -> Section:
    files = figures.training_curves(runset.histories, runset.runs, out / "figures")
    if runset.histories.empty:
        return Section("Training curves", "No metric histories in the input.\n\n", [], files)
    return Section("Training curves", "Validation loss against tokens seen, one line per run "
                   "(dashed: not finished).\n\n" + _img(files, out, "training curves"), [], files)
