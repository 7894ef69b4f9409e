"""DenseFormer (Pagliardini et al., 2024): a depth-weighted average after every Transformer block.

    X_i = Block_i(Y_{i-1}),   Y_i = Σ_{j≤i} a_{ij} X_j,   X_0 = Y_0 = embedding

Inside a block the two sublayers use the standard residual. The weights a are learned scalars,
input-independent, with a_ii = 1 and all others 0 at init, so the model starts exactly as the
baseline (the products are exact: 1·x = x, 0·x = 0, x + 0 = x).
"""
from __future__ import annotations

import torch
from torch import nn

from .base import Residual


class DenseFormerResidual(Residual):
    sublayers_per_block = 2  # attention then MLP

    def __init__(self, d_model: int, num_layers: int):
        super().__init__(d_model, num_layers)
        if num_layers % self.sublayers_per_block:
            raise ValueError(f"denseformer needs whole Transformer blocks: num_layers={num_layers} must be even")
        n = num_layers // self.sublayers_per_block
        # Row i-1 averages X_0..X_i after block i; entries above the diagonal are never read.
        self.dwa_weights = nn.Parameter(torch.empty(n, n + 1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """a_ii = 1, all others 0 (starts as the baseline); nn.Module's convention, so that a module
        built on the meta device gets its init back after `to_empty`."""
        n = self.dwa_weights.shape[0]
        with torch.no_grad():
            self.dwa_weights.zero_()
            self.dwa_weights[torch.arange(n), torch.arange(1, n + 1)] = 1.0

    def stream(self, embedding, sublayers, want_weights):
        outputs = [embedding]  # X_0, X_1, ...
        y = embedding
        for l, f in enumerate(sublayers):
            v = f(y)
            self.observe(l, y, v)
            y = y + v
            if (l + 1) % self.sublayers_per_block == 0:
                i = len(outputs)
                outputs.append(y)
                a = self.dwa_weights[i - 1]
                y = a[0] * outputs[0]
                for j in range(1, i + 1):
                    y = y + a[j] * outputs[j]
        return y, None

    def visibility(self):
        raise NotImplementedError("DenseFormer's weights are input-independent scalars: see dwa_weights")

    def mixing_flops_per_token(self) -> int:
        """An add per sublayer (d each); after block i, i + 1 products and i sums of width d:
        Σ_{i=1..n} (2i + 1)·d = n·(n + 2)·d."""
        n = self.num_layers // self.sublayers_per_block
        return self.d_model * (self.num_layers + n * (n + 2))
