"""Attention residuals inside your own `torch.nn.TransformerEncoder`, as a drop-in subclass.

    layer = torch.nn.TransformerEncoderLayer(512, 8, batch_first=True, norm_first=True)
    enc = TransformerEncoder(layer, num_layers=6, residual="block_attention", attn_residual_num_blocks=4)
    out, weights = enc(src, is_causal=True, return_weights=True)  # weights: (2·num_layers + 1, B, T, columns)

`residual="standard"` is torch's own forward; the other forms hand torch's layers to the core's residuals.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .residuals import BlockAttentionResidual, FullAttentionResidual
from .residuals.attention_residual import block_size_for

RESIDUALS = ("standard", "block_attention", "full_attention")


class TransformerEncoder(nn.TransformerEncoder):
    """`torch.nn.TransformerEncoder` with a choice of residual: standard, Block or Full AttnRes.

    attn_residual_num_blocks: N for "block_attention"; it must divide the 2·num_layers sublayers
    (the RFC's form; the decoder LM's `block` variant also allows a remainder).
    attn_residual_eps: epsilon of the key RMSNorms; None takes the layer's norm1 epsilon.
    """

    def __init__(
        self,
        encoder_layer: nn.TransformerEncoderLayer,
        num_layers: int,
        norm: Optional[nn.Module] = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
        residual: str = "standard",
        attn_residual_num_blocks: int = 8,
        attn_residual_eps: Optional[float] = None,
    ) -> None:
        if residual not in RESIDUALS:
            raise ValueError(f"residual={residual!r} is not allowed; allowed: {', '.join(RESIDUALS)}")
        # Depth attention mixes raw sublayer outputs, which PostNorm layers do not produce.
        if residual != "standard" and not getattr(encoder_layer, "norm_first", False):
            raise ValueError(
                f"residual={residual!r} needs PreNorm layers: build the TransformerEncoderLayer with norm_first=True"
            )
        # The dense residual forms cannot use torch's nested-tensor fast path; only padded positions
        # differ (torch's fast path returns zeros there, the dense forms what the layers computed).
        super().__init__(
            encoder_layer, num_layers, norm=norm,
            enable_nested_tensor=enable_nested_tensor and residual == "standard", mask_check=mask_check,
        )
        self.residual = residual
        self.attn_residual: Optional[nn.Module] = None
        if residual == "standard":
            return
        d_model = encoder_layer.self_attn.embed_dim
        sublayers = 2 * num_layers
        eps = attn_residual_eps if attn_residual_eps is not None else encoder_layer.norm1.eps
        if residual == "full_attention":
            self.attn_residual = FullAttentionResidual(d_model, sublayers, eps=eps)
        else:
            block_size_for(attn_residual_num_blocks, sublayers, "attn_residual_num_blocks",  # the error in this door's terms
                           f"the {sublayers} sublayers (2 × num_layers={num_layers})")
            self.attn_residual = BlockAttentionResidual(d_model, sublayers, attn_residual_num_blocks, eps=eps)
        # Match the layers' device and dtype (a layer built with device=/dtype= factory kwargs).
        ref = encoder_layer.linear1.weight
        self.attn_residual.to(device=ref.device, dtype=ref.dtype)

    def forward(
        self,
        src: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        src_key_padding_mask: Optional[torch.Tensor] = None,
        is_causal: Optional[bool] = None,
        return_weights: bool = False,
    ):
        """As torch's forward; `return_weights=True` (attention forms only) also returns the depth
        weights, (2·num_layers + 1 readers, *src.shape[:-1], columns), rows the sublayers
        (attention, feed-forward, …) then the output read."""
        if is_causal and mask is None:  # torch raises here; building the causal mask is what was meant
            seq_len = src.shape[1 if self.layers[0].self_attn.batch_first else 0] if src.dim() == 3 else src.shape[0]
            mask = nn.Transformer.generate_square_subsequent_mask(seq_len, device=src.device, dtype=src.dtype)
        if self.attn_residual is None:
            if return_weights:
                raise ValueError("return_weights=True needs residual='block_attention' or 'full_attention'")
            return super().forward(src, mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        mask = _float_mask(mask, src.dtype)
        src_key_padding_mask = _float_mask(src_key_padding_mask, src.dtype)
        if is_causal is None:
            is_causal = mask is not None and mask.dim() == 2 and _is_causal(mask)
        out = self.attn_residual(
            self, src, return_weights=return_weights,
            mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=bool(is_causal),
        )
        out, weights = out if return_weights else (out, None)
        if self.norm is not None:  # after the output read, as torch applies it after the last layer
            out = self.norm(out)
        return (out, weights) if return_weights else out

    def extra_repr(self) -> str:
        return f"residual={self.residual!r}"


def _float_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Bool masks (True = masked) become additive float masks, as torch's encoder converts them."""
    if mask is None or mask.is_floating_point():
        return mask
    if mask.dtype != torch.bool:
        raise ValueError(f"masks must be bool or floating point, got {mask.dtype}")
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def _is_causal(mask: torch.Tensor) -> bool:
    """Whether a (T, T) additive mask is exactly the causal mask (torch's detection rule)."""
    causal = nn.Transformer.generate_square_subsequent_mask(mask.shape[-1], device=mask.device, dtype=mask.dtype)
    return mask.shape == causal.shape and bool(torch.equal(mask, causal))
