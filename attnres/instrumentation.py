"""What the analysis of training dynamics needs (paper Figs. 5 and 8), recorded only on request.

A residual module holds `recorder = None` by default; each sublayer then costs one `is None`
check. `DecoderLM.inspect()` attaches a `DepthRecorder` for one forward pass under no_grad.
"""
from __future__ import annotations

from typing import Optional

import torch


def rms(x: torch.Tensor) -> float:
    """Root mean square over every element, in float64 so that long streams do not round away."""
    return float(x.detach().double().pow(2).mean().sqrt())


class DepthRecorder:
    """Per-sublayer magnitudes of one forward pass, and the depth weights when the variant has them.

    hidden_rms[l]: RMS of h_l, the input of sublayer l (the residual stream it sees).
    output_rms[l]: RMS of f_l(h_l), what sublayer l writes.
    weights: (readers, columns) depth weights averaged over batch and tokens, NaN where a source
    is not visible (rows: the L sublayers then the output read).
    entropy: (readers,) each reader's per-token entropy of its weights in nats, averaged over batch
    and tokens (the entropy of the averaged weights would call a reader that is sharp on every token
    but picks different sources per token "uniform").
    """

    def __init__(self) -> None:
        self.hidden_rms: list[float] = []
        self.output_rms: list[float] = []
        self.weights: Optional[torch.Tensor] = None
        self.entropy: Optional[torch.Tensor] = None

    def sublayer(self, h: torch.Tensor, v: torch.Tensor) -> None:
        self.hidden_rms.append(rms(h))
        self.output_rms.append(rms(v))

    def depth_weights(self, weights: torch.Tensor, visible: torch.Tensor) -> None:
        """weights (readers, ..., columns) with zeros where invisible; visible (readers, columns) bool."""
        w = weights.detach().double().flatten(1, -2)  # (readers, tokens, columns)
        self.weights = w.mean(1).masked_fill(~visible, float("nan"))
        self.entropy = -torch.special.xlogy(w, w).sum(-1).mean(1)
