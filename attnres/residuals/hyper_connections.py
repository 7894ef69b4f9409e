"""Hyper-Connections (Zhu et al., 2024) and manifold-constrained Hyper-Connections (mHC; Xie et
al., 2025): n residual streams per token, H ∈ R^{n×d}, started as n copies of the embedding and
mixed by small per-token matrices around each sublayer:

    h = Σ_k pre_k H_k,        H' = res · H + post ⊗ f(h)

HC (its dynamic variant) conditions pre, post and res on the RMS-normalised streams through tanh,
around a static part (pre = e_{l mod n}, res = I, post = 1) that makes it start exactly as the
baseline; its output is the mean of the streams. mHC conditions them on RMSNorm of all streams
flattened: pre = σ(·), post = 2σ(·), res = Sinkhorn-Knopp(exp(·)), a doubly stochastic matrix; its
output is the stream sum. docs/MATH.md has the equations and our initialisation.

mHC's loop takes its steps from the C kernels for fp32 CPU tensors (kernels/cpu_streams.py: the
update and mix of the streams), the same function as its torch steps, which serve everywhere else.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..config import positive_int
from ..kernels import cpu_streams
from .base import Residual


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """exp(logits) (..., n, n) towards a doubly stochastic matrix: each iteration normalises the
    rows, then the columns (so the columns sum to 1 exactly). The max is subtracted for range only."""
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def pairwise_mean(streams: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean over `dim`, halves summed pairwise: n identical values (n a power of two) give back
    exactly that value, so HC at init equals the baseline bit for bit."""
    n, total = streams.shape[dim], streams
    while total.shape[dim] > 1 and total.shape[dim] % 2 == 0:
        a, b = total.chunk(2, dim=dim)
        total = a + b
    return total.sum(dim) / n


def _copies(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1])


class HyperConnections(Residual):
    def __init__(self, d_model: int, num_layers: int, streams: int = 4, eps: float = 1e-6):
        super().__init__(d_model, num_layers)
        positive_int("streams", streams, "residual streams")
        n, L = streams, num_layers
        self.streams = n
        self.pre_static = nn.Parameter(torch.empty(L, n))
        self.res_static = nn.Parameter(torch.empty(L, n, n))  # (from, to)
        self.post_static = nn.Parameter(torch.empty(L, n))
        self.norms = nn.ModuleList(nn.RMSNorm(d_model, eps=eps) for _ in range(L))
        self.dynamic = nn.Parameter(torch.empty(L, d_model, n + 2))  # columns: pre, post, res (n)
        self.scale_pre_res = nn.Parameter(torch.empty(L))
        self.scale_post = nn.Parameter(torch.empty(L))
        self.reset_parameters()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, streams={self.streams}"

    def reset_parameters(self) -> None:
        """HC's init: pre = e_{l mod n}, res = I, post = 1, dynamic weights zero (the start is the
        static HC, the baseline); scales small but non-zero so that the weights learn from step one."""
        L, n = self.pre_static.shape
        for norm in self.norms:
            norm.reset_parameters()
        with torch.no_grad():
            self.pre_static.copy_(torch.nn.functional.one_hot(torch.arange(L) % n, n))
            self.res_static.copy_(torch.eye(n).expand(L, n, n))
            self.post_static.fill_(1.0)
            self.dynamic.zero_()
            self.scale_pre_res.fill_(0.01)
            self.scale_post.fill_(0.01)

    def stream(self, x, sublayers, want_weights):
        H = _copies(x, self.streams)  # (..., n, d)
        for l, f in enumerate(sublayers):
            g = torch.tanh(self.norms[l](H) @ self.dynamic[l])  # (..., n, n + 2), per stream
            pre = self.pre_static[l] + self.scale_pre_res[l] * g[..., 0]
            post = self.post_static[l] + self.scale_post[l] * g[..., 1]
            res = self.res_static[l] + self.scale_pre_res[l] * g[..., 2:]  # (..., from, to)
            h = (pre.unsqueeze(-1) * H).sum(-2)
            v = f(h)
            self.observe(l, h, v)
            H = res.transpose(-1, -2) @ H + post.unsqueeze(-1) * v.unsqueeze(-2)
        return pairwise_mean(H, dim=-2), None

    def visibility(self):
        raise NotImplementedError("hyper-connections have no depth weights over sources")

    def mixing_flops_per_token(self) -> int:
        n, d = self.streams, self.d_model
        per_layer = 3 * n * d + 2 * n * d * (n + 2) + 2 * n * d + 2 * n * n * d + 3 * n * d
        return self.num_layers * per_layer + n * d


