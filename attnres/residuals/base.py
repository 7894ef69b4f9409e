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

from ..config import positive_int
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


class Residual(nn.Module):
    """Base class: argument handling, the encoder form, and the instrumentation hook."""

    has_depth_weights = False  # True for variants whose reads are attention over depth

    def __init__(self, d_model: int, num_layers: int):
        super().__init__()
        positive_int("d_model", d_model, "the width of the embedding and of every sublayer's output")
        positive_int("num_layers", num_layers, "it counts sublayers")
        self.d_model, self.num_layers = d_model, num_layers
        self.recorder: Optional[DepthRecorder] = None

    def extra_repr(self) -> str:
        # print(model) shows which residual a model runs, with the knobs that make the variant
        return f"d_model={self.d_model}, num_layers={self.num_layers}"

    def forward(self, embedding, sublayers, return_weights: bool = False, **kwargs):
        """Run `sublayers` over the residual stream that starts at `embedding`.

        embedding: a floating-point tensor (..., d_model) on this module's device. sublayers:
        num_layers callables h -> f(h) in order (a list or nn.ModuleList; attention and MLP count
        apart), each applying its own PreNorm, returning a tensor of h's shape and never adding h
        back. Keyword arguments (masks) reach every sublayer. Or `residual(encoder, src, mask=…,
        src_key_padding_mask=…, is_causal=…)` for an nn.TransformerEncoder of norm_first layers.
        Returns the hidden state (..., d_model) for your final norm and, with return_weights=True
        for attention residuals, the depth weights (num_layers + 1 readers, ..., columns): the
        sublayers then the output read, zeros where a source is not visible (`visibility()`)."""
        embedding, sublayers = self.arguments(embedding, sublayers, kwargs)
        want_weights = return_weights or (self.recorder is not None and self.has_depth_weights)
        out, weights = self.stream(embedding, sublayers, want_weights)
        if self.recorder is not None and weights is not None:
            self.recorder.depth_weights(weights, self.visibility())
        return (out, weights) if return_weights else out

    def arguments(self, embedding, sublayers, kwargs):
        """The two call forms as (embedding, checked sublayers), or one ValueError naming what is wrong."""
        if isinstance(embedding, nn.TransformerEncoder):
            embedding, sublayers = sublayers, encoder_sublayers(embedding, **kwargs)
        else:
            if isinstance(sublayers, nn.TransformerEncoder):
                raise ValueError("got the encoder second: call residual(encoder, src) for an nn.TransformerEncoder, "
                                 "residual(embedding, sublayers) for a list of sublayers")
            if torch.is_tensor(sublayers) or not hasattr(sublayers, "__iter__"):
                raise ValueError(f"sublayers must be a list or nn.ModuleList of callables h -> f(h), got a "
                                 f"{type(sublayers).__name__}; call residual(embedding, sublayers)")
            sublayers = [functools.partial(f, **kwargs) for f in sublayers] if kwargs else list(sublayers)
        if not torch.is_tensor(embedding) or not embedding.is_floating_point() or embedding.dim() == 0:
            got = f"{embedding.dtype} tensor of shape {tuple(embedding.shape)}" if torch.is_tensor(embedding) else type(embedding).__name__
            hint = " (token ids go through your embedding layer first)" if torch.is_tensor(embedding) and not embedding.is_floating_point() else ""
            raise ValueError(f"embedding must be a floating-point tensor (..., d_model={self.d_model}), got a {got}{hint}")
        if len(sublayers) != self.num_layers:
            raise ValueError(f"got {len(sublayers)} sublayers for a residual built for num_layers={self.num_layers}; allowed: "
                             f"exactly {self.num_layers} (attention and MLP count apart: an encoder layer is two)")
        if embedding.shape[-1] != self.d_model:
            raise ValueError(f"embedding has width {embedding.shape[-1]}, the residual was built for d_model={self.d_model}")
        param = next(self.parameters(), None)
        if param is not None and param.device != embedding.device:
            raise ValueError(f"embedding is on {embedding.device} but the residual's parameters are on {param.device}; "
                             f"move the residual with .to({str(embedding.device)!r}) (from the meta device: .to_empty(device=…) "
                             "then reset_parameters()), or the embedding to its device")
        return embedding, sublayers

    def stream(self, embedding: torch.Tensor, sublayers: Sequence[SublayerFn], want_weights: bool):
        """Run the sublayers; return (hidden state for the final norm, weights or None)."""
        raise NotImplementedError

    def visibility(self) -> torch.Tensor:
        """(readers, columns) bool mask of the sources each read may see."""
        raise NotImplementedError

    def observe(self, l: int, h: torch.Tensor, v: torch.Tensor) -> None:
        """After sublayer l: one line naming it when it did not return a tensor of its input's shape
        (a wrong width or a tuple would fail deep in the next read), and the recorder's entry."""
        if not torch.is_tensor(v) or v.shape != h.shape:
            got = f"shape {tuple(v.shape)}" if torch.is_tensor(v) else f"a {type(v).__name__}"
            raise ValueError(f"sublayers[{l}] returned {got} for an input of shape {tuple(h.shape)}; "
                             "each sublayer must return a tensor of its input's shape")
        if self.recorder is not None:
            self.recorder.sublayer(h, v)

    def mixing_flops_per_token(self) -> int:
        """Forward FLOPs per token spent combining sublayer outputs (not in the sublayers)."""
        raise NotImplementedError
