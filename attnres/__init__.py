"""Attention Residuals (Kimi Team, 2026) and every residual variant the paper compares.

The core imports torch only (triton for the fused kernels, when present):

    from attnres import BlockAttentionResidual        # the drop-in module
    from attnres import DecoderLM, ModelConfig, ResidualConfig, VARIANTS
"""
from .config import VARIANTS, ModelConfig, ResidualConfig
from .depth_attention import depth_read
from . import nn  # attnres.nn.TransformerEncoder, the RFC's integration form
from .io import load, save_pretrained
from .model import DecoderLM
from .residuals import (
    AttentionResidual,
    BlockAttentionResidual,
    FullAttentionResidual,
    Residual,
    build_residual,
)

__all__ = [
    "VARIANTS", "ModelConfig", "ResidualConfig", "DecoderLM", "depth_read", "Residual",
    "AttentionResidual", "BlockAttentionResidual", "FullAttentionResidual", "build_residual",
    "load", "save_pretrained", "nn",
]
