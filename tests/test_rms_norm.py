"""The C RMSNorm of the CPU path (attnres/kernels/rms_norm.py, csrc/rms_norm.c) against torch's,
where it runs and where it does not, and that threads do not change its result."""
import pytest
import torch

from attnres import DecoderLM, ModelConfig, ResidualConfig, kernels
from attnres.kernels import native, rms_norm
from attnres.layers import RMSNorm


def _norms(d, eps, affine=True):
    """Our module and torch's float64 one, with the same random gain."""
    ours = RMSNorm(d, eps=eps, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            ours.weight.uniform_(0.5, 1.5)
    ref = torch.nn.RMSNorm(d, eps=eps, elementwise_affine=affine).double()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


@pytest.mark.parametrize("d", [64, 80, 7])  # a width the vector helpers fix, one they do not, a short tail
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("scale", [1.0, 1e-4])  # rows small enough that eps inside the root matters
def test_the_c_norm_against_torchs_in_float64(d, affine, scale):
    """fp32 kernel against torch.nn.RMSNorm in float64 on the same inputs: output, input gradient
    and gain gradient each to 1e-5 of that tensor's largest entry (fp32 rounding; the gain's
    gradient sums 333 tokens)."""
    kernels.set_backend(None)
    g = torch.Generator().manual_seed(d)
    x = (scale * torch.randn(3, 111, d, generator=g)).requires_grad_()
    grad = torch.randn(3, 111, d, generator=g)
    ours, ref = _norms(d, 1e-6, affine)
    y = ours(x)
    assert type(y.grad_fn).__name__ == "_CRMSNormBackward"
    y.backward(grad)
    xd = x.detach().double().requires_grad_()
    want = ref(xd)
    want.backward(grad.double())
    pairs = [(y, want), (x.grad, xd.grad)] + ([(ours.weight.grad, ref.weight.grad)] if affine else [])
    for got, exp in pairs:
        assert (got.double() - exp).abs().max() <= 1e-5 * exp.abs().max(), (got - exp.float()).abs().max()


def test_a_frozen_gain_gets_no_gradient_and_eps_none_is_torchs_default():
    kernels.set_backend(None)
    ours, ref = _norms(32, None)
    ours.weight.requires_grad_(False)
    x = torch.randn(5, 32, requires_grad=True)
    ours(x).sum().backward()
    assert ours.weight.grad is None and x.grad is not None
    torch.testing.assert_close(ours(x), ref(x.double()).float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("N", [1000, 2048, 70])  # a partial last block; whole blocks; fewer blocks than... one each
def test_threads_do_not_change_a_bit_of_the_result(monkeypatch, N):
    """One, two and three token ranges give the same bits: output, input gradient and gain gradient
    (summed per 64-token block, the blocks added in order whatever the split). torch's RMSNorm
    gave the same bits at one and two threads, so a baseline run's loss did not depend on
    train.threads; with this kernel it still does not."""
    kernels.set_backend(None)
    g = torch.Generator().manual_seed(N)
    x0, grad = torch.randn(N, 64, generator=g), torch.randn(N, 64, generator=g)
    ours, _ = _norms(64, 1e-6)
    got = {}
    for threads in ("1", "2", "3"):
        monkeypatch.setattr(native, "threads", lambda tokens, k=int(threads): min(k, tokens))  # k token ranges, even at 70 tokens
        ours.zero_grad()
        x = x0.clone().requires_grad_()
        y = ours(x)
        y.backward(grad)
        got[threads] = (y.detach(), x.grad, ours.weight.grad.clone())
    for threads in ("2", "3"):
        assert all(torch.equal(a, b) for a, b in zip(got["1"], got[threads])), threads


def test_torchs_norm_runs_where_the_c_kernels_do_not(monkeypatch):
    """float64, autocast, the torch backend and torch.compile take torch's RMSNorm; the model's
    sublayers and final norm take the C one by default."""
    ours, _ = _norms(16, 1e-6)
    kernels.set_backend(None)
    calls = []
    original = rms_norm.rms_norm
    monkeypatch.setattr(rms_norm, "rms_norm", lambda *a: calls.append(1) or original(*a))
    x = torch.randn(4, 16)
    ours(x)
    assert len(calls) == 1
    ours.double()(x.double())
    ours.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours(x)
    kernels.set_backend("torch")
    try:
        ours(x)
    finally:
        kernels.set_backend(None)
    torch._dynamo.reset()
    torch.compile(ours, backend="aot_eager", fullgraph=True)(x)
    assert len(calls) == 1
    model = DecoderLM(ModelConfig(d_model=16, layers=2, n_heads=2, max_seq_len=8), ResidualConfig(name="baseline"))
    model(torch.randint(0, 256, (2, 8)))
    assert len(calls) == 1 + 4 + 1  # four sublayers' PreNorms and the final norm
    assert isinstance(model.norm, torch.nn.RMSNorm)  # a subclass: same parameters, same state dict


def test_second_order_gradients_match_torchs_norm():
    """create_graph=True (a gradient penalty): the gradient of ‖∂L/∂x‖² with respect to x and to
    the gain, through our norm and through torch's, fp32, to 1e-5 of each one's largest entry (the
    kernel's own backward is not differentiable: without its fallback these came out zero)."""
    kernels.set_backend(None)
    ours, ref = _norms(64, 1e-6)
    ref = ref.float()
    g = torch.Generator().manual_seed(3)
    x0, w_out = torch.randn(40, 64, generator=g), torch.randn(40, 64, generator=g)
    got = []
    for norm in (ours, ref):
        norm.zero_grad()
        x = x0.clone().requires_grad_()
        (gx,) = torch.autograd.grad((norm(x) * w_out).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        got.append((x.grad, norm.weight.grad))
    for a, b in zip(*got):
        assert b.abs().max() > 0 and (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_a_model_trains_to_the_same_loss_with_either_norm():
    """Ten AdamW steps of a Block model with the C norm and with torch's (fp32): the losses agree
    to 1e-5 at every step."""
    losses = {}
    for backend in ("auto", "torch_norm"):
        kernels.set_backend(None)
        torch.manual_seed(0)
        model = DecoderLM(ModelConfig(d_model=32, layers=2, n_heads=2, max_seq_len=16), ResidualConfig(name="block", block_size=2))
        if backend == "torch_norm":
            for m in model.modules():
                if isinstance(m, RMSNorm):
                    m.forward = torch.nn.RMSNorm.forward.__get__(m)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        idx = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
        out = []
        for _ in range(10):
            _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[backend] = out
    for a, b in zip(losses["auto"], losses["torch_norm"]):
        assert abs(a - b) <= 1e-5, (losses["auto"], losses["torch_norm"])
