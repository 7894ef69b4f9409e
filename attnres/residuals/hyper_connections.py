"""Hyper-Connections (Zhu et al., 2024) and manifold-constrained Hyper-Connections (mHC; Xie et
al., DeepSeek, arXiv 2512.24880): n residual streams, mixed by small matrices around each sublayer.

Both keep streams H ∈ R^{n×d} per token, started as n copies of the embedding. Per sublayer:
    input  h   = Σ_k pre_k · H_k
    update H'_k = Σ_j res_{jk} · H_j + post_k · f(h)
HC (dynamic variant, DHC) uses pre = A_m + s_α·tanh(H̄ W_m), res = A_r + s_α·tanh(H̄ W_r),
post = B + s_β·tanh(H̄ W_β) with H̄ = RMSNorm of each stream, W zero-initialised and the static
part initialised as in the paper (A_m = e_{l mod n}, A_r = I, B = 1), so at init every stream is
the baseline's residual stream. Its output is the mean of the streams, summed pairwise: with
identical streams that is exact, so HC at init equals the baseline bit for bit (the stream sum
differs only by the factor n, which the final RMSNorm removes up to its eps).

mHC conditions every mixing on x̃ = RMSNorm(vec H) (all streams flattened):
pre = σ(α_pre·x̃φ_pre + b_pre), post = 2σ(α_post·x̃φ_post + b_post),
res = Sinkhorn-Knopp(exp(α_res·mat(x̃φ_res) + b_res)) projected onto doubly stochastic matrices.
Its output is the stream sum (PAPER.md). The paper prints no init; we use Megatron-LM's: gating
factors α = 0.01, biases 0, φ ~ N(0, 0.02²). So at init pre ≈ 1/2, post ≈ 1, res ≈ uniform 1/n.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import Residual


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Project exp(logits) (..., n, n) towards the doubly stochastic matrices by alternately
    normalising rows and columns (Sinkhorn-Knopp). The max is subtracted first for range only."""
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def pairwise_mean(streams: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean over `dim` summing halves pairwise, so n identical values give back exactly that value
    when n is a power of two (a running sum would round at 3x)."""
    n = streams.shape[dim]
    total = streams
    while total.shape[dim] > 1 and total.shape[dim] % 2 == 0:
        a, b = total.chunk(2, dim=dim)
        total = a + b
    return total.sum(dim) / n


class HyperConnections(Residual):
    def __init__(self, d_model: int, num_layers: int, streams: int = 4, eps: float = 1e-6):
        super().__init__(d_model, num_layers)
        if streams < 1:
            raise ValueError(f"streams={streams} must be at least 1")
        n, L = streams, num_layers
        self.streams = n
        self.pre_static = nn.Parameter(torch.nn.functional.one_hot(torch.arange(L) % n, n).float())
        self.res_static = nn.Parameter(torch.eye(n).repeat(L, 1, 1))
        self.post_static = nn.Parameter(torch.ones(L, n))
        # Dynamic parts: W zero (the start is the static HC), scales small but non-zero so that W
        # receives gradient from the first step.
        self.norms = nn.ModuleList(nn.RMSNorm(d_model, eps=eps) for _ in range(L))
        self.dynamic = nn.Parameter(torch.zeros(L, d_model, n + 2))  # columns: pre, post, res (n)
        self.scale_pre_res = nn.Parameter(torch.full((L,), 0.01))
        self.scale_post = nn.Parameter(torch.full((L,), 0.01))

    def stream(self, embedding, sublayers, want_weights):
        n = self.streams
        H = embedding.unsqueeze(-2).expand(*embedding.shape[:-1], n, self.d_model)  # (..., n, d)
        for l, f in enumerate(sublayers):
            g = torch.tanh(self.norms[l](H) @ self.dynamic[l])  # (..., n, n+2)
            pre = self.pre_static[l] + self.scale_pre_res[l] * g[..., 0]
            post = self.post_static[l] + self.scale_post[l] * g[..., 1]
            res = self.res_static[l] + self.scale_pre_res[l] * g[..., 2:]  # (..., n_from, n_to)
            h = (pre.unsqueeze(-1) * H).sum(-2)
            v = f(h)
            self.observe(h, v)
            H = res.transpose(-1, -2) @ H + post.unsqueeze(-1) * v.unsqueeze(-2)
        return pairwise_mean(H, dim=-2), None

    def visibility(self):
        raise NotImplementedError("hyper-connections have no depth weights over sources")

    def mixing_flops_per_token(self) -> int:
        n, d = self.streams, self.d_model
        per_layer = 3 * n * d + 2 * n * d * (n + 2) + 2 * n * d + 2 * n * n * d + 3 * n * d
        return self.num_layers * per_layer + n * d


class ManifoldHyperConnections(Residual):
    def __init__(
        self,
        d_model: int,
        num_layers: int,
        streams: int = 4,
        sinkhorn_iters: int = 20,
        gate_init: float = 0.01,
        eps: float = 1e-6,
    ):
        super().__init__(d_model, num_layers)
        if streams < 1 or sinkhorn_iters < 1:
            raise ValueError(f"streams={streams} and sinkhorn_iters={sinkhorn_iters} must be at least 1")
        n, L, d = streams, num_layers, d_model
        self.streams, self.sinkhorn_iters = n, sinkhorn_iters
        self.norms = nn.ModuleList(nn.RMSNorm(n * d, eps=eps) for _ in range(L))
        self.phi = nn.Parameter(torch.randn(L, n * d, 2 * n + n * n) * 0.02)  # pre | post | res
        self.gates = nn.Parameter(torch.full((L, 3), gate_init))  # α_pre, α_post, α_res
        self.bias = nn.Parameter(torch.zeros(L, 2 * n + n * n))

    def mixing(self, l: int, H: torch.Tensor):
        """pre (..., n), post (..., n) and the doubly stochastic res (..., n, n) of sublayer l."""
        n = self.streams
        x = self.norms[l](H.flatten(-2)) @ self.phi[l]  # (..., 2n + n²)
        a_pre, a_post, a_res = self.gates[l]
        b = self.bias[l]
        pre = torch.sigmoid(a_pre * x[..., :n] + b[:n])
        post = 2 * torch.sigmoid(a_post * x[..., n : 2 * n] + b[n : 2 * n])
        res = sinkhorn((a_res * x[..., 2 * n :] + b[2 * n :]).unflatten(-1, (n, n)), self.sinkhorn_iters)
        return pre, post, res

    def stream(self, embedding, sublayers, want_weights):
        n = self.streams
        H = embedding.unsqueeze(-2).expand(*embedding.shape[:-1], n, self.d_model)
        for l, f in enumerate(sublayers):
            pre, post, res = self.mixing(l, H)
            h = (pre.unsqueeze(-1) * H).sum(-2)
            v = f(h)
            self.observe(h, v)
            H = res @ H + post.unsqueeze(-1) * v.unsqueeze(-2)  # x_{l+1} = H_res x_l + H_postᵀ f
        return H.sum(-2), None

    def visibility(self):
        raise NotImplementedError("mHC has no depth weights over sources")

    def mixing_flops_per_token(self) -> int:
        n, d = self.streams, self.d_model
        per_layer = (3 * n * d + 2 * n * d * (2 * n + n * n) + 4 * self.sinkhorn_iters * n * n
                     + 2 * n * d + 2 * n * n * d + 3 * n * d)
        return self.num_layers * per_layer
