"""Values computed while Hydra composes: OmegaConf resolvers of the harness.

- `${attnres.tracking_uri:}`: the default of tracking.uri, so that `--cfg job`, every job of a
  multirun and the Optuna sweeper (which reads tracking.uri from the config) see one absolute URI:
  $MLFLOW_TRACKING_URI if set, else sqlite:///<project root>/mlflow.db. MLflow's own default is
  mlflow.db in the *working directory*; anchoring it at the project root means `mlflow ui` run
  there shows every run wherever the command was started from.
- `${arch:key}`: a model shape generated from sweep.arch (a non-embedding parameter budget and the
  paper's two aspect ratios d_model/L_b and heads/L_b, Fig. 7). Used by the arch and scaling
  sweeps, so each grid cell's config shows its real d_model, layers, heads and d_ff.
- `${cell:key}`: sweep.cells[sweep.cell][key], for sweeps that are a union rather than a product
  of values (block sizes plus the baseline).
- `${attnres.now:pattern}`: Hydra's `${now:pattern}`, except under torchrun, where it is the start
  time the ranks agreed on (harness/launch.py): hydra.run.dir uses it, so all ranks of a launch
  share one output folder.
Resolvers are pure functions of the config, so composing a sweep's jobs up front (the multirun
callback validates every job before anything is written) costs milliseconds.
"""
from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnres.io import absolute_sqlite, default_tracking_uri  # one rule for run.py, evaluation and load()

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def arch_shape(arch: Any) -> dict:
    """d_model, layers, n_heads, d_ff of a dense model with ≈ `params` non-embedding parameters.

    A block of width d holds 4d² attention weights (q, k, v, o with n_kv_heads = n_heads) and
    3·d·d_ff SwiGLU weights, so params ≈ L·d²·(4 + 3k) with k = d_ff/d. With d = r·L (r =
    d_model/L_b) that gives L = (params / (r²(4 + 3k)))^(1/3), rounded to a whole number of blocks
    (at least 1). The parameter budget is the hard constraint (paper Fig. 7 holds it fixed), so d is
    then solved from it for that L, d = √(params / (L(4 + 3k))), rather than taken as r·L: with few
    blocks the rounding of L would otherwise miss the budget by up to 2× (the realised ratio
    d_model/L_b is in the logged params). Heads = round(h·L) (at least 1); d_model is rounded to a
    multiple of 2·heads so the head dimension is whole and even (RoPE).
    """
    from harness.config import check_value  # its ranges; imported here: harness.config imports this module

    for key in ("params", "d_model_per_layer", "heads_per_layer", "ffn_ratio", "multiple"):
        check_value(f"sweep.arch.{key}", arch[key])  # a NaN or an infinity would crash round() below
    r, h, k, p = (float(arch.d_model_per_layer), float(arch.heads_per_layer), float(arch.ffn_ratio),
                  float(arch.params))
    if min(r, h, k, p) <= 0:
        raise ValueError(f"sweep.arch values must be positive, got {OmegaConf.to_container(arch)}")
    layers = max(1, round((p / (r * r * (4 + 3 * k))) ** (1 / 3)))
    heads = max(1, round(h * layers))
    step = 2 * heads
    d_model = max(step, step * round((p / (layers * (4 + 3 * k))) ** 0.5 / step))
    multiple = max(1, int(arch.multiple))
    d_ff = max(multiple, multiple * round(k * d_model / multiple))
    name = f"arch_p{p:.3g}_r{r:g}_h{h:g}".replace("+", "")
    return {"d_model": d_model, "layers": layers, "n_heads": heads, "d_ff": d_ff, "name": name}


def _arch(key: str, *, _root_: DictConfig) -> Any:
    arch = OmegaConf.select(_root_, "sweep.arch")
    if arch is None:
        raise ValueError(f"${{arch:{key}}} needs sweep.arch (set by the arch and scaling sweeps)")
    shape = arch_shape(arch)
    if key not in shape:
        raise ValueError(f"${{arch:{key}}}: unknown key; allowed: {', '.join(shape)}")
    return shape[key]


def _cell(key: str, *, _root_: DictConfig) -> Any:
    cell, cells = OmegaConf.select(_root_, "sweep.cell"), OmegaConf.select(_root_, "sweep.cells")
    if cell is None or cells is None or cell not in cells:
        allowed = ", ".join(cells.keys()) if cells else "(none defined)"
        raise ValueError(f"sweep.cell={cell!r} is not a cell of this sweep; allowed: {allowed}")
    if key not in cells[cell]:
        raise ValueError(f"sweep.cells.{cell} does not set {key}")
    return cells[cell][key]


def block_size_for(blocks: Any, *, _root_: DictConfig) -> int:
    """`${blocks:N}`: the block size S that splits the model's L = 2·model.layers sublayers into
    about N blocks, S = max(1, round(L / N)); the last block takes any remainder (paper). The paper
    fixes N ≈ 8 as it scales depth, where a fixed S would let the block count grow with the model."""
    layers, n = OmegaConf.select(_root_, "model.layers"), int(blocks)
    if layers is None or n < 1:
        raise ValueError(f"${{blocks:{blocks}}} needs model.layers and a positive number of blocks")
    return block_size_of(int(layers), n)


def block_size_of(layers: int, blocks: int) -> int:
    """S for about `blocks` blocks over the 2·layers sublayers of `layers` Transformer blocks."""
    return max(1, round(2 * layers / blocks))


def launch_now(pattern: str) -> str:
    agreed = os.environ.get("ATTNRES_LAUNCH_TIME")  # harness.launch.LAUNCH_TIME_ENV
    return (datetime.fromtimestamp(float(agreed)) if agreed else datetime.now()).strftime(pattern)


def register() -> None:
    if not OmegaConf.has_resolver("attnres.now"):
        OmegaConf.register_new_resolver("attnres.now", launch_now, use_cache=True)  # cached as Hydra's now
    for name, fn in (
        ("attnres.tracking_uri", lambda: default_tracking_uri()),
        ("arch", _arch),
        ("cell", _cell),
        ("blocks", block_size_for),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
