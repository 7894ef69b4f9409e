"""The model with every variant: init equivalences, causality, training, the drop-in module's two
forms, argument errors, accounting and instrumentation."""
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from attnres import VARIANTS, BlockAttentionResidual, DecoderLM, FullAttentionResidual, ModelConfig, ResidualConfig
from attnres.residuals import sinkhorn

TINY = dict(d_model=32, layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64)


def tiny(variant, seed=0, **model_kw):
    torch.manual_seed(seed)
    return DecoderLM(ModelConfig(**{**TINY, **model_kw}), ResidualConfig(name=variant, heads=4, block_size=2, window=3))


def tokens(seed=0, B=2, T=16):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def test_variants_are_the_thirteen_names():
    assert len(VARIANTS) == 13 and len(set(VARIANTS)) == 13
    for name in ("baseline", "denseformer", "hc", "mhc", "full", "full_input_query", "full_scalar", "full_sigmoid",
                 "full_no_rmsnorm", "sliding_window", "block", "block_multihead", "block_no_rmsnorm"):
        assert name in VARIANTS


@pytest.mark.parametrize("variant", ["denseformer", "hc"])
def test_starts_exactly_as_the_baseline(variant):
    base = tiny("baseline")
    other = tiny(variant, seed=1)
    shared = {k: v for k, v in base.state_dict().items() if not k.startswith("residual.")}
    missing, unexpected = other.load_state_dict(shared, strict=False)
    assert not unexpected and all(k.startswith("residual.") for k in missing)
    idx = tokens()
    assert torch.equal(other(idx)[0], base(idx)[0])  # bit for bit, float32



# A value other than the default for each knob of ResidualConfig (TINY: L = 8 sublayers, d 32).
_KNOB_CHANGES = dict(block_size=2, num_blocks=4, window=2, heads=4, streams=2, sinkhorn_iters=3, gate_init=0.5)


def _residual_fingerprint(variant: str, **knobs) -> list[torch.Tensor]:
    """Logits of a tiny model at init and again with every residual parameter set to the same
    random values (zero queries make every read a plain mean, which hides the head count)."""
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(**TINY), ResidualConfig(name=variant, **knobs)).eval()
    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = [model(idx)[0]]
        g = torch.Generator().manual_seed(2)
        for p in model.residual.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        out.append(model(idx)[0])
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_knob_readers_name_exactly_the_variants_whose_model_a_knob_changes(variant):
    """KNOB_READERS, which run.py uses to drop the knobs a variant ignores from its record and
    name, against the models themselves (fp32, exact): a knob changes the model (its logits at init
    or with perturbed mixing parameters) if and only if the table says the variant reads it."""
    from attnres.config import KNOB_READERS

    assert set(KNOB_READERS) == set(_KNOB_CHANGES)
    base = _residual_fingerprint(variant)
    for knob, value in _KNOB_CHANGES.items():
        changed = _residual_fingerprint(variant, **{knob: value})
        differs = any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(base, changed))
        assert differs == (variant in KNOB_READERS[knob]), (variant, knob)
        cfg = ResidualConfig(name=variant, **{knob: value})
        assert cfg.unread_settings() == ({} if variant in KNOB_READERS[knob] else {knob: value})
        assert cfg.without_unread() == (cfg if variant in KNOB_READERS[knob] else ResidualConfig(name=variant))


def test_print_model_shows_which_residual_it_runs():
    """`print(model)` tells the thirteen variants apart by their residual's knobs (every attention
    residual printed as a bare `AttentionResidual(` before)."""
    shown = {v: repr(tiny(v).residual).splitlines()[:2] for v in VARIANTS}
    assert len({" ".join(lines) for lines in shown.values()}) == len(VARIANTS), shown
    assert "sources=block, block_size=2" in " ".join(shown["block_multihead"])
    assert "heads=4" in " ".join(shown["block_multihead"]) and "window=3" in " ".join(shown["sliding_window"])