class ManifoldHyperConnections(Residual):
    def __init__(self, d_model: int, num_layers: int, streams: int = 4, sinkhorn_iters: int = 20,
                 gate_init: float = 0.01, eps: float = 1e-6):
        super().__init__(d_model, num_layers)
        positive_int("streams", streams, "residual streams")
        positive_int("sinkhorn_iters", sinkhorn_iters, "Sinkhorn-Knopp iterations")
        n, L, d = streams, num_layers, d_model
        self.streams, self.sinkhorn_iters, self.gate_init = n, sinkhorn_iters, gate_init
        self.norms = nn.ModuleList(nn.RMSNorm(n * d, eps=eps) for _ in range(L))
        self.phi = nn.Parameter(torch.empty(L, n * d, 2 * n + n * n))  # pre | post | res
        self.gates = nn.Parameter(torch.empty(L, 3))  # α_pre, α_post, α_res
        self.bias = nn.Parameter(torch.empty(L, 2 * n + n * n))
        self.reset_parameters()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, streams={self.streams}, sinkhorn_iters={self.sinkhorn_iters}"

    def reset_parameters(self) -> None:
        """Gating factors `gate_init` and biases 0 (Megatron-LM's), φ ~ N(0, 0.02²)."""
        for norm in self.norms:
            norm.reset_parameters()
        with torch.no_grad():
            self.phi.copy_(torch.randn(self.phi.shape, dtype=self.phi.dtype, device=self.phi.device) * 0.02)
            self.gates.fill_(self.gate_init)
            self.bias.zero_()

    def mixing(self, l: int, H: torch.Tensor):
        """pre (..., n), post (..., n) and the doubly stochastic res (..., n, n) (to, from) of sublayer l."""
        n = self.streams
        z = self.norms[l](H.flatten(-2)) @ self.phi[l]  # (..., 2n + n²)
        a_pre, a_post, a_res = self.gates[l]
        b = self.bias[l]
        pre = torch.sigmoid(a_pre * z[..., :n] + b[:n])
        post = 2 * torch.sigmoid(a_post * z[..., n : 2 * n] + b[n : 2 * n])
        res = sinkhorn((a_res * z[..., 2 * n :] + b[2 * n :]).unflatten(-1, (n, n)), self.sinkhorn_iters)
        return pre, post, res

    def stream(self, x, sublayers, want_weights):
        fused = kernels.plan(None, x, self.phi, traceable=False).kernel == "c"
        H = _copies(x, self.streams)
        H, v, post, res = (H.contiguous() if fused else H), None, None, None
        for l, f in enumerate(sublayers):
            if fused:  # the previous sublayer's update and this one's mix, one autograd step
                w = self.norms[l].weight.unsqueeze(-1) * self.phi[l]  # RMSNorm(vec H)·φ = rstd·(vec H @ (g ∘ φ))
                H, h, post, res = cpu_streams.UpdateThenMix.apply(H, v, post, res, w, self.gates[l], self.bias[l],
                                                                  self.sinkhorn_iters, self.norms[l].eps)
            else:
                if l:  # x_{l+1} = H_res x_l + H_postᵀ f(H_pre x_l)
                    H = res @ H + post.unsqueeze(-1) * v.unsqueeze(-2)
                pre, post, res = self.mixing(l, H)
                h = (pre.unsqueeze(-1) * H).sum(-2)
            v = f(h)
            self.observe(l, h, v)
        H = cpu_streams.Update.apply(H, v, post, res) if fused else res @ H + post.unsqueeze(-1) * v.unsqueeze(-2)
        return H.sum(-2), None

    def visibility(self):
        raise NotImplementedError("mHC has no depth weights over sources")

    def mixing_flops_per_token(self) -> int:
        n, d = self.streams, self.d_model
        per_layer = (3 * n * d + 2 * n * d * (2 * n + n * n) + 4 * self.sinkhorn_iters * n * n
                     + 2 * n * d + 2 * n * n * d + 3 * n * d)
        return self.num_layers * per_layer
