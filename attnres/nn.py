"""The PyTorch RFC's integration form: attention residuals inside your own `nn.TransformerEncoder`.

    from attnres.nn import TransformerEncoder
    layer = torch.nn.TransformerEncoderLayer(512, 8, batch_first=True, norm_first=True)
    enc = TransformerEncoder(layer, num_layers=6, norm=torch.nn.LayerNorm(512),
                             residual="block_attention", attn_residual_num_blocks=4)
    out = enc(src, mask=mask, src_key_padding_mask=padding, is_causal=True)
    out, weights = enc(src, return_weights=True)        # weights: (2·num_layers + 1, B, T, columns)

Design decisions:
- A subclass of `torch.nn.TransformerEncoder`: the layers are built (deep-copied) by torch exactly as
  before, so `state_dict()` keys of the layers, `enc.layers`, `enc.norm` are unchanged, and
  `residual="standard"` *is* torch's forward (fast path, nested tensors and all).
- The other forms hand the layers to the core's `BlockAttentionResidual` / `FullAttentionResidual`
  (`attnres.residuals.base.encoder_sublayers` splits each norm_first layer into its attention and
  feed-forward sublayers, so num_layers encoder layers are 2·num_layers sublayers). There is no
  second implementation of the depth read here. PostNorm layers (norm_first=False) are refused:
  attention over depth mixes raw sublayer outputs, which PostNorm does not produce.
- The encoder's `norm` is applied after the residual's output read, as torch applies it after the
  last layer; with norm_first layers you want one (torch's own advice for PreNorm stacks).
- Masks are converted to float (-inf where masked) as torch's encoder does, so bool and float
  masks mix. `is_causal=True` without a mask builds the causal mask (torch raises instead);
  `is_causal=None` with a mask detects a causal mask as torch does. Depth attention is per
  position, so masked positions stay masked through every read.
- The nested-tensor fast path is torch's; the attention forms disable it (they need dense tensors
  to mix sublayer outputs), which only changes what padded positions hold: torch's fast path
  returns zeros there, the dense forms return whatever the layers computed.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .residuals import BlockAttentionResidual, FullAttentionResidual

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
        if residual != "standard" and not getattr(encoder_layer, "norm_first", False):
            raise ValueError(
                f"residual={residual!r} needs PreNorm layers: build the TransformerEncoderLayer with norm_first=True"
            )
        # The dense residual forms cannot use torch's nested-tensor fast path.
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
            if attn_residual_num_blocks < 1 or sublayers % attn_residual_num_blocks:
                allowed = [n for n in range(1, sublayers + 1) if sublayers % n == 0]
                raise ValueError(
                    f"attn_residual_num_blocks={attn_residual_num_blocks} must divide the {sublayers} sublayers "
                    f"(2 × num_layers={num_layers}); allowed: {', '.join(map(str, allowed))}"
                )
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
        if is_causal and mask is None:
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
        if self.norm is not None:
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
