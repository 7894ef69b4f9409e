"""The interface every residual variant implements: it owns the residual stream.

    out = residual(embedding, sublayers)            # sublayers: a list of h -> f(h)
    out, weights = residual(embedding, sublayers, return_weights=True)
    out = residual(encoder, src, mask=..., is_causal=...)   # an nn.TransformerEncoder

The model hands over the embedding and the flat list of sublayers (attention, MLP, attention, …);
the residual decides what each sublayer reads and returns the hidden state that goes to the final
norm. Extra keyword arguments reach every sublayer call (masks for an encoder's attention).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..instrumentation import DepthRecorder

SublayerFn = Callable[..., torch.Tensor]


def encoder_sublayers(encoder: nn.TransformerEncoder, **kwargs) -> list[SublayerFn]:
    """Split each layer of a norm_first `nn.TransformerEncoder` into its two PreNorm sublayers.

    The self-attention sublayer is norm1 then the layer's attention block, the feed-forward one
    norm2 then its FFN block, exactly as torch's own norm_first forward computes them. Masks and
    `is_causal` given as keyword arguments (`mask` or `src_mask`, `src_key_padding_mask`,
    `is_causal`) reach the attention. The encoder's final `norm`, if any, is not applied: the
    caller owns what follows the stream, as the model owns its final RMSNorm.
    """
    mask = kwargs.pop("mask", kwargs.pop("src_mask", None))
    padding = kwargs.pop("src_key_padding_mask", None)
    is_causal = bool(kwargs.pop("is_causal", False))
    if kwargs:
        raise ValueError(f"unknown keyword arguments for an encoder: {sorted(kwargs)}; allowed: mask, src_key_padding_mask, is_causal")
    fns: list[SublayerFn] = []
    for i, layer in enumerate(encoder.layers):
        if not getattr(layer, "norm_first", False):
            raise ValueError(f"encoder.layers[{i}] has norm_first=False; attention residuals need PreNorm layers (norm_first=True)")
        fns.append(lambda h, layer=layer: layer._sa_block(layer.norm1(h), mask, padding, is_causal=is_causal))
        fns.append(lambda h, layer=layer: layer._ff_block(layer.norm2(h)))
    return fns


def check_positive_int(name: str, value, meaning: str) -> None:
    """One line for a size that is not a positive integer (0 built an empty module, a float or a
    negative number failed later in torch.zeros)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer ({meaning})")


class Residual(nn.Module):
    """Base class: argument handling, the encoder form, and the instrumentation hook."""

    has_depth_weights = False  # True for variants whose reads are attention over depth

    def __init__(self, d_model: int, num_layers: int):
        super().__init__()
        check_positive_int("d_model", d_model, "the width of the embedding and of every sublayer's output")
        check_positive_int("num_layers", num_layers, "it counts sublayers")
        self.d_model, self.num_layers = d_model, num_layers
        self.recorder: Optional[DepthRecorder] = None

    def forward(self, embedding, sublayers, return_weights: bool = False, **kwargs):
        if isinstance(embedding, nn.TransformerEncoder):
            embedding, sublayers = sublayers, encoder_sublayers(embedding, **kwargs)
        elif kwargs:
            sublayers = [functools.partial(f, **kwargs) for f in sublayers]
        if len(sublayers) != self.num_layers:
            raise ValueError(f"got {len(sublayers)} sublayers for a residual built for num_layers={self.num_layers}")
        if embedding.shape[-1] != self.d_model:
            raise ValueError(f"embedding has width {embedding.shape[-1]}, the residual was built for d_model={self.d_model}")
        want_weights = return_weights or (self.recorder is not None and self.has_depth_weights)
        out, weights = self.stream(embedding, list(sublayers), want_weights)
        if self.recorder is not None and weights is not None:
            self.recorder.depth_weights(weights, self.visibility())
        return (out, weights) if return_weights else out

    def stream(self, embedding: torch.Tensor, sublayers: Sequence[SublayerFn], want_weights: bool):
        """Run the sublayers; return (hidden state for the final norm, weights or None)."""
        raise NotImplementedError

    def visibility(self) -> torch.Tensor:
        """(readers, columns) bool mask of the sources each read may see."""
        raise NotImplementedError

    def observe(self, h: torch.Tensor, v: torch.Tensor) -> None:
        if self.recorder is not None:
            self.recorder.sublayer(h, v)

    def mixing_flops_per_token(self) -> int:
        """Forward FLOPs per token spent combining sublayer outputs (not in the sublayers)."""
        raise NotImplementedError