def test_mhc_mixing_is_doubly_stochastic():
    m = tiny("mhc")
    H = torch.randn(2, 7, 4, 32)
    for l in range(m.config.sublayers):
        _, _, res = m.residual.mixing(l, H)
        torch.testing.assert_close(res.sum(-1), torch.ones(2, 7, 4), rtol=0, atol=1e-5)
        torch.testing.assert_close(res.sum(-2), torch.ones(2, 7, 4), rtol=0, atol=1e-5)
        assert torch.all(res > 0)
    # and for random logits of the scale the gates produce (|logit| ≲ 1); 20 iterations do not
    # converge to 1e-5 for much larger logits (rows off by 1e-2 at scale 2), columns are exact.
    P = sinkhorn(0.5 * torch.randn(500, 4, 4, generator=torch.Generator().manual_seed(0)), iters=20)
    torch.testing.assert_close(P.sum(-1), torch.ones(500, 4), rtol=0, atol=1e-5)
    torch.testing.assert_close(P.sum(-2), torch.ones(500, 4), rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_causality(variant):
    m = tiny(variant).double()
    with torch.no_grad():  # non-zero mixing parameters, so that every path carries signal
        for name, p in m.residual.named_parameters():
            p.add_(0.1 * torch.randn_like(p))
    idx = tokens(B=1, T=12)
    t = 7
    changed = idx.clone()
    changed[0, t] = (idx[0, t] + 1) % 256
    a, b = m(idx)[0], m(changed)[0]
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)  # exactly, float64
    assert not torch.allclose(a[:, t:], b[:, t:])


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_trains_and_every_parameter_gets_a_gradient(variant):
    m = tiny(variant)
    opt = torch.optim.AdamW(m.optimizer_groups(0.01), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    # A learnable stream: a fixed repeated byte pattern.
    pattern = torch.randint(0, 256, (9,), generator=g)
    idx = pattern.repeat(8)[: 2 * 33].view(2, 33)
    losses = []
    for step in range(30):
        _, loss = m(idx[:, :-1], idx[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            missing = [n for n, p in m.named_parameters() if p.grad is None]
            assert not missing, f"{variant}: no gradient for {missing}"
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], f"{variant}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def encoder_and_sublayers(d=16, layers=3, seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=32, dropout=0.0, norm_first=True, batch_first=True)
    enc = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False).double().eval()
    subs = []
    for lyr in enc.layers:
        subs.append(lambda h, lyr=lyr: lyr.self_attn(lyr.norm1(h), lyr.norm1(h), lyr.norm1(h), need_weights=False)[0])
        subs.append(lambda h, lyr=lyr: lyr.linear2(lyr.activation(lyr.linear1(lyr.norm2(h)))))
    return enc, subs


@pytest.mark.parametrize("cls", ["block", "full"])
def test_drop_in_encoder_form_equals_sublayer_form(cls):
    enc, subs = encoder_and_sublayers()
    res = (BlockAttentionResidual(16, 6, num_blocks=3) if cls == "block" else FullAttentionResidual(16, 6)).double()
    with torch.no_grad():
        for p in res.parameters():
            p.add_(0.5 * torch.randn_like(p))
    src = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(res(enc, src), res(src, subs), rtol=0, atol=1e-12)


def test_drop_in_encoder_form_honours_masks():
    enc, subs = encoder_and_sublayers()
    res = BlockAttentionResidual(16, 6, num_blocks=2).double()
    src = torch.randn(1, 6, 16, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    out = res(enc, src, mask=causal, is_causal=True)
    changed = src.clone()
    changed[0, 4] += 1.0
    out2 = res(enc, changed, mask=causal, is_causal=True)
    torch.testing.assert_close(out[:, :4], out2[:, :4], rtol=0, atol=1e-12)
    assert not torch.allclose(res(enc, src), res(enc, changed))  # without the mask, the future leaks


def test_drop_in_parameters_follow_the_rfc():
    res = BlockAttentionResidual(d_model=64, num_layers=12, num_blocks=6)
    assert res.pseudo_queries.shape == (12, 64) and torch.all(res.pseudo_queries == 0)
    assert isinstance(res.key_norms, nn.ModuleList) and len(res.key_norms) == 12
    assert all(isinstance(n, nn.RMSNorm) for n in res.key_norms)
    assert res.output_query.shape == (64,) and torch.all(res.output_query == 0)
    assert isinstance(res.output_norm, nn.RMSNorm)
    out, w = res(torch.randn(2, 3, 64), nn.ModuleList(nn.Linear(64, 64) for _ in range(12)), return_weights=True)
    assert out.shape == (2, 3, 64) and w.shape == (13, 2, 3, 7)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "baseline"] + ["drop_in_block", "drop_in_full"])
