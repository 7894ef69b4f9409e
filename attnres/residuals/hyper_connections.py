"""Hyper-Connections (Zhu et al., 2024) and manifold-constrained Hyper-Connections (mHC; Xie et
al., DeepSeek, arXiv 2512.24880): n residual streams, mixed by small matrices around each sublayer.

Both keep streams H ∈ R^{n×d} per token, started as n copies of the embedding. Per sublayer:
    input  h   = Σ_k pre_k · H_k
    update H'_k = Σ_j res_{jk} · H_j + post_k · f(h)   (HC: res indexed (from, to))
           H'_k = Σ_j res_{kj} · H_j + post_k · f(h)   (mHC: H_res·x_l, res indexed (to, from))
HC (dynamic variant, DHC) uses pre = A_m + s_α·tanh(H̄ W_m), res = A_r + s_α·tanh(H̄ W_r),
post = B + s_β·tanh(H̄ W_β) with H̄ = RMSNorm of each stream, W zero-initialised and the static
part initialised as in the paper (A_m = e_{l mod n}, A_r = I, B = 1), so at init every stream is
the baseline's residual stream. Its output is the mean of the streams, summed pairwise: with
identical streams that is exact, so HC at init equals the baseline bit for bit (the stream sum
differs only by the factor n, which the final RMSNorm removes up to its eps).

mHC conditions every mixing on x̃ = RMSNorm(vec H) (all streams flattened):
pre = σ(α_pre·x̃φ_pre + b_pre), post = 2σ(α_post·x̃φ_post + b_post),
res = Sinkhorn-Knopp(exp(α_res·mat(x̃φ_res) + b_res)) projected onto doubly stochastic matrices.
Its output is the stream sum (PAPER.md). The paper prints no init; we use Megatron-LM's gating
factors α = 0.01 and biases 0, and φ ~ N(0, 0.02²) (Megatron-LM draws φ with xavier_uniform_).
So at init pre ≈ 1/2, post ≈ 1, res ≈ uniform 1/n. Sinkhorn normalises rows, then columns, in
each of its iterations (Megatron-LM's order), so the columns of res sum to 1 exactly.

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

Two paths, one math. For fp32 CPU tensors mHC runs on the C kernels of
attnres/kernels/csrc/streams.c (the "C path"), whenever they build and the kernel backend is
"auto" or "cpu" (`attnres.kernels.set_backend`, ATTNRES_KERNEL); everything else (float64, CUDA,
CPU autocast, torch.compile tracing, backend "torch", no C compiler) takes the PyTorch path
above, which is also the reference the C path is tested against. Why a second path: on CPU the
PyTorch path is dominated by the dispatch of ~200 tiny tensor ops per sublayer, not by
arithmetic. The C path keeps the state as one (..., n, d) tensor and runs each sublayer as one
autograd step (`_UpdateThenMix`): the update of the previous sublayer (H' = post·v + res·H) and
the mix of this one (the projection, as one matmul of vec H, then rstd, gates, Sinkhorn and the
pre-mix h, per token in C). So H' has a single consumer and its gradient is written once, by
one kernel, instead of being summed over autograd branches.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .. import kernels
from ..kernels import cpu_streams
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


class _SinkhornNative(torch.autograd.Function):
    """Sinkhorn-Knopp on (..., n, n) fp32 CPU logits by the C kernels (same iterations, same
    gradient as `_Sinkhorn`)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.iters = iters
        return cpu_streams.sinkhorn_forward(logits, iters)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (logits,) = ctx.saved_tensors
        return cpu_streams.sinkhorn_backward(logits, grad.contiguous(), ctx.iters), None


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Project exp(logits) (..., n, n) towards the doubly stochastic matrices by alternately
    normalising rows and columns (Sinkhorn-Knopp). The max is subtracted first for range only."""
    if native_streams(logits):
        return _SinkhornNative.apply(logits.contiguous(), iters)
    tokens_last = logits.movedim((-2, -1), (0, 1)).contiguous()
    return _Sinkhorn.apply(tokens_last, iters).movedim((0, 1), (-2, -1))


def native_streams(*tensors: torch.Tensor) -> bool:
    """Whether mHC runs on the C kernels for these tensors (`kernels.c_kernels_chosen`: fp32 CPU
    tensors, backend "auto" or "cpu", eager mode: the C path is no traceable operator)."""
    return kernels.c_kernels_chosen(tensors, cpu_streams.available, cpu_streams.why_unavailable, traceable=False)


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


# ---- the C path: the state as one (..., n, d) tensor, one autograd step per sublayer ----------


def _mix_native(ctx, H, w, gates, bias):
    """Forward of the mix on the C kernels: h, post, res of streams H; saves what its backward
    needs on ctx (proj and rstd: 2n + n² + 1 floats per token; the rest is recomputed)."""
    n, d = H.shape[-2], H.shape[-1]
    proj = torch.mm(H.view(H.numel() // (n * d), n * d), w)
    rstd, h, _, post, res = cpu_streams.mix_forward(H, proj, gates, bias, ctx.iters, ctx.eps)
    return proj, rstd, h, post, res


def _mix_native_backward(ctx, H, proj, rstd, w, gates, bias, dh, dpost, dres, gH):
    """The gradient reaching H (gH, what it receives elsewhere, included) and those of w, the
    gates and the bias."""
    n, d = H.shape[-2], H.shape[-1]
    G, dproj, dgates, dbias = cpu_streams.mix_backward(
        H, proj, rstd, gates, bias, _dense(dh), _dense(dpost), _dense(dres), _dense(gH), ctx.iters)
    flat = G.view(dproj.shape[0], n * d)
    torch.addmm(flat, dproj, w.t(), out=flat)  # in place; addmm_ would be invisible to FlopCounterMode
    # dprojᵀ @ H, transposed back (a view): this orientation is the faster matmul here
    dw = dproj.t().mm(H.view(dproj.shape[0], n * d)).t() if ctx.needs_w else None
    return G, dw, dgates, dbias


def _dense(t):
    return None if t is None else t.contiguous()


class _StreamMix(torch.autograd.Function):
    """The first sublayer's mix: (h, post, res) of the streams H (..., n, d), w = g ∘ φ (n·d, m)."""

    @staticmethod
    def forward(ctx, H, w, gates, bias, iters: int, eps: float):
        ctx.set_materialize_grads(False)
        ctx.iters, ctx.eps, ctx.needs_w = iters, eps, ctx.needs_input_grad[1]
        proj, rstd, h, post, res = _mix_native(ctx, H, w, gates, bias)
        ctx.save_for_backward(H, proj, rstd, w, gates, bias)
        return h, post, res

    @staticmethod
    @once_differentiable
    def backward(ctx, dh, dpost, dres):
        H, proj, rstd, w, gates, bias = ctx.saved_tensors
        return (*_mix_native_backward(ctx, H, proj, rstd, w, gates, bias, dh, dpost, dres, None), None, None)


