"""mHC on the C kernels (attnres/kernels/csrc/streams.c) against its PyTorch path: the pieces
(Sinkhorn, the mix, the update) and a whole model's loss and parameter gradients, forward and
backward, fp32 on the CPU; which path runs when; and gradcheck of the PyTorch path in float64.

Tolerance of every C-vs-PyTorch comparison (fp32): 1e-5 relative, elementwise
(|c − t| ≤ 1e-5·|t| + 1e-5·max|t|, the second term for entries near zero of a tensor whose scale
is max|t|). The two paths sum in different orders (a matmul of vec H against four of H_j, an
exp polynomial, reciprocals in Sinkhorn), so they agree to rounding, not bit for bit.
"""
import pytest
import torch

from attnres import DecoderLM, ModelConfig, ResidualConfig, kernels
from attnres.kernels import cpu_streams, native
from attnres.residuals import ManifoldHyperConnections, sinkhorn
from attnres.residuals import hyper_connections as hc

RTOL = 1e-5


def test_c_kernels_build_here():
    """Not skipped without a compiler: a machine that cannot build them fails here with the reason
    (the model itself would silently take the PyTorch path)."""
    assert cpu_streams.available(), cpu_streams.why_unavailable()


def close(got, want, what=""):
    scale = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * scale, msg=lambda m: f"{what}: {m}")


@pytest.fixture
def backend():
    """Select the mHC path ("torch" or "auto"); restores the default after the test."""
    yield kernels.set_backend
    kernels.set_backend(None)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def perturbed_mhc(d, layers, n, iters=20, seed=0, scale=0.3):
    """An mHC module with parameters away from their init (gates ~0.3, not 0.01), so that every
    path of the mixing carries signal and Sinkhorn sees logits of order one."""
    torch.manual_seed(seed)
    m = ManifoldHyperConnections(d, layers, streams=n, sinkhorn_iters=iters)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen(seed + 1)))
    return m


# ---- Sinkhorn -------------------------------------------------------------------------------


@pytest.mark.parametrize("n,tokens", [(4, 37), (3, 16), (1, 5), (5, 33)])
def test_sinkhorn_c_matches_pytorch_forward_and_backward(backend, n, tokens):
    logits = torch.randn(tokens, n, n, generator=gen(n))
    weight = torch.randn(tokens, n, n, generator=gen(n + 1))
    out, grads = {}, {}
    for mode in ("torch", "auto"):
        backend(mode)
        x = logits.clone().requires_grad_()
        y = sinkhorn(x, iters=20)
        (grads[mode],) = torch.autograd.grad((y * weight).sum(), x)
        out[mode] = y.detach()
    assert type(y.grad_fn).__name__ == "_SinkhornNativeBackward"  # the C path ran
    close(out["auto"], out["torch"], "sinkhorn forward")
    close(grads["auto"], grads["torch"], "sinkhorn backward")


def test_sinkhorn_c_is_doubly_stochastic(backend):
    backend("auto")
    P = sinkhorn(0.5 * torch.randn(500, 4, 4, generator=gen(0)), iters=20)
    torch.testing.assert_close(P.sum(-1), torch.ones(500, 4), rtol=0, atol=1e-5)
    torch.testing.assert_close(P.sum(-2), torch.ones(500, 4), rtol=0, atol=1e-5)
    assert torch.all(P > 0)


def test_sinkhorn_c_handles_a_leading_batch_and_strided_input(backend):
    x = torch.randn(2, 7, 4, 4, generator=gen(3)).transpose(-1, -2)  # not contiguous
    backend("torch")
    want = sinkhorn(x, iters=7)
    backend("auto")
    close(sinkhorn(x, iters=7), want, "sinkhorn (2, 7, 4, 4), transposed")


# ---- the mix and the update ---------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 3])
def test_mix_c_matches_pytorch(n):
    """h, post, res of one sublayer and the gradients of H, φ, the norm gain, gates and bias."""
    d = 8
    m = perturbed_mhc(d, 2, n)
    m.zero_grad(set_to_none=True)
    H0 = torch.randn(3, 7, n, d, generator=gen(5))
    weights = [torch.randn(3, 7, *s, generator=gen(6 + i)) for i, s in enumerate([(d,), (n,), (n, n)])]

    def run(native):
        m.zero_grad(set_to_none=True)
        H = H0.clone().requires_grad_()
        if native:
            h, post, res = hc._StreamMix.apply(H, m._folded_weight(1), m.gates[1], m.bias[1], m.sinkhorn_iters, m.norms[1].eps)
        else:
            pre, post, res = m.mixing(1, H)
            h = hc._weighted_streams(pre, list(H.unbind(-2)))
        loss = sum((o * w).sum() for o, w in zip((h, post, res), weights))
        loss.backward()
        grads = {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}
        return {"h": h.detach(), "post": post.detach(), "res": res.detach(), "dH": H.grad, **grads}

    kernels.set_backend("torch")  # the reference's sinkhorn on its PyTorch path too
    try:
        want = run(native=False)
    finally:
        kernels.set_backend(None)
    got = run(native=True)
    # sublayer 1's norm gain, and φ, the gates and the bias (their layer-1 slices non-zero)
    assert got.keys() == want.keys() and {"norms.1.weight", "phi", "gates", "bias"} <= got.keys()
    assert want["phi"][1].abs().max() > 0 and want["gates"][1].abs().min() > 0
    for name in want:
        close(got[name], want[name], name)


