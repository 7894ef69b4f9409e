"""Analysis of Attention Residuals runs: MLflow runs → scaling-law fits with bootstrap intervals,
the ablation table, every figure of the paper beside ours, and REPORT.md.

Reads only what ``docs/RUN_SCHEMA.md`` promises and never imports training code (``attnres``,
``harness``), so it runs on a laptop holding nothing but a snapshot CSV.

Entry point: ``python -m analysis report ...`` / ``python -m analysis export ...``
(see ``docs/ANALYSIS.md``).
"""
from .runs import (AnalysisInputError, RunSet, export_snapshot, import_snapshot, load_runs,
                   load_runset)
from .scaling import PFLOPS_DAY, PowerLaw, compute_multiplier, fit_power_law, fit_shared_exponent

__all__ = ["AnalysisInputError", "RunSet", "export_snapshot", "import_snapshot", "load_runs",
           "load_runset", "PFLOPS_DAY", "PowerLaw", "compute_multiplier", "fit_power_law",
           "fit_shared_exponent"]