def test_meta_device_init_then_reset_parameters_is_the_paper_init(variant):
    """Built on the meta device, moved with to_empty (uninitialised memory), then reset_parameters:
    the same zero queries and unit gains as a module built directly (before: no reset_parameters,
    so the queries kept whatever the memory held; DenseFormer, HC and mHC had none until later,
    so their a_ii = 1, static HC matrices and gates did too). mHC's φ is drawn again from the
    same seed."""
    from attnres.residuals import build_residual

    def build():
        if variant == "drop_in_block":
            return BlockAttentionResidual(16, 8, 4)
        if variant == "drop_in_full":
            return FullAttentionResidual(16, 8)
        return build_residual(ResidualConfig(name=variant, heads=4, block_size=3, window=3), 16, 8)

    torch.manual_seed(0)
    want = build().state_dict()
    with torch.device("meta"):
        res = build()
    res.to_empty(device="cpu")
    for p in res.parameters():
        p.data.fill_(float("nan"))  # what uninitialised memory may hold
    torch.manual_seed(0)
    res.reset_parameters()
    got = res.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: BlockAttentionResidual(64, 12, num_blocks=5), ["num_blocks=5", "num_layers=12", "allowed: 1, 2, 3, 4, 6, 12"]),
        # d_model=0 built an empty module, -4 and a float num_layers failed in torch.zeros, a float
        # num_blocks built a module with a float block size
        (lambda: BlockAttentionResidual(0, 6, num_blocks=2), ["d_model=0", "positive integer"]),
        (lambda: FullAttentionResidual(-4, 6), ["d_model=-4", "positive integer"]),
        (lambda: BlockAttentionResidual(16, 6.0, num_blocks=2), ["num_layers=6.0", "positive integer"]),
        (lambda: BlockAttentionResidual(16, 6, num_blocks=2.0), ["num_blocks=2.0", "allowed: 1, 2, 3, 6"]),
        (lambda: ResidualConfig(name="blok"), ["residual.name", "blok", "baseline", "block_multihead"]),
        (lambda: DecoderLM(ModelConfig(**TINY), ResidualConfig(name="block_multihead", heads=5)), ["residual.heads=5", "d_model=32", "allowed"]),
        (lambda: DecoderLM(ModelConfig(**TINY), ResidualConfig(name="block", num_blocks=3)), ["residual.num_blocks=3", "allowed: 1, 2, 4, 8"]),
        (lambda: DecoderLM(ModelConfig(**TINY), ResidualConfig(name="block", block_size=9)), ["residual.block_size=9", "L=8"]),
        (lambda: ModelConfig(d_model=30, n_heads=4), ["n_heads=4", "d_model=30"]),
        (lambda: FullAttentionResidual(64, 0), ["num_layers=0"]),
    ],
)
def test_bad_arguments_name_the_argument_and_allowed_values(build, words):
    with pytest.raises(ValueError) as err:
        build()
    for w in words:
        assert w in str(err.value), f"{w!r} missing from: {err.value}"


def _misuse(case):
    d, L = 16, 6
    res = BlockAttentionResidual(d, L, num_blocks=3)
    subs = nn.ModuleList(nn.Linear(d, d) for _ in range(L))
    x = torch.randn(2, 5, d)
    layer = nn.TransformerEncoderLayer(d, 2, batch_first=True, norm_first=True)
    calls = {
        "swapped": lambda: res(subs, x),
        "encoder_second": lambda: res(x, nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)),
        "one_module": lambda: res(x, subs[0]),
        "token_ids": lambda: res(torch.randint(0, 9, (2, 5, d)), subs),
        "too_few": lambda: res(x, subs[:4]),
        "wrong_width_out": lambda: res(x, [*subs[:2], nn.Linear(d, 8), *subs[3:]]),
        "tuple_out": lambda: res(x, [lambda h: (h, None)] * L),
        "device": lambda: BlockAttentionResidual(d, L, num_blocks=3).to("meta")(x, subs),
    }
    return calls[case]


