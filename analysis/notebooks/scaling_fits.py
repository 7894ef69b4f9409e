# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Fitting scaling curves interactively
#
# Open in Jupyter with the Jupytext extension (`pip install -e ".[notebooks]"`, then open this
# file as a notebook), convert it with `jupytext --to notebook analysis/notebooks/scaling_fits.py`,
# or run it as a script: `python analysis/notebooks/scaling_fits.py`.
# It imports the `analysis` package rather than copying its code, so what you try here is what
# `python -m analysis report` does.
#
# Input: the snapshot named by `ANALYSIS_SNAPSHOT` (default `results/runs.csv`). Without one it
# falls back to the paper's own Table-2 points, so the notebook always runs.

# %%
import os
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

try:
    ROOT = Path(__file__).resolve().parent  # run as a script
except NameError:  # in Jupyter there is no __file__
    ROOT = Path.cwd()
while not (ROOT / "analysis").is_dir() and ROOT != ROOT.parent:
    ROOT = ROOT.parent
sys.path.insert(0, str(ROOT))

from analysis.paper import load_paper  # noqa: E402
from analysis.runs import import_snapshot  # noqa: E402
from analysis.scaling import fit_power_law, fit_shared_exponent, multiplier_at  # noqa: E402

SNAPSHOT = Path(os.environ.get("ANALYSIS_SNAPSHOT", ROOT / "results" / "runs.csv"))
N_BOOT = int(os.environ.get("ANALYSIS_N_BOOT", "1000"))
OUT = os.environ.get("ANALYSIS_NOTEBOOK_OUT")  # the figure's file (e.g. fits.png); unset: not saved

try:  # Jupyter renders tables; run as a script, print them (a bare expression prints nothing)
    from IPython.display import display
    get_ipython  # noqa: B018  (defined only inside IPython/Jupyter)
except (ImportError, NameError):
    def display(obj):
        print(obj.to_string() if hasattr(obj, "to_string") else obj, end="\n\n")

# %% [markdown]
# ## Points: (compute, loss) per variant

# %%
if SNAPSHOT.is_file():
    runs = import_snapshot(SNAPSHOT).finished
    scaling = runs[runs["sweep"].str.startswith("scaling", na=False)]
    points = scaling.rename(columns={"final_val_loss": "loss"})[["variant", "compute_pfd", "loss"]]
    source = f"snapshot {SNAPSHOT.name}"
else:
    points = load_paper().scaling_points()[["variant", "compute_pfd", "loss"]]
    source = "the paper's Table 2 (no snapshot found)"
points = points.dropna()
print(f"{len(points)} points from {source}")
display(points.groupby("variant")["compute_pfd"].agg(["count", "min", "max"]))

# %% [markdown]
# ## Fit L = A·C^-α per variant, with bootstrap intervals
# Change `form` to `"offset"` for L = E + A·C^-α (needs 4+ compute values to mean anything).

# %%
form = "pure"
fits = {}
for v, g in points.groupby("variant"):
    if g["compute_pfd"].nunique() >= 2:
        fits[v] = fit_power_law(g["compute_pfd"], g["loss"], form, n_boot=N_BOOT, seed=0, name=v)
display(pd.DataFrame([{"variant": v, "law": f.law.label(), **{f"{k}_ci": tuple(np.round(c, 4))
                      for k, c in f.ci().items() if k != "E"}} for v, f in fits.items()]))

# %% [markdown]
# ## Compute multiplier over the baseline, at the largest compute, and with a shared exponent

# %%
C_star = float(points["compute_pfd"].max())
rows = []
if "baseline" in fits:
    shared = fit_shared_exponent({v: (points.loc[points.variant == v, "compute_pfd"],
                                      points.loc[points.variant == v, "loss"]) for v in fits},
                                 n_boot=N_BOOT)
    for v in fits:
        if v != "baseline":
            rows.append((v, "separate α", *multiplier_at(fits["baseline"], fits[v], C_star)))
            rows.append((v, "shared α", *multiplier_at(shared["baseline"], shared[v], C_star)))
display(pd.DataFrame(rows, columns=["variant", "fit", "multiplier", "lo", "hi"]))

# %% [markdown]
# ## Plot

# %%
fig, ax = plt.subplots(figsize=(6, 4))
for i, (v, f) in enumerate(fits.items()):
    colour = f"C{i}"  # one colour per variant: its points, its fitted line and its band
    p = points[points.variant == v]
    C = np.geomspace(*f.compute_range, 50)
    lo, hi = f.band(C)
    ax.scatter(p["compute_pfd"], p["loss"], s=12, color=colour)
    ax.plot(C, f.law(C), color=colour, label=f"{v}: {f.law.label()}")
    ax.fill_between(C, lo, hi, color=colour, alpha=0.2, linewidth=0)
ax.set_xscale("log")
ax.set_xlabel("compute (PFLOP/s-days)")
ax.set_ylabel("validation loss")
ax.legend(fontsize=7)
if OUT:
    Path(OUT).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=120, bbox_inches="tight")