@pytest.mark.parametrize("n", [4, 2])
def test_update_c_matches_pytorch(n):
    """H'_i = post_i·v + Σ_j res_ij·H_j and its backward, against `_StreamUpdate`."""
    d = 16
    Hp = torch.randn(5, 3, n, d, generator=gen(1))
    v = torch.randn(5, 3, d, generator=gen(2))
    post = torch.rand(5, 3, n, generator=gen(3)) * 2
    res = torch.rand(5, 3, n, n, generator=gen(4))
    G = torch.randn(5, 3, n, d, generator=gen(5))

    def run(native):
        ins = [t.clone().requires_grad_() for t in (Hp, v, post, res)]
        if native:
            out = hc._Update.apply(*ins)
        else:
            out = torch.stack(hc._update_streams(ins[3], ins[2], ins[1], list(ins[0].unbind(-2))), -2)
        (out * G).sum().backward()
        return [out.detach()] + [t.grad for t in ins]

    for name, g, w in zip(["H'", "dHp", "dv", "dpost", "dres"], run(True), run(False)):
        close(g, w, name)


# ---- the whole model ----------------------------------------------------------------------


def model_loss_and_grads(mode, n, seed=0, iters=20):
    torch.manual_seed(seed)
    m = DecoderLM(ModelConfig(d_model=32, layers=3, n_heads=4, n_kv_heads=2, max_seq_len=40),
                  ResidualConfig(name="mhc", streams=n, sinkhorn_iters=iters))
    with torch.no_grad():
        for p in m.residual.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen(seed + 1)))
    idx = torch.randint(0, 256, (3, 37), generator=gen(seed + 2))
    kernels.set_backend(mode)
    try:
        _, loss = m(idx, idx.roll(1, -1))
        loss.backward()
    finally:
        kernels.set_backend(None)
    return loss.detach(), {name: p.grad for name, p in m.named_parameters()}


@pytest.mark.parametrize("n,iters", [(4, 20), (3, 5), (1, 2)])
def test_model_loss_and_every_gradient_match_pytorch_path(n, iters):
    loss_c, grads_c = model_loss_and_grads("auto", n, iters=iters)
    loss_t, grads_t = model_loss_and_grads("torch", n, iters=iters)
    close(loss_c, loss_t, "loss")
    assert grads_c.keys() == grads_t.keys()
    for name in grads_t:
        assert grads_c[name] is not None, name
        close(grads_c[name], grads_t[name], name)