@pytest.mark.parametrize(
    "case, words",
    [
        ("swapped", ["sublayers must be a list or nn.ModuleList", "got a Tensor", "residual(embedding, sublayers)"]),
        ("encoder_second", ["residual(encoder, src)"]),
        ("one_module", ["got a Linear"]),
        ("token_ids", ["embedding must be a floating-point tensor", "torch.int64", "token ids"]),
        ("too_few", ["got 4 sublayers", "allowed: exactly 6"]),
        ("wrong_width_out", ["sublayers[2] returned shape (2, 5, 8) for an input of shape (2, 5, 16)"]),
        ("tuple_out", ["sublayers[0] returned a tuple"]),
        ("device", ["embedding is on cpu", "parameters are on meta", "to_empty"]),
    ],
)
def test_drop_in_misuse_is_one_line_saying_what_is_allowed(case, words):
    """Arguments in the wrong order, token ids, a sublayer returning the wrong thing, the module on
    another device: one ValueError line each (before: TypeError "has no len()", "linalg.vector_norm:
    Expected a floating point", a reshape error, "fold_rms is an option of the C kernels", or a
    count of the swapped tensor's batch as sublayers)."""
    with pytest.raises(ValueError) as err:
        _misuse(case)()
    message = str(err.value)
    assert "\n" not in message
    for w in words:
        assert w in message, f"{w!r} missing from: {message}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_analytic_flops_match_flop_counter(variant):
    """Within 10% of FlopCounterMode on one forward+backward (which counts matmuls and SDPA only)."""
    m = DecoderLM(ModelConfig(d_model=64, layers=4, n_heads=4, max_seq_len=128), ResidualConfig(name=variant, heads=4))
    B, T = 2, 128
    idx = tokens(B=B, T=T)
    # The math backend decomposes SDPA into matmuls the counter sees (its CPU fused kernel has no
    # FLOP formula registered); it computes the full T×T square, as the analytic count assumes.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = m(idx, idx)
        loss.backward()
    measured = counter.get_total_flops() / (B * T)
    analytic = m.flops_per_token(T)
    assert abs(analytic["total"] - measured) / measured < 0.10, (analytic, measured)
    # the matmul + attention part alone, which is what the counter sees, within 2%
    assert abs(analytic["matmul"] + analytic["attention"] - measured) / measured < 0.02 or variant in ("mhc", "hc", "full_input_query")


def test_param_counts_add_up():
    for variant in ("baseline", "block", "mhc"):
        m = tiny(variant)
        c = m.param_counts()
        assert c["total"] == sum(p.numel() for p in m.parameters())
        assert c["embedding"] + c["non_embedding"] == c["total"]
        assert c["residual"] == sum(p.numel() for p in m.residual.parameters())
        assert (c["residual"] == 0) == (variant == "baseline")


@pytest.mark.parametrize("variant", ["baseline", "full", "block", "mhc"])
def test_inspect_reports_depth_weights_and_magnitudes(variant):
    m = tiny(variant)
    info = m.inspect(tokens())
    Lsub = m.config.sublayers
    assert len(info["output_rms_sublayer"]) == Lsub and len(info["output_rms_block"]) == m.config.layers
    assert len(info["hidden_rms_sublayer"]) == Lsub and all(x > 0 for x in info["output_rms_sublayer"])
    assert m.residual.recorder is None  # off again afterwards
    if variant in ("baseline", "mhc"):
        assert info["depth_weights"] is None
        return
    w = torch.tensor(info["depth_weights"], dtype=torch.float64)
    cols = Lsub + 1 if variant == "full" else Lsub // 2 + 1  # Full: L+1 columns; Block (S=2): N+1
    assert w.shape == (Lsub + 1, cols)
    torch.testing.assert_close(torch.nansum(w, 1), torch.ones(Lsub + 1, dtype=torch.float64), rtol=0, atol=1e-6)  # float32 model
    assert torch.isnan(w[0, 1:]).all()  # the first sublayer sees the embedding only


