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


def norm_input_mean_squares(model, idx: torch.Tensor) -> dict:
    """The smallest mean square (over channels, averaged over tokens) that each family of RMSNorms
    sees in one forward pass of `model` (a DecoderLM) on token ids `idx`: "prenorm" (the sublayers'
    inputs), "residual_norm" (what the residual's own norms normalise: the depth reads' keys, i.e.
    the embedding and every sublayer output, or the hyper-connection streams; None for a residual
    without norms) and "final_norm" (the input of the norm before the head). An epsilon that is not
    small against these numbers changes what the norm computes, not just its edge cases."""
    seen: dict = {"prenorm": [], "residual_norm": [], "final_norm": []}
    keys = getattr(model.residual, "key_norm", False)

    def mean_square(x: torch.Tensor) -> float:
        return float(x.detach().double().pow(2).mean())

    def record(family):
        return lambda module, args: seen[family].append(mean_square(args[0]))

    hooks = [s.norm.register_forward_pre_hook(record("prenorm")) for s in model.sublayers]
    hooks.append(model.norm.register_forward_pre_hook(record("final_norm")))
    if keys:  # the depth reads normalise their sources inside the fused read: record the sources
        hooks += [s.register_forward_hook(lambda m, a, out: seen["residual_norm"].append(mean_square(out)))
                  for s in model.sublayers]
        hooks.append(model.embed.register_forward_hook(
            lambda m, a, out: seen["residual_norm"].append(mean_square(out))))
    else:
        hooks += [m.register_forward_pre_hook(record("residual_norm"))
                  for m in model.residual.modules() if isinstance(m, torch.nn.RMSNorm)]
    try:
        with torch.no_grad():
            model(idx)
    finally:
        for h in hooks:
            h.remove()
    return {family: min(values) if values else None for family, values in seen.items()}