def test_c_path_is_the_default_for_fp32_cpu_only(monkeypatch):
    """fp32 CPU: the C path (its autograd nodes in the graph); float64, backend "torch", CPU
    autocast, or a library that cannot be built: the PyTorch path, same values."""
    res = perturbed_mhc(8, 4, 4)
    x = torch.randn(2, 5, 8, generator=gen(0))
    subs = [torch.nn.Linear(8, 8) for _ in range(4)]
    fns = [lambda h, f=f: torch.tanh(f(h)) for f in subs]

    def graph_names(out):
        seen, stack, names = set(), [out.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            names.add(type(node).__name__)
            stack.extend(f for f, _ in node.next_functions)
        return names

    out_c = res(x.requires_grad_(), fns)
    assert {"_StreamMixBackward", "_UpdateThenMixBackward", "_UpdateBackward"} <= graph_names(out_c)
    kernels.set_backend("torch")
    try:
        out_t = res(x, fns)
    finally:
        kernels.set_backend(None)
    assert "_UpdateThenMixBackward" not in graph_names(out_t)
    close(out_c.detach(), out_t.detach(), "stream output")

    out64 = res.double()(x.double(), [lambda h, f=f: torch.tanh(f.double()(h)) for f in subs])
    assert "_UpdateThenMixBackward" not in graph_names(out64)
    res.float()
    for f in subs:
        f.float()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_amp = res(x, fns)
    assert "_UpdateThenMixBackward" not in graph_names(out_amp)

    monkeypatch.setattr(cpu_streams, "available", lambda: False)
    out_fallback = res(x, fns)
    assert "_UpdateThenMixBackward" not in graph_names(out_fallback)
    close(out_fallback.detach(), out_t.detach(), "fallback output")


def test_compiled_model_takes_the_pytorch_path_and_agrees():
    """torch.compile traces the PyTorch path (the C path's ctypes calls are not traceable); one
    graph, the same numbers as the C path in eager mode."""
    torch._dynamo.reset()
    res = perturbed_mhc(8, 4, 4)
    subs = [torch.nn.Linear(8, 8) for _ in range(4)]
    fns = [lambda h, f=f: torch.tanh(f(h)) for f in subs]
    x = torch.randn(2, 5, 8, generator=gen(0), requires_grad=True)
    eager = res(x, fns)
    (gx_eager,) = torch.autograd.grad(eager.square().sum(), x)
    compiled = torch.compile(res, backend="aot_eager", fullgraph=True)
    out = compiled(x, fns)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    close(out.detach(), eager.detach(), "compiled forward")
    close(gx, gx_eager, "compiled backward")


# ---- the PyTorch path in float64 ----------------------------------------------------------


def test_pytorch_path_gradchecks_in_float64(backend):
    backend("torch")
    logits = torch.randn(3, 3, 3, dtype=torch.float64, generator=gen(0), requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: sinkhorn(x, iters=4), (logits,))
    n, d = 3, 4
    A = torch.rand(2, n, n, dtype=torch.float64, generator=gen(1), requires_grad=True)
    b = torch.rand(2, n, dtype=torch.float64, generator=gen(2), requires_grad=True)
    y = torch.randn(2, d, dtype=torch.float64, generator=gen(3), requires_grad=True)
    H = [torch.randn(2, d, dtype=torch.float64, generator=gen(4 + j), requires_grad=True) for j in range(n)]
    assert torch.autograd.gradcheck(lambda *a: torch.stack(hc._update_streams(a[0], a[1], a[2], a[3:]), -2), (A, b, y, *H))
    m = perturbed_mhc(d, 1, n, iters=3).double()
    Hs = torch.randn(2, n, d, dtype=torch.float64, generator=gen(9), requires_grad=True)
    assert torch.autograd.gradcheck(lambda H: m.mixing(0, H), (Hs,))


def test_threads_split_tokens_without_changing_the_result(monkeypatch):
    """Every stream kernel over 1,000 tokens on two OpenMP threads against one, fp32: the per-token
    outputs and gradients bit for bit (the split falls between 16-token tiles, each computed the
    same way), the mix's gate and bias gradients, summed per thread in double, to 1e-6 relative."""
    n, d, iters, N = 4, 16, 5, 1000
    g = gen(11)
    H = torch.randn(N, n, d, generator=g)
    proj = torch.randn(N, 2 * n + n * n, generator=g)
    gates, bias = torch.rand(3, generator=g) + 0.5, torch.randn(2 * n + n * n, generator=g)
    dh, dpost, dres = torch.randn(N, d, generator=g), torch.randn(N, n, generator=g), torch.randn(N, n, n, generator=g)
    v, G = torch.randn(N, d, generator=g), torch.randn(N, n, d, generator=g)
    results = {}
    for threads in ("1", "2"):
        monkeypatch.setenv("ATTNRES_CPU_THREADS", threads)
        assert native.threads(N) == int(threads)
        rstd, h, pre, post, res = cpu_streams.mix_forward(H, proj, gates, bias, iters, 1e-6, want_pre=True)
        GH, dproj, dgates, dbias = cpu_streams.mix_backward(H, proj, rstd, gates, bias, dh, dpost, dres, G, iters)
        Hn = cpu_streams.update_forward(H, v, post, res)
        upd = cpu_streams.update_backward(G, H, v, post, res)
        sk = cpu_streams.sinkhorn_forward(proj[:, 2 * n:].reshape(N, n, n).contiguous(), iters)
        dsk = cpu_streams.sinkhorn_backward(proj[:, 2 * n:].reshape(N, n, n).contiguous(), dres, iters)
        results[threads] = ([rstd, h, pre, post, res, GH, dproj, Hn, *upd, sk, dsk], [dgates, dbias])
    for a, b in zip(results["1"][0], results["2"][0]):
        assert torch.equal(a, b)
    for a, b in zip(results["1"][1], results["2"][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