@pytest.mark.parametrize("variant", ["full", "block", "block_multihead"])
def test_inspect_depth_entropy_is_the_per_token_entropy(variant):
    """Each reader's recorded entropy is the mean over tokens of the entropy of its weights, taken
    from return_weights independently (float64, 1e-12); the entropy of the token-averaged weights
    is at least that (Jensen), strictly where readers differ across tokens."""
    m = tiny(variant).double()
    for p in m.residual.parameters():  # away from the zero query's uniform start
        torch.nn.init.normal_(p, std=1.0)
    idx = tokens()
    info = m.inspect(idx)
    _, w = m.residual(m.embed(idx), m.sublayers, return_weights=True)
    w = w.flatten(1, -2)
    want = [-(x[x > 0] * x[x > 0].log()).sum().item() / x.shape[0] for x in w]
    assert info["depth_entropy"] == pytest.approx(want, abs=1e-12)
    mean_w = torch.tensor(info["depth_weights"], dtype=torch.float64).nan_to_num(0.0)
    of_mean = -(torch.special.xlogy(mean_w, mean_w)).sum(1)
    assert (of_mean >= torch.tensor(info["depth_entropy"]) - 1e-12).all()
    assert (of_mean > torch.tensor(info["depth_entropy"]) + 1e-6).any()
    assert info["depth_entropy"][0] == pytest.approx(0.0, abs=1e-12)  # sees the embedding only


def test_grad_norm_per_block():
    m = tiny("block")
    _, loss = m(tokens(), tokens(1))
    loss.backward()
    norms = m.grad_norm_per_block()
    assert len(norms) == m.config.layers and all(n > 0 for n in norms)


def test_core_imports_torch_only():
    code = (
        "import sys, attnres\n"
        "bad = [m for m in ('hydra', 'omegaconf', 'mlflow', 'optuna', 'pandas', 'scipy', 'matplotlib', 'harness') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"attnres imported {out.stdout.strip()}"


def test_rope_rotates_each_pair_of_halves_and_depends_on_relative_position_only():
    """apply_rope with rope_tables: bit for bit the pairwise rotation (x1·cos − x2·sin,
    x2·cos + x1·sin) of the two halves of each head (fp32 and fp64, exact); and a query-key
    product depends only on the distance between the two positions (fp64, to 1e-12)."""
    from attnres.layers import apply_rope, rope_tables

    g = torch.Generator().manual_seed(0)
    T, H, hd = 12, 3, 8
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(2, T, H, hd, generator=g, dtype=dtype)
        cos, sin = rope_tables(T, hd, 10000.0, "cpu", dtype)
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        angles = torch.outer(torch.arange(T, dtype=torch.float64), inv)
        c, s = angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]
        x1, x2 = x.chunk(2, -1)
        assert torch.equal(apply_rope(x, cos, sin), torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), -1))
    q, k = torch.randn(hd, generator=g, dtype=torch.float64), torch.randn(hd, generator=g, dtype=torch.float64)
    cos, sin = rope_tables(T, hd, 10000.0, "cpu", torch.float64)

    def at(v, pos):
        return apply_rope(v.expand(1, T, 1, hd), cos, sin)[0, pos, 0]

    for m, n, shift in [(3, 1, 4), (7, 7, 2), (0, 5, 6)]:
        torch.testing.assert_close(at(q, m) @ at(k, n), at(q, m + shift) @ at(k, n + shift), rtol=0, atol=1e-12)


