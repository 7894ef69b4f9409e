"""The optimizer and the learning-rate schedule of a run.

Parameter groups come from the model (`model.optimizer_groups`). The schedule is a pure function
of the step, so a resumed run needs no scheduler state. Muon (torch.optim.Muon) takes the
sublayers' 2-D weights and AdamW the rest, its update scaled to AdamW's RMS so that one optim.lr
drives both.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from harness.config import DecayShape, OptimConfig, OptimName, ScheduleConfig, ScheduleName


class MultiOptimizer:
    """Two optimizers stepped as one (Muon + AdamW), with one state_dict and one list of groups."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for opt, s in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(s)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig):
    groups = model.optimizer_groups(cfg.weight_decay)
    adam_kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name is OptimName.adamw:
        # torch's default AdamW: the fused one was no faster on CPU and rounds differently.
        opt = torch.optim.AdamW(groups, **adam_kw)
    else:
        # Muon is for hidden matrices only; a fused q/kv or gate/up weight is orthogonalised whole.
        hidden = {id(p) for sub in model.sublayers for p in sub.parameters() if p.dim() == 2}
        muon = [p for g in groups for p in g["params"] if id(p) in hidden]
        rest = [
            {"params": [p for p in g["params"] if id(p) not in hidden], "weight_decay": g["weight_decay"]}
            for g in groups
        ]
        opt = MultiOptimizer(
            torch.optim.Muon(
                [{"params": muon, "weight_decay": cfg.weight_decay}], lr=cfg.lr,
                momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                adjust_lr_fn="match_rms_adamw",
            ),
            torch.optim.AdamW([g for g in rest if g["params"]], **adam_kw),
        )
    for group in opt.param_groups:
        group["base_lr"] = cfg.lr
    return opt


def warmup_steps(cfg: ScheduleConfig, total: int) -> int:
    if cfg.warmup_steps is not None:
        return min(cfg.warmup_steps, total)
    return int(round(cfg.warmup_fraction * total))


def lr_multiplier(cfg: ScheduleConfig, step: int, total: int) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based) of `total`.

    Warmup is linear from 1/warmup to 1 (never 0: a zero-lr first step would waste a batch)."""
    warm = warmup_steps(cfg, total)
    if step < warm:
        return (step + 1) / warm
    if cfg.name is ScheduleName.constant:
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.name is ScheduleName.cosine:
        span = max(1, total - warm - 1)
        progress = min(1.0, (step - warm) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: stable until the decay phase, which ends at `floor` on the last step
    decay = max(1, int(round(cfg.decay_fraction * total)))
    start = max(warm, total - decay)
    if step < start:
        return 1.0
    progress = min(1.0, (step - start + 1) / max(1, total - start))
    if cfg.decay_shape is DecayShape.linear:
        left = 1 - progress
    elif cfg.decay_shape is DecayShape.sqrt:
        left = 1 - math.sqrt(progress)
    else:
        left = 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * left


def set_lr(optimizer, multiplier: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier
    return optimizer.param_groups[0]["lr"]