class _UpdateThenMix(torch.autograd.Function):
    """H = post·v + res·Hp (the previous sublayer's update), then this sublayer's mix of H:
    returns (H, h, post', res')."""

    @staticmethod
    def forward(ctx, Hp, v, post, res, w, gates, bias, iters: int, eps: float):
        ctx.set_materialize_grads(False)
        ctx.iters, ctx.eps, ctx.needs_w = iters, eps, ctx.needs_input_grad[4]
        v = v.contiguous()
        H = cpu_streams.update_forward(Hp, v, post, res)
        proj, rstd, h, post_next, res_next = _mix_native(ctx, H, w, gates, bias)
        ctx.save_for_backward(Hp, v, post, res, H, proj, rstd, w, gates, bias)
        return H, h, post_next, res_next

    @staticmethod
    @once_differentiable
    def backward(ctx, dH, dh, dpost_next, dres_next):
        Hp, v, post, res, H, proj, rstd, w, gates, bias = ctx.saved_tensors
        G, dw, dgates, dbias = _mix_native_backward(ctx, H, proj, rstd, w, gates, bias, dh, dpost_next, dres_next, dH)
        dHp, dv, dpost, dres = cpu_streams.update_backward(G, Hp, v, post, res)
        return dHp, dv, dpost, dres, dw, dgates, dbias, None, None


class _Update(torch.autograd.Function):
    """The last sublayer's update alone: H = post·v + res·Hp."""

    @staticmethod
    def forward(ctx, Hp, v, post, res):
        ctx.set_materialize_grads(False)
        v = v.contiguous()
        ctx.save_for_backward(Hp, v, post, res)
        return cpu_streams.update_forward(Hp, v, post, res)

    @staticmethod
    @once_differentiable
    def backward(ctx, dH):
        Hp, v, post, res = ctx.saved_tensors
        if dH is None:
            return None, None, None, None
        return cpu_streams.update_backward(dH.contiguous(), Hp, v, post, res)


