"""Every residual variant of the paper's ablation, built by name from a ResidualConfig."""
from __future__ import annotations

from ..config import VARIANTS, ResidualConfig
from .attention_residual import AttentionResidual, BlockAttentionResidual, FullAttentionResidual, block_size_for
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
    """S from `num_blocks` (must divide L) when set, else `block_size` (1..L; the last block takes a
    remainder, checked by AttentionResidual)."""
    if cfg.num_blocks is None:
        return cfg.block_size
    return block_size_for(cfg.num_blocks, num_layers, "residual.num_blocks",
                          f"the number of sublayers L={num_layers} (2 × model.layers)")


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
            knobs["heads"] = cfg.heads
        try:
            return AttentionResidual(d_model, num_layers, eps=eps, **knobs)
        except ValueError as e:  # the constructor names the knob; a config names it residual.<knob>
            raise ValueError(f"residual.{e}") from None
    raise ValueError(f"residual.name={name!r} is not a known variant; allowed: {', '.join(VARIANTS)}")


__all__ = [
    "VARIANTS", "Residual", "AttentionResidual", "BlockAttentionResidual", "FullAttentionResidual",
    "StandardResidual", "DenseFormerResidual", "HyperConnections", "ManifoldHyperConnections",
    "build_residual", "resolve_block_size", "sinkhorn",
]
