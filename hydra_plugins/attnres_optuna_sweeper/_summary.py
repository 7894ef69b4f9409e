"""The end-of-sweep summary: one row per grid cell, printed and written to the sweep folder
(``optuna_summary.md`` and ``optuna_summary.json``). Rows come from the storage, not from what this
process ran, so a resumed sweep's or one worker's summary describes the whole study.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from ._ledger import Ledger


@dataclass
class CellSummary:
    study: str
    n_trials: int
    complete: int
    pruned: int
    failed: int
    void: int
    running: int
    best_value: float | None = None
    best_trial: int | None = None
    best_params: dict[str, Any] = field(default_factory=dict)
    mlflow_parent_run_id: str | None = None

    @property
    def done(self) -> int:
        return self.complete + self.pruned + self.failed


def summarize(study: optuna.Study, n_trials: int, parent_run_id: str | None) -> CellSummary:
    trials = study.get_trials(deepcopy=False)
    ledger = Ledger.of(trials)
    row = CellSummary(
        study=study.study_name,
        n_trials=n_trials,
        complete=ledger.complete,
        pruned=ledger.pruned,
        failed=ledger.failed,
        void=ledger.void,
        running=ledger.running,
        mlflow_parent_run_id=parent_run_id,
    )
    if any(t.state == TrialState.COMPLETE for t in trials):
        best = study.best_trial
        row.best_value, row.best_trial, row.best_params = best.value, best.number, best.params
    return row


def render(rows: list[CellSummary], direction: str) -> str:
    header = [
        "study",
        "done/n",
        "complete",
        "pruned",
        "failed",
        f"best ({direction})",
        "best params",
    ]
    table = [header]
    for r in rows:
        extra = []
        if r.void:
            extra.append(f"{r.void} void")
        if r.running:
            extra.append(f"{r.running} running")
        done = f"{r.done}/{r.n_trials}" + (f" ({', '.join(extra)})" if extra else "")
        best = "-" if r.best_value is None else _number(r.best_value)
        params = ", ".join(f"{k}={_number(v)}" for k, v in r.best_params.items()) or "-"
        table.append([r.study, done, str(r.complete), str(r.pruned), str(r.failed), best, params])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in table
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write(rows: list[CellSummary], direction: str, folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    text, data = folder / "optuna_summary.md", folder / "optuna_summary.json"
    text.write_text(render(rows, direction) + "\n")
    payload = {"direction": direction, "cells": [asdict(r) for r in rows]}
    data.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return text, data


def _number(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.6g}"
    return str(value)
