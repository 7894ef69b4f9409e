"""Every residual variant of the paper's ablation, built by name from a ResidualConfig."""
from __future__ import annotations

from ..config import VARIANTS, ResidualConfig
from .attention_residual import AttentionResidual, BlockAttentionResidual, FullAttentionResidual
from .base import Residual
from .denseformer import DenseFormerResidual
from .hyper_connections import HyperConnections, ManifoldHyperConnections, sinkhorn
from .standard import StandardResidual

# The AttnRes rows of Table 4 as settings of AttentionResidual's knobs.
_ATTNRES_KNOBS: dict[str, dict] = {
    "full": dict(sources="full"),
    "full_input_query": dict(sources="full", query="input"),
    "full_scalar": dict(sources="full", query="scalar"),
    "full_sigmoid": dict(sources="full", normaliser="sigmoid"),
    "full_no_rmsnorm": dict(sources="full", key_norm=False),
    "sliding_window": dict(sources="window"),
    "block": dict(sources="block"),
    "block_multihead": dict(sources="block"),
    "block_no_rmsnorm": dict(sources="block", key_norm=False),
}


def resolve_block_size(cfg: ResidualConfig, num_layers: int) -> int:
    """S from `num_blocks` (must divide L) or `block_size` (1..L; the last block takes a remainder)."""
    if cfg.num_blocks is not None:
        if cfg.num_blocks < 1 or num_layers % cfg.num_blocks:
            raise ValueError(
                f"residual.num_blocks={cfg.num_blocks} must divide the number of sublayers "
                f"L={num_layers} (2 × model.layers); allowed: "
                + ", ".join(str(n) for n in range(1, num_layers + 1) if num_layers % n == 0)
            )
        return num_layers // cfg.num_blocks
    if not 1 <= cfg.block_size <= num_layers:
        raise ValueError(
            f"residual.block_size={cfg.block_size} must be between 1 and the number of sublayers "
            f"L={num_layers} (2 × model.layers)"
        )
    return cfg.block_size


def build_residual(cfg: ResidualConfig, d_model: int, num_layers: int, eps: float = 1e-6) -> Residual:
    """The residual module for variant `cfg.name` over `num_layers` sublayers."""
    name = cfg.name
    if name == "baseline":
        return StandardResidual(d_model, num_layers)
    if name == "denseformer":
        return DenseFormerResidual(d_model, num_layers)
    if name == "hc":
        return HyperConnections(d_model, num_layers, streams=cfg.streams, eps=eps)
    if name == "mhc":
        return ManifoldHyperConnections(
            d_model, num_layers, streams=cfg.streams, sinkhorn_iters=cfg.sinkhorn_iters,
            gate_init=cfg.gate_init, eps=eps,
        )
    if name in _ATTNRES_KNOBS:
        knobs = dict(_ATTNRES_KNOBS[name])
        if knobs["sources"] == "block":
            knobs["block_size"] = resolve_block_size(cfg, num_layers)
        if knobs["sources"] == "window":
            knobs["window"] = cfg.window
        if name == "block_multihead":
            if cfg.heads < 1 or d_model % cfg.heads:
                raise ValueError(
                    f"residual.heads={cfg.heads} must divide model.d_model={d_model}; allowed: "
                    + ", ".join(str(h) for h in range(1, d_model + 1) if d_model % h == 0 and h <= 64)
                )
            knobs["heads"] = cfg.heads
        return AttentionResidual(d_model, num_layers, eps=eps, **knobs)
    raise ValueError(f"residual.name={name!r} is not a known variant; allowed: {', '.join(VARIANTS)}")


__all__ = [
    "VARIANTS", "Residual", "AttentionResidual", "BlockAttentionResidual", "FullAttentionResidual",
    "StandardResidual", "DenseFormerResidual", "HyperConnections", "ManifoldHyperConnections",
    "build_residual", "resolve_block_size", "sinkhorn",
]
