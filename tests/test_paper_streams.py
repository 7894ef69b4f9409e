"""Whole residual streams against a naive float64 reference written from the paper's equations (docs/MATH.md)
(stacked sources, explicit softmax, explicit Sinkhorn; none of the project's read paths), with
random non-zero parameters, so that every query, gain, mixing logit and gate matters. These cover
what tests/test_core_reads.py does not: DenseFormer, HC, mHC, multi-head, per-token queries, the
sliding window, Block with a remainder, each through a whole stream of sublayers and its output,
forward and gradients; HC and mHC also at an expansion rate and Sinkhorn count other than the
defaults, so that a config value that never reaches the module shows.

Tolerance: 1e-10 relative in float64 (the implementations agree to ~1e-14). Alternative readings
of the paper (mHC's mixing matrix transposed, Sinkhorn columns first or with 19 iterations) must
miss it, so the comparison can fail."""
from __future__ import annotations

import pytest
import torch

from attnres import ResidualConfig, build_residual

D, L, EPS, TOL = 16, 8, 1e-6, 1e-10
F64 = torch.float64


def rmsnorm(x, gain=None):
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return y if gain is None else y * gain


def read(sources, query, gain, heads=1, normaliser="softmax"):
    """h = Σ_i α_i v_i, α = normaliser_i(w · RMSNorm(v_i)) per channel group."""
    V = torch.stack(sources)  # (n, B, T, d)
    K = rmsnorm(V, gain)
    logits = (K * query).unflatten(-1, (heads, -1)).sum(-1).repeat_interleave(D // heads, -1)
    if normaliser == "sigmoid":  # renormalised (the project's reading)
        s = torch.sigmoid(logits)
        alpha = s / s.sum(0)
    else:
        alpha = torch.softmax(logits, 0)
    return (alpha * V).sum(0)


def attnres_stream(e, subs, p, *, window=None, block=None, heads=1, normaliser="softmax", input_query=False):
    """Full AttnRes over v_0 = e and each output; `window`: v_0 and the `window` latest outputs;
    `block` = S: b_0 = e, completed block sums, and from a block's second sublayer its partial sum."""
    v, prev_h, blocks, partial = [e], e, [e], None
    for l, f in enumerate(subs):
        if block is not None:
            src = blocks + ([partial] if l % block else [])
        else:
            src = v if window is None else [v[0]] + v[1:][-window:]
        q = prev_h @ p[f"query_projections.{l}.weight"].T if input_query else p["pseudo_queries"][l]
        h = read(src, q, p[f"key_norms.{l}.weight"], heads, normaliser)
        v.append(f(h))
        prev_h = h
        if block is not None:
            partial = v[-1] if l % block == 0 else partial + v[-1]
            if (l + 1) % block == 0 or l == len(subs) - 1:  # the last block takes the remainder
                blocks.append(partial)
    src = blocks if block is not None else v if window is None else [v[0]] + v[1:][-window:]
    return read(src, p["output_query"], p["output_norm.weight"], heads, normaliser)


def denseformer_stream(e, subs, p):
    """After Transformer block b: Y_b = Σ_{j≤b} a_bj X_j over the embedding and block outputs."""
    X, Y = [e], e
    for b in range(len(subs) // 2):
        h = Y + subs[2 * b](Y)
        X.append(h + subs[2 * b + 1](h))
        Y = sum(p["dwa_weights"][b, j] * X[j] for j in range(b + 2))
    return Y


def sinkhorn(logits, iters, columns_first=False):
    M = torch.exp(logits)
    for _ in range(iters):  # rows, then columns (Sinkhorn-Knopp)
        M = M / M.sum(-2 if columns_first else -1, keepdim=True)
        M = M / M.sum(-1 if columns_first else -2, keepdim=True)
    return M


def mhc_stream(e, subs, p, n=4, iters=20, transpose=False, columns_first=False):
    """x_{l+1} = H_res x_l + H_postᵀ f(H_pre x_l); x̃ = RMSNorm(vec x); streams start as copies."""
    H = [e] * n
    for l, f in enumerate(subs):
        z = rmsnorm(torch.cat(H, -1), p[f"norms.{l}.weight"]) @ p["phi"][l]
        (a_pre, a_post, a_res), b = p["gates"][l], p["bias"][l]
        pre = torch.sigmoid(a_pre * z[..., :n] + b[:n])
        post = 2 * torch.sigmoid(a_post * z[..., n : 2 * n] + b[n : 2 * n])
        res = sinkhorn((a_res * z[..., 2 * n :] + b[2 * n :]).unflatten(-1, (n, n)), iters, columns_first)
        res = res.transpose(-1, -2) if transpose else res
        y = f(sum(pre[..., k : k + 1] * H[k] for k in range(n)))
        H = [sum(res[..., i, j : j + 1] * H[j] for j in range(n)) + post[..., i : i + 1] * y for i in range(n)]
    return sum(H)


def hc_stream(e, subs, p, n=4):
    """Dynamic Hyper-Connections (Zhu et al., 2024): per stream j, H̄_j = RMSNorm(H_j) and
    g_j = tanh(H̄_j W) with W's columns pre | post | res (n); pre_j = A_m[j] + s_α g_j,pre,
    post_j = B[j] + s_β g_j,post, res[j, k] = A_r[j, k] + s_α g_j,res_k (res is HC's A_r, indexed
    (from j, to k): H' = A_rᵀ H + Bᵀ f(A_mᵀ H)). Output: the mean of the streams (the project's
    reading of HC's sum; the final RMSNorm removes the factor n)."""
    H = [e] * n
    for l, f in enumerate(subs):
        s_a, s_b = p["scale_pre_res"][l], p["scale_post"][l]
        g = [torch.tanh(rmsnorm(Hj, p[f"norms.{l}.weight"]) @ p["dynamic"][l]) for Hj in H]
        pre = [p["pre_static"][l, j] + s_a * g[j][..., 0:1] for j in range(n)]
        post = [p["post_static"][l, k] + s_b * g[k][..., 1:2] for k in range(n)]
        res = [[p["res_static"][l, j, k] + s_a * g[j][..., 2 + k : 3 + k] for k in range(n)] for j in range(n)]
        y = f(sum(pre[j] * H[j] for j in range(n)))
        H = [sum(res[j][k] * H[j] for j in range(n)) + post[k] * y for k in range(n)]
    return sum(H) / n


def sublayers(seed=0):
    g = torch.Generator().manual_seed(seed)
    mats = [(torch.randn(D, D, generator=g, dtype=F64) / D**0.5, 0.3 * torch.randn(D, generator=g, dtype=F64))
            for _ in range(L)]
    return [lambda h, W=W, c=c: torch.tanh(rmsnorm(h) @ W + c) for W, c in mats]


def randomised(name, **kw):
    res = build_residual(ResidualConfig(name=name, **kw), D, L).to(F64)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in res.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=F64)
            p.copy_(1 + 0.3 * r if "norm" in n else r)
    return res


CASES = {
    "full": (dict(), lambda e, s, p: attnres_stream(e, s, p)),
    "full_sigmoid": (dict(), lambda e, s, p: attnres_stream(e, s, p, normaliser="sigmoid")),
    "full_input_query": (dict(), lambda e, s, p: attnres_stream(e, s, p, input_query=True)),
    "sliding_window": (dict(window=3), lambda e, s, p: attnres_stream(e, s, p, window=3)),
    "block": (dict(block_size=3), lambda e, s, p: attnres_stream(e, s, p, block=3)),  # 8 = 3 + 3 + 2
    "block_multihead": (dict(heads=4, block_size=3), lambda e, s, p: attnres_stream(e, s, p, block=3, heads=4)),
    "denseformer": (dict(), denseformer_stream),
    "hc": (dict(), hc_stream),
    "mhc": (dict(), mhc_stream),
}


@pytest.mark.parametrize("name", list(CASES))
def test_stream_matches_the_papers_equations(name):
    assert_stream_matches(name, *CASES[name])


@pytest.mark.parametrize("name, kw, reference", [
    pytest.param("hc", dict(streams=3), lambda e, s, p: hc_stream(e, s, p, n=3), id="hc-3-streams"),
    pytest.param("mhc", dict(streams=3, sinkhorn_iters=7), lambda e, s, p: mhc_stream(e, s, p, n=3, iters=7),
                 id="mhc-3-streams-7-iterations"),
])
def test_expansion_rate_and_sinkhorn_iterations_reach_the_stream(name, kw, reference):
    """`streams` and `sinkhorn_iters` of the config reach the model built from it: the defaults
    (4 streams, 20 iterations) would miss these references (parameters of the wrong shape, a
    different projection)."""
    assert_stream_matches(name, kw, reference)


def assert_stream_matches(name, kw, reference):
    """Output and every gradient of variant `name` (config `kw`, random parameters) equal the
    reference stream's, to TOL in float64."""
    res = randomised(name, **kw)
    subs = sublayers()
    e = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(2), dtype=F64, requires_grad=True)
    params = dict(res.named_parameters())
    ref_params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    e_ref = e.detach().clone().requires_grad_()
    out, want = res(e, subs), reference(e_ref, subs, ref_params)
    torch.testing.assert_close(out, want, rtol=TOL, atol=TOL * want.abs().max().item())
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    names = list(params)
    got = torch.autograd.grad((out * probe).sum(), [e] + [params[n] for n in names], allow_unused=True)
    exp = torch.autograd.grad((want * probe).sum(), [e_ref] + [ref_params[n] for n in names], allow_unused=True)
    scale = max(x.abs().max().item() for x in exp if x is not None)
    for n, a, b in zip(["embedding"] + names, got, exp):
        a = torch.zeros_like(b) if a is None and b is not None else a
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is not None:
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL * scale, msg=lambda m, n=n: f"{name}, d/d{n}: {m}")


@pytest.mark.parametrize("reading", [dict(transpose=True), dict(columns_first=True), dict(iters=19)])
def test_another_reading_of_mhc_misses(reading):
    """The comparison above can fail: mHC's mixing matrix transposed, Sinkhorn normalising columns
    first, or one iteration short of its 20, is visibly another model (1e-3 to 1e-1 relative)."""
    res, subs = randomised("mhc"), sublayers()
    e = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(2), dtype=F64)
    params = {k: v.detach() for k, v in res.named_parameters()}
    with torch.no_grad():
        out, other = res(e, subs), mhc_stream(e, subs, params, **reading)
    assert (out - other).abs().max() > 1e3 * TOL * other.abs().max()
