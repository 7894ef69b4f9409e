"""The standard PreNorm residual, h_{l+1} = h_l + f_l(h_l): the paper's baseline."""
from __future__ import annotations

from .base import Residual


class StandardResidual(Residual):
    def stream(self, embedding, sublayers, want_weights):
        h = embedding
        for l, f in enumerate(sublayers):
            v = f(h)
            self.observe(l, h, v)
            h = h + v
        return h, None

    def visibility(self):
        raise NotImplementedError("the standard residual has no depth weights")

    def mixing_flops_per_token(self) -> int:
        return self.d_model * self.num_layers