class HyperConnections(Residual):
    def __init__(self, d_model: int, num_layers: int, streams: int = 4, eps: float = 1e-6):
        super().__init__(d_model, num_layers)
        if streams < 1:
            raise ValueError(f"streams={streams} must be at least 1")
        n, L = streams, num_layers
        self.streams = n
        self.pre_static = nn.Parameter(torch.empty(L, n))
        self.res_static = nn.Parameter(torch.empty(L, n, n))
        self.post_static = nn.Parameter(torch.empty(L, n))
        self.norms = nn.ModuleList(nn.RMSNorm(d_model, eps=eps) for _ in range(L))
        self.dynamic = nn.Parameter(torch.empty(L, d_model, n + 2))  # columns: pre, post, res (n)
        self.scale_pre_res = nn.Parameter(torch.empty(L))
        self.scale_post = nn.Parameter(torch.empty(L))
        self.reset_parameters()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, streams={self.streams}"

    def reset_parameters(self) -> None:
        """The paper's init: A_m = e_{l mod n}, A_r = I, B = 1; dynamic parts W zero (the start is
        the static HC), scales small but non-zero so that W receives gradient from the first step.
        nn.Module's convention, so that a module built on the meta device gets it back after
        `to_empty`."""
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
        self.gate_init = gate_init
        self.norms = nn.ModuleList(nn.RMSNorm(n * d, eps=eps) for _ in range(L))
        self.phi = nn.Parameter(torch.empty(L, n * d, 2 * n + n * n))  # pre | post | res
        self.gates = nn.Parameter(torch.empty(L, 3))  # α_pre, α_post, α_res
        self.bias = nn.Parameter(torch.empty(L, 2 * n + n * n))
        self.reset_parameters()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, streams={self.streams}, sinkhorn_iters={self.sinkhorn_iters}"

    def reset_parameters(self) -> None:
        """Gating factors `gate_init` and biases 0 (Megatron-LM's), φ ~ N(0, 0.02²) (Megatron-LM
        draws φ with xavier_uniform_ instead). nn.Module's convention, so that a module built on the
        meta device gets it back after `to_empty`."""
        for norm in self.norms:
            norm.reset_parameters()
        with torch.no_grad():
            self.phi.copy_(torch.randn(self.phi.shape, dtype=self.phi.dtype, device=self.phi.device) * 0.02)
            self.gates.fill_(self.gate_init)
            self.bias.zero_()

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

    def _folded_weight(self, l: int) -> torch.Tensor:
        """g ∘ φ_l (n·d, 2n + n²): the RMSNorm gain folded into the projection."""
        return self.norms[l].weight.unsqueeze(-1) * self.phi[l]

    def stream(self, embedding, sublayers, want_weights):
        if native_streams(embedding, self.phi, self.gates, self.bias):
            return self._stream_native(embedding, sublayers), None
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

    def _stream_native(self, embedding, sublayers):
        """The C path (module docstring): the same function as the PyTorch path of `stream`."""
        n, d, L = self.streams, self.d_model, len(sublayers)
        iters, eps = self.sinkhorn_iters, [norm.eps for norm in self.norms]
        H = embedding.unsqueeze(-2).expand(*embedding.shape[:-1], n, d).contiguous()
        h, post, res = _StreamMix.apply(H, self._folded_weight(0), self.gates[0], self.bias[0], iters, eps[0])
        for l, f in enumerate(sublayers):
            v = f(h)
            self.observe(h, v)
            if l + 1 < L:
                H, h, post, res = _UpdateThenMix.apply(
                    H, v, post, res, self._folded_weight(l + 1), self.gates[l + 1], self.bias[l + 1], iters, eps[l + 1])
            else:
                H = _Update.apply(H, v, post, res)
        return H.sum(-2)

    def visibility(self):
        raise NotImplementedError("mHC has no depth weights over sources")

    def mixing_flops_per_token(self) -> int:
        n, d = self.streams, self.d_model
        per_layer = (3 * n * d + 2 * n * d * (2 * n + n * n) + 4 * self.sinkhorn_iters * n * n
                     + 2 * n * d + 2 * n * n * d + 3 * n * d)
        return self.num_layers * per_layer
