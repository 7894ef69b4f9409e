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

Speed without changing the math (on CPU what costs time here is layout, not arithmetic):
- the state is kept as a list of n streams (…, d), and the stream update
  H'_i = post_i·v + Σ_j res_ij·H_j is one autograd step (`_StreamUpdate`) of n² fused
  multiply-adds of whole streams, with a hand-written backward (n² dot products and n²
  multiply-adds); a batched matmul of one tiny n×n matrix per token, or broadcasting over the
  stream axis, is one to two orders of magnitude slower on CPU;
- RMSNorm(x)·φ = rstd(x)·(x·(g∘φ)): the gain folds into the projection and no normalised copy of
  the n·d-wide state is made (nor kept for backward); rstd comes from the streams' squared norms;
- Sinkhorn-Knopp runs with the n×n matrices token-last, (n, n, tokens), where row and column sums
  are sums of contiguous vectors; its backward is the exact gradient of the same iterations,
  recomputed from the input rather than storing 2·iters intermediate matrices.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import Residual


def _sinkhorn_iterations(m: torch.Tensor, iters: int, keep: bool):
    """Alternate row and column normalisation of m (n, n, ...) in place of a copy; with keep, also
    return each step's input and its sums (what the backward needs)."""
    steps = []
    for _ in range(iters):
        for axis in (1, 0):  # rows (sum over columns j), then columns (sum over rows i)
            total = m.sum(axis, keepdim=True)
            if keep:
                steps.append((m, total, axis))
            m = m / total
    return m, steps


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn-Knopp on (n, n, ...) matrices; backward = the gradient of the unrolled iterations."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int) -> torch.Tensor:
        # The max is subtracted for range only: the result is invariant to a common factor.
        m0 = torch.exp(logits - logits.amax(dim=(0, 1), keepdim=True))
        out, _ = _sinkhorn_iterations(m0, iters, keep=False)
        ctx.save_for_backward(logits)
        ctx.iters = iters
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (logits,) = ctx.saved_tensors
        m0 = torch.exp(logits - logits.amax(dim=(0, 1), keepdim=True))
        out, steps = _sinkhorn_iterations(m0, ctx.iters, keep=True)
        g = grad.contiguous()  # arrives in the caller's (…, n, n) layout: strided here
        y = out
        for m_in, total, axis in reversed(steps):
            # y = m / Σ_axis m  ⇒  dm = (dy − Σ_axis dy·y) / Σ_axis m
            g = (g - (g * y).sum(axis, keepdim=True)) / total
            y = m_in
        return g * m0, None


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Project exp(logits) (..., n, n) towards the doubly stochastic matrices by alternately
    normalising rows and columns (Sinkhorn-Knopp). The max is subtracted first for range only."""
    tokens_last = logits.movedim((-2, -1), (0, 1)).contiguous()
    return _Sinkhorn.apply(tokens_last, iters).movedim((0, 1), (-2, -1))


def pairwise_mean(streams: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean over `dim` summing halves pairwise, so n identical values give back exactly that value
    when n is a power of two (a running sum would round at 3x)."""
    n = streams.shape[dim]
    total = streams
    while total.shape[dim] > 1 and total.shape[dim] % 2 == 0:
        a, b = total.chunk(2, dim=dim)
        total = a + b
    return total.sum(dim) / n


def _weighted_streams(weights: torch.Tensor, streams) -> torch.Tensor:
    """Σ_j weights[..., j] · H_j for weights (..., n) and the n streams H_j (..., d)."""
    out = weights[..., 0, None] * streams[0]
    for j in range(1, len(streams)):
        out = out.addcmul_(weights[..., j, None], streams[j])  # in place: out is no saved input
    return out


class _StreamUpdate(torch.autograd.Function):
    """H'_i = b_i·y + Σ_j A_ij·H_j for n streams H_j (..., d), A (..., n, n), b (..., n), y (..., d)."""

    @staticmethod
    def forward(ctx, A, b, y, *H):
        n = len(H)
        out = []
        for i in range(n):
            o = b[..., i, None] * y
            for j in range(n):
                o.addcmul_(A[..., i, j, None], H[j])
            out.append(o)
        ctx.save_for_backward(A, b, y, *H)
        return tuple(out)

    @staticmethod
    def backward(ctx, *G):
        A, b, y, *H = ctx.saved_tensors
        n = len(H)
        G = [g if g is not None else torch.zeros_like(y) for g in G]
        scratch = torch.empty_like(y)  # one product buffer for all n² + n dot products

        def dot(u, w):
            torch.mul(u, w, out=scratch)
            return scratch.sum(-1)

        dA = torch.stack([torch.stack([dot(G[i], H[j]) for j in range(n)], -1) for i in range(n)], -2)
        db = torch.stack([dot(G[i], y) for i in range(n)], -1)
        dy = b[..., 0, None] * G[0]
        for i in range(1, n):
            dy.addcmul_(b[..., i, None], G[i])
        dH = []
        for j in range(n):
            dh = A[..., 0, j, None] * G[0]
            for i in range(1, n):
                dh.addcmul_(A[..., i, j, None], G[i])
            dH.append(dh)
        return (dA, db, dy, *dH)


