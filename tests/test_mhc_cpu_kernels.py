"""mHC on the C kernels (attnres/kernels/csrc/streams.c, kernels/cpu_streams.py) against the
reference loop of residuals/hyper_connections.py: the pieces (the mix, the update) and a whole
model's loss and parameter gradients, forward and backward, fp32 on the CPU; which path runs
when; and gradcheck of the reference in float64.

Tolerance of every C-vs-PyTorch comparison (fp32): 1e-5 relative, elementwise
(|c − t| ≤ 1e-5·|t| + 1e-5·max|t|, the second term for entries near zero of a tensor whose scale
is max|t|). The two paths sum in different orders (a matmul of vec H against four of H_j, an
exp polynomial, reciprocals in Sinkhorn), so they agree to rounding, not bit for bit.
"""
import pytest
import torch

from types import SimpleNamespace

from attnres import DecoderLM, ModelConfig, ResidualConfig, kernels
from attnres.kernels import cpu_streams, native
from attnres.residuals import ManifoldHyperConnections, sinkhorn

RTOL = 1e-5


def test_c_kernels_build_here():
    """Not skipped without a compiler: a machine that cannot build them fails here with the reason
    (the model itself would silently take the reference)."""
    assert native.available(), native.why_unavailable()


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


# ---- Sinkhorn (the reference) ---------------------------------------------------------------


def test_sinkhorn_is_doubly_stochastic_and_takes_a_leading_batch():
    """Rows normalised, then columns, 20 times: columns sum to 1 exactly (to fp32), rows to 3e-3
    at logits of scale 1; a (2, 7, 4, 4) batch given transposed equals the contiguous one."""
    P = sinkhorn(0.5 * torch.randn(500, 4, 4, generator=gen(0)), iters=20)
    torch.testing.assert_close(P.sum(-2), torch.ones(500, 4), rtol=0, atol=1e-6)
    torch.testing.assert_close(P.sum(-1), torch.ones(500, 4), rtol=0, atol=3e-3)
    x = torch.randn(2, 7, 4, 4, generator=gen(1))
    torch.testing.assert_close(sinkhorn(x.transpose(-1, -2).contiguous().transpose(-1, -2), iters=7), sinkhorn(x, iters=7),
                               rtol=0, atol=0)


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
            folded = m.norms[1].weight.unsqueeze(-1) * m.phi[1]
            _, h, post, res = cpu_streams.UpdateThenMix.apply(H, None, None, None, folded, m.gates[1], m.bias[1],
                                                               m.sinkhorn_iters, m.norms[1].eps)
        else:
            pre, post, res = m.mixing(1, H)
            h = (pre.unsqueeze(-1) * H).sum(-2)
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
    """H'_i = post_i·v + Σ_j res_ij·H_j and its backward, against the reference's matmul."""
    d = 16
    Hp = torch.randn(5, 3, n, d, generator=gen(1))
    v = torch.randn(5, 3, d, generator=gen(2))
    post = torch.rand(5, 3, n, generator=gen(3)) * 2
    res = torch.rand(5, 3, n, n, generator=gen(4))
    G = torch.randn(5, 3, n, d, generator=gen(5))

    def run(native):
        ins = [t.clone().requires_grad_() for t in (Hp, v, post, res)]
        if native:
            out = cpu_streams.Update.apply(*ins)
        else:
            out = ins[3] @ ins[0] + ins[2].unsqueeze(-1) * ins[1].unsqueeze(-2)
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
    assert {"UpdateThenMixBackward", "UpdateBackward"} <= graph_names(out_c)
    kernels.set_backend("torch")
    try:
        out_t = res(x, fns)
    finally:
        kernels.set_backend(None)
    assert "UpdateThenMixBackward" not in graph_names(out_t)
    close(out_c.detach(), out_t.detach(), "stream output")

    out64 = res.double()(x.double(), [lambda h, f=f: torch.tanh(f.double()(h)) for f in subs])
    assert "UpdateThenMixBackward" not in graph_names(out64)
    res.float()
    for f in subs:
        f.float()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_amp = res(x, fns)
    assert "UpdateThenMixBackward" not in graph_names(out_amp)

    monkeypatch.setattr(native, "available", lambda: False)
    out_fallback = res(x, fns)
    assert "UpdateThenMixBackward" not in graph_names(out_fallback)
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


def test_reference_gradchecks_in_float64(backend):
    backend("torch")
    logits = torch.randn(3, 3, 3, dtype=torch.float64, generator=gen(0), requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: sinkhorn(x, iters=4), (logits,))
    n, d = 3, 4
    m = perturbed_mhc(d, 1, n, iters=3).double()
    Hs = torch.randn(2, n, d, dtype=torch.float64, generator=gen(9), requires_grad=True)
    assert torch.autograd.gradcheck(lambda H: m.mixing(0, H), (Hs,))


def test_threads_split_tokens_without_changing_the_result():
    """The mix and the update over 1,000 tokens on two OpenMP threads against one, fp32: the
    per-token outputs and gradients bit for bit (the split falls between 16-token tiles, each
    computed the same way), the gate and bias gradients, summed per thread in double, to 1e-6
    relative."""
    n, d, iters, N = 4, 16, 5, 1000
    g = gen(11)
    H = torch.randn(N, n, d, generator=g)
    w = torch.randn(n * d, 2 * n + n * n, generator=g) * 0.1
    ctx = SimpleNamespace(gates=torch.rand(3, generator=g) + 0.5, bias=torch.randn(2 * n + n * n, generator=g),
                          iters=iters, eps=1e-6, needs_input_grad=[True] * 5)
    dh, dpost, dres = torch.randn(N, d, generator=g), torch.randn(N, n, generator=g), torch.randn(N, n, n, generator=g)
    v, G = torch.randn(N, d, generator=g), torch.randn(N, n, d, generator=g)
    results = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert native.threads(N) == threads
            proj, rstd, h, post, res = cpu_streams._mix(ctx, H, w)
            GH, dw, dgates, dbias = cpu_streams._mix_backward(ctx, H, proj, rstd, w, dh, dpost, dres, G)
            Hn = cpu_streams._update(H, v, post, res)
            upd = cpu_streams._update_backward(G, H, v, post, res)
            results[threads] = ([rstd, h, post, res, Hn, *upd], [dgates, dbias])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(results[1][0], results[2][0]):
        assert torch.equal(a, b)
    for a, b in zip(results[1][1], results[2][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
