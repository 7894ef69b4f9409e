"""Attention Residuals (Kimi Team, 2026) and every residual variant the paper compares.

The core needs torch only (triton for the fused kernels, when present; safetensors and mlflow
are imported by `save_pretrained` / `load` when they are called):

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