def _update_streams(A: torch.Tensor, post: torch.Tensor, v: torch.Tensor, streams) -> list:
    return list(_StreamUpdate.apply(A, post, v, *streams))


def _folded_rms_projection(streams, norm: nn.RMSNorm, weight: torch.Tensor) -> torch.Tensor:
    """norm(cat(streams)) @ weight computed as rstd · Σ_j H_j @ (g ∘ weight)_j: no normalised
    (nor concatenated) copy of the state."""
    n, d = len(streams), streams[0].shape[-1]
    w = (norm.weight.unsqueeze(-1) * weight).view(n, d, -1)
    sq = _sq_norm(streams[0])
    x = streams[0] @ w[0]
    for j in range(1, n):
        sq = sq + _sq_norm(streams[j])
        x = x + streams[j] @ w[j]
    return x * torch.rsqrt(sq / (n * d) + norm.eps)


def _sq_norm(x: torch.Tensor) -> torch.Tensor:
    """Σ x² over the last dim, kept (..., 1): one reduction, no squared copy of x."""
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()


def _as_streams(H):
    return list(H.unbind(-2)) if torch.is_tensor(H) else list(H)


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
        H = [embedding.view_as(embedding) for _ in range(n)]  # n streams, all the embedding at the start
        for l, f in enumerate(sublayers):
            # per-stream RMSNorm then W, the gain folded into W: g (..., n, n+2)
            w = self.norms[l].weight.unsqueeze(-1) * self.dynamic[l]
            g = torch.stack([
                torch.tanh((Hj @ w) * torch.rsqrt(_sq_norm(Hj) / self.d_model + self.norms[l].eps)) for Hj in H
            ], -2)
            pre = self.pre_static[l] + self.scale_pre_res[l] * g[..., 0]
            post = self.post_static[l] + self.scale_post[l] * g[..., 1]
            res = self.res_static[l] + self.scale_pre_res[l] * g[..., 2:]  # (..., n_from, n_to)
            h = _weighted_streams(pre, H)
            v = f(h)
            self.observe(h, v)
            # H'_k = Σ_j res_jk H_j + post_k v
            H = _update_streams(res.transpose(-1, -2), post, v, H)
        return pairwise_mean(torch.stack(H, -2), dim=-2), None

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

    def mixing(self, l: int, H):
        """pre (..., n), post (..., n) and the doubly stochastic res (..., n, n) of sublayer l, for
        streams H (..., n, d) or a list of the n streams (..., d)."""
        n = self.streams
        x = _folded_rms_projection(_as_streams(H), self.norms[l], self.phi[l])  # (..., 2n + n²)
        a_pre, a_post, a_res = self.gates[l]
        b = self.bias[l]
        pre = torch.sigmoid(a_pre * x[..., :n] + b[:n])
        post = 2 * torch.sigmoid(a_post * x[..., n : 2 * n] + b[n : 2 * n])
        res = sinkhorn((a_res * x[..., 2 * n :] + b[2 * n :]).unflatten(-1, (n, n)), self.sinkhorn_iters)
        return pre, post, res

    def stream(self, embedding, sublayers, want_weights):
        # Streams start as copies of the embedding (views: one tensor passed n times to an
        # autograd.Function is something torch.compile cannot trace).
        H = [embedding.view_as(embedding) for _ in range(self.streams)]
        for l, f in enumerate(sublayers):
            pre, post, res = self.mixing(l, H)
            h = _weighted_streams(pre, H)
            v = f(h)
            self.observe(h, v)
            H = _update_streams(res, post, v, H)  # x_{l+1} = H_res x_l + H_postᵀ f
        out = H[0]
        for Hj in H[1:]:
            out = out + Hj
        return out, None

    def visibility(self):
        raise NotImplementedError("mHC has no depth weights over sources")

    def mixing_flops_per_token(self) -> int:
        n, d = self.streams, self.d_model
        per_layer = (3 * n * d + 2 * n * d * (2 * n + n * n) + 4 * self.sinkhorn_iters * n * n
                     + 2 * n * d + 2 * n * n * d + 3 * n * d)
        return self.num_layers * per_layer