def test_a_compiled_model_recompiles_once_for_new_sequence_lengths():
    """torch.compile's default (dynamic=None): the first new length compiles a dynamic graph and
    later lengths reuse it (README), as generation needs. The RoPE tables were cached per length,
    and the cache lookup made Dynamo specialise on T: a compilation per length. Now one table of
    max_seq_len rows is sliced; the logits stay those of eager mode (fp32, 1e-6)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    m = tiny("baseline").eval()
    counter = CompileCounter()
    compiled = torch.compile(m, backend=counter)
    with torch.no_grad():
        for T in (2, 3, 4, 5):
            idx = tokens(B=1, T=T)
            torch.testing.assert_close(compiled(idx)[0], m(idx)[0], rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 2, f"{counter.frame_count} compilations for 4 sequence lengths"


def test_a_compiled_model_compiles_once_for_repeated_steps():
    """The RoPE cache was read inside the compiled graph: Dynamo guarded on whether it held the
    table, so the first step (which filled it) left the second to recompile the whole model, a
    compilation inside a benchmark's timed rounds when it warmed up once. Computing the tables in
    the graph instead put float64 sin/cos into every rotation (7% of a 194m step on an H200):
    they are constants of the graph, no sin or cos in it. Training mode, fp32; the logits stay
    those of eager mode (1e-6)."""
    from torch._dynamo.testing import CompileCounter

    from attnres import layers

    torch._dynamo.reset()
    layers._ROPE_CACHE.clear()  # as in a fresh process
    m = tiny("block")
    counter, graphs = CompileCounter(), []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return counter(gm, example_inputs)

    compiled = torch.compile(m, backend=backend)
    idx = tokens(B=2, T=5)
    for _ in range(3):
        torch.testing.assert_close(compiled(idx)[0], m(idx)[0], rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for three identical steps"
    assert not any(op in code for code in graphs for op in (".cos(", ".sin(", "torch.cos", "torch.sin"))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tie", [False, True])
def test_param_counts_match_an_independent_count(variant, tie):
    """Every group against a count by hand (GQA, both embedding layouts, every variant's extras)."""
    V, d, Lb, H, kv, ff, S, n = 97, 32, 3, 4, 2, 80, 2, 4
    m = DecoderLM(ModelConfig(vocab_size=V, d_model=d, layers=Lb, n_heads=H, n_kv_heads=kv, d_ff=ff,
                              tie_embeddings=tie), ResidualConfig(name=variant, block_size=S, heads=4))
    L, hd = 2 * Lb, d // H
    block = 2 * d + d * H * hd + d * 2 * kv * hd + H * hd * d + 3 * d * ff
    attnres = L * d + d + (L + 1) * d  # queries, output query, key-norm gains
    residual = {
        "baseline": 0, "denseformer": Lb * (Lb + 1),
        "hc": L * (2 * n + n * n) + L * d + L * d * (n + 2) + 2 * L,
        "mhc": L * n * d + L * n * d * (2 * n + n * n) + 3 * L + L * (2 * n + n * n),
        "full_input_query": d + (L + 1) * d + L * d * d, "full_scalar": (L + 1) ** 2,
        "full_no_rmsnorm": L * d + d, "block_no_rmsnorm": L * d + d,
    }.get(variant, attnres)
    embedding = V * d * (1 if tie else 2)
    non_embedding = Lb * block + d + residual
    assert m.param_counts() == {"total": non_embedding + embedding, "embedding": embedding,
                                "non_embedding": non_embedding, "residual": residual}
    assert m.param_counts()["total"] == sum(p.numel() for _, p in m.named_parameters())


@pytest.mark.parametrize("variant", ["full", "full_scalar", "full_no_rmsnorm", "block", "block_no_rmsnorm",
                                     "block_multihead", "sliding_window", "full_input_query"])
def test_depth_read_flops_count_only_the_work_the_variant_does(variant):
    """Forward mixing FLOPs by hand from the sources each read sees: an axpy (2d) and the
    normaliser (5) per source and head (block_multihead's heads each normalise on their own: it
    was counted once); a dot product (2d) per source unless the scores are scalars; the
    rms of the L+1 new sources/partial sums (3d) only with key norms; Block's partial-sum adds."""
    d, Lb, S, W, H = 32, 4, 3, 2, 8
    L = 2 * Lb
    m = DecoderLM(ModelConfig(d_model=d, layers=Lb, n_heads=4),
                  ResidualConfig(name=variant, block_size=S, window=W, heads=H))
    if variant.startswith("block"):
        n = sum(r // S + 1 + (1 if r % S else 0) for r in range(L)) + -(-L // S) + 1
    elif variant == "sliding_window":
        n = sum(1 + min(r, W) for r in range(L + 1))
    else:
        n = sum(r + 1 for r in range(L + 1))
    expected = 2 * d * n + 5 * n * (H if variant == "block_multihead" else 1)
    expected += 0 if variant == "full_scalar" else 2 * d * n
    expected += 0 if variant in ("full_scalar", "full_no_rmsnorm", "block_no_rmsnorm") else 3 * d * (L + 1)
    expected += d * (L - -(-L // S)) if variant.startswith("block") else 0
    expected += 2 * d * d * L if variant == "full_input_query" else 0
    assert m.residual.mixing_flops_per_token() == expected
    assert m.flops_per_token(64)["residual"] == 3 * expected


def test_denseformer_and_baseline_flops_count_their_sums_by_hand():
    """Forward mixing FLOPs per token: the baseline's add per sublayer (d); DenseFormer's too, plus
    its depth-weighted average after block i, i + 1 products and i sums of width d (it counted
    d more per block)."""
    d, Lb = 32, 5
    for variant, expected in [("baseline", 2 * Lb * d),
                              ("denseformer", 2 * Lb * d + sum((i + 1) * d + i * d for i in range(1, Lb + 1)))]:
        m = DecoderLM(ModelConfig(d_model=d, layers=Lb, n_heads=4), ResidualConfig(name=variant))
        assert m.residual.mixing_flops_per_token() == expected, variant


@pytest.mark.parametrize("name, key", [("sliding_window", "window"), ("hc", "streams"), ("mhc", "streams"),
                                       ("mhc", "sinkhorn_iters")])
def test_a_variant_knob_below_one_is_refused_with_its_full_key(name, key):
    with pytest.raises(ValueError, match=f"residual.{key}=0 must be a positive integer for residual={name}"):
        ResidualConfig(name=name, **{key: 0})
    ResidualConfig(name="block", **{key: 0})  # a knob another variant does not read is left alone


def test_output_rms_block_is_the_quadratic_mean_of_its_sublayers_in_float64():
    """A Transformer block's output RMS (Fig. 5) is sqrt of the mean of its attention and MLP
    outputs' squared RMS, kept in float64 (a float32 tensor rounded it by ~1e-9 relative)."""
    import math

    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=50, d_model=32, layers=3, n_heads=2, d_ff=64, max_seq_len=16)
    m = DecoderLM(mc, ResidualConfig(name="block", block_size=2)).double()
    info = m.inspect(torch.randint(0, 50, (2, 16)))
    s = info["output_rms_sublayer"]
    for b, got in enumerate(info["output_rms_block"]):
        want = math.sqrt((s[2 * b] ** 2 + s[2 * b + 1] ** 2) / 2)
        assert abs(got - want) <= 1e-15 * want


def test_embed_std_draws_the_token_embedding_alone_at_its_own_scale():
    """model.embed_std=1: the token embedding is N(0, 1) (sample std of 256×64 draws within 5%),
    every other weight the same as at the default (None: the embedding at init_std), bit for bit."""
    cfg = dict(vocab_size=256, d_model=64, layers=2, n_heads=2, init_std=0.125)
    torch.manual_seed(0)
    default = DecoderLM(ModelConfig(**cfg))
    torch.manual_seed(0)
    wide = DecoderLM(ModelConfig(**cfg, embed_std=1.0))
    assert float(wide.embed.weight.detach().std()) == pytest.approx(1.0, rel=0.05)
    assert float(default.embed.weight.detach().std()) == pytest.approx(0.125, rel=0.05)
    others = [(n, p) for n, p in default.state_dict().items() if not n.startswith("embed.")]
    assert others and all(torch.equal(p, wide.state_dict()[n]) for n, p in others)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            ModelConfig(**cfg, embed_std=bad)


@pytest.mark.parametrize("variant", ["full", "mhc", "baseline"])
def test_each_norm_family_takes_its_own_epsilon_and_falls_back_to_norm_eps(variant):
    """model.prenorm_eps / residual_norm_eps / final_norm_eps reach their norms only; unset, each is
    model.norm_eps, so a model built without them is the model built before they existed (float32
    logits equal exactly)."""
    base = dict(d_model=32, layers=2, n_heads=2, norm_eps=1e-6)
    split = DecoderLM(ModelConfig(**base, prenorm_eps=1e-8, residual_norm_eps=1e-7, final_norm_eps=1e-5),
                      ResidualConfig(name=variant))
    assert {s.norm.eps for s in split.sublayers} == {1e-8} and split.norm.eps == 1e-5
    own = {m.eps for m in split.residual.modules() if isinstance(m, nn.RMSNorm)} | {getattr(split.residual, "eps", 1e-7)}
    assert own == {1e-7}
    torch.manual_seed(0)
    a = DecoderLM(ModelConfig(**base), ResidualConfig(name=variant))
    torch.manual_seed(0)
    b = DecoderLM(ModelConfig(**base, prenorm_eps=1e-6, residual_norm_eps=1e-6, final_norm_eps=1e-6),
                  ResidualConfig(name=variant))
    idx = torch.randint(0, 256, (2, 9))
    assert torch.equal(a(idx)[0], b(idx)[0])
    with pytest.raises(ValueError):
        ModelConfig(**base, residual_norm_eps=float("nan"))


def test_qkv_bias_and_qk_norm_are_absent_unless_asked_and_start_neutral():
    """Off (the default): no new state-dict keys. On: q/k/v biases (k's and v's in kv_proj's one
    bias) start at zero and the per-head q/k norms (one head_dim weight each, the PreNorms' ε) at one."""
    plain = tiny("block")
    assert not [k for k in plain.state_dict() if k.endswith(".bias") or "q_norm" in k or "k_norm" in k]
    m = tiny("block", qkv_bias=True, qk_norm=True, prenorm_eps=1e-7)
    extra = sorted(set(m.state_dict()) - set(plain.state_dict()))
    per_layer = ["op.k_norm.weight", "op.kv_proj.bias", "op.q_norm.weight", "op.q_proj.bias"]
    assert extra == sorted(f"sublayers.{2 * i}.{k}" for i in range(TINY["layers"]) for k in per_layer)
    attn = m.sublayers[0].op
    assert attn.q_proj.bias.shape == (32,) and attn.kv_proj.bias.shape == (2 * 2 * 8,)
    assert attn.q_norm.weight.shape == (8,) and attn.q_norm.eps == attn.k_norm.eps == 1e-7
    assert not attn.q_proj.bias.any() and not attn.kv_proj.bias.any() and bool((attn.k_norm.weight == 1).all())


def test_qkv_bias_and_qk_norm_compute_biased_then_per_head_normed_then_rotated_attention():
    """Attention with both options against a by-hand float64 reference: q = xWqᵀ + bq, k and v likewise,
    an RMSNorm over each head's q and k with one shared head_dim weight, then RoPE (to 1e-12)."""
    import torch.nn.functional as F

    from attnres.layers import apply_rope, rope_tables

    torch.manual_seed(1)
    m = DecoderLM(ModelConfig(**TINY, qkv_bias=True, qk_norm=True, norm_eps=1e-6)).double()
    attn = m.sublayers[0].op
    with torch.no_grad():
        for p in (attn.q_proj.bias, attn.kv_proj.bias, attn.q_norm.weight, attn.k_norm.weight):
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    wk, wv = attn.kv_proj.weight.chunk(2)
    bk, bv = attn.kv_proj.bias.chunk(2)

    def heads(y, n, norm=None):
        y = y.view(2, 7, n, 8)
        return y if norm is None else y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight

    cos, sin = rope_tables(7, 8, TINY.get("rope_theta", 10000.0), "cpu", torch.float64)
    q = apply_rope(heads(x @ attn.q_proj.weight.T + attn.q_proj.bias, 4, attn.q_norm), cos, sin)
    k = apply_rope(heads(x @ wk.T + bk, 2, attn.k_norm), cos, sin)
    v = heads(x @ wv.T + bv, 2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1),
                                       v.transpose(1, 2).repeat_interleave(2, 1), is_causal=True)
    want = y.transpose(1, 2).reshape(2, 7, 32) @ attn.out_proj.weight.T
    with torch.no_grad():
        torch.testing.assert_close(attn(x), want, rtol=0, atol=1e-12)


def test_qkv_bias_and_qk_norm_train_and_every_parameter_gets_a_gradient():
    m, idx = tiny("full", qkv_bias=True, qk_norm=True), tokens()
    m(idx, idx)[1].backward()
    new = [p for n, p in m.named_parameters() if n.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight"))]
    assert len(new) == 4 * TINY["layers"] and all(p.grad is not None and p.grad.abs().sum() > 0 for p in new)
