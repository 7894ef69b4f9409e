"""KV-cached decoding: prefill plus one cached forward per token gives the full forward's logits at
every position, for every residual variant; generate samples from it; the cache refuses overflow."""
import pytest
import torch

from attnres import VARIANTS, DecoderLM, ModelConfig, ResidualConfig

TINY = dict(d_model=32, layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def tiny(variant, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = DecoderLM(ModelConfig(**TINY), ResidualConfig(name=variant, heads=4, block_size=2, window=3)).to(dtype).eval()
    with torch.no_grad():  # non-zero mixing parameters: zero queries would make every read a plain mean
        for p in m.residual.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def tokens(B=2, T=11, seed=0):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_then_token_by_token_equals_the_full_forward(variant, dtype):
    m, idx = tiny(variant, dtype), tokens()
    with torch.no_grad():
        full = m(idx)[0]
        cache = m.kv_cache(2, 16)
        parts = [m(idx[:, :4], cache=cache)[0]]  # prefill of 4, then 3 tokens at once, then one by one
        parts.append(m(idx[:, 4:7], cache=cache)[0])
        parts += [m(idx[:, t : t + 1], cache=cache)[0] for t in range(7, idx.shape[1])]
    assert cache.length == idx.shape[1]
    torch.testing.assert_close(torch.cat(parts, 1), full, **TOL[dtype])


def test_grouped_query_attention_and_one_token_prompts():
    """One-token prefill (no causal mask at all) and n_kv_heads < n_heads, float64 to 1e-12."""
    m, idx = tiny("block", torch.float64), tokens(B=3, T=5, seed=1)
    with torch.no_grad():
        full = m(idx)[0]
        cache = m.kv_cache(3)
        steps = torch.cat([m(idx[:, t : t + 1], cache=cache)[0] for t in range(5)], 1)
    torch.testing.assert_close(steps, full, **TOL[torch.float64])
    assert cache.max_len == TINY["max_seq_len"]


def test_generate_greedy_is_the_argmax_of_the_full_forward():
    m, idx = tiny("block"), tokens(B=2, T=5)
    out = m.generate(idx, 6, temperature=0)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], idx)
    with torch.no_grad():
        want = m(out[:, :-1])[0][:, 4:].argmax(-1)  # each new token: the argmax after its prefix
    assert torch.equal(out[:, 5:], want)


@pytest.mark.parametrize("variant", ["baseline", "block", "mhc"])
def test_generate_samples_repeatably_with_a_seeded_generator(variant):
    m, idx = tiny(variant), tokens(B=2, T=4)
    a = m.generate(idx, 8, temperature=1.5, top_k=20, generator=torch.Generator().manual_seed(3))
    b = m.generate(idx, 8, temperature=1.5, top_k=20, generator=torch.Generator().manual_seed(3))
    c = m.generate(idx, 8, temperature=1.5, top_k=20, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_one_is_greedy():
    m, idx = tiny("full"), tokens(B=1, T=3)
    assert torch.equal(m.generate(idx, 5, temperature=2.0, top_k=1), m.generate(idx, 5, temperature=0))


def test_cache_overflow_and_batch_mismatch_are_errors_that_leave_the_cache_as_it_was():
    m, idx = tiny("block"), tokens(B=2, T=6)
    cache = m.kv_cache(2, 8)
    with torch.no_grad():
        m(idx, cache=cache)
        with pytest.raises(ValueError):
            m(idx[:, :3], cache=cache)
        assert cache.length == 6
        with pytest.raises(ValueError):
            m(idx[:1, :1], cache=cache)
        assert cache.length == 6
        m(idx[:, :2], cache=cache)  # the last two positions still fit
    assert cache.length == 8


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=-1), dict(max_new_tokens=40), dict(max_new_tokens=2, temperature=-1.0),
                                    dict(max_new_tokens=2, top_k=0), dict(max_new_tokens=2.5)])
def test_generate_refuses_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        tiny("baseline").generate(tokens(B=1, T=3), **kwargs)


@pytest.mark.parametrize("bad", [dict(batch=0), dict(batch=1, max_len=0), dict(batch=1.0)])
def test_kv_cache_refuses_bad_sizes(bad):
    with pytest.raises(ValueError):
        tiny("baseline").kv_cache(**bad)


def test_a_cache_filled_in_one_dtype_refuses_another_until_reset():
    """Keys cached in fp32 and a step in fp64 (as autocast switched on or off mid-sequence would
    make): one ValueError, the cache unchanged; after reset() the new dtype fills it."""
    m, idx = tiny("block"), tokens(B=1, T=4)
    cache = m.kv_cache(1)
    with torch.no_grad():
        m(idx[:, :3], cache=cache)
        m.double()
        with pytest.raises(ValueError):
            m(idx[:, 3:], cache=cache)
        assert cache.length == 3
        cache.reset()
        m(idx, cache=cache)
    assert cache.length == 4 and cache.keys[0].dtype == torch.float64


@pytest.mark.parametrize("variant", ["baseline", "block", "mhc"])
def test_decoding_with_qkv_bias_and_qk_norm_equals_the_full_forward(variant):
    """The cache holds keys after their bias, per-head norm and rotation (float64, to 1e-12)."""
    torch.manual_seed(0)
    m = DecoderLM(ModelConfig(**TINY, qkv_bias=True, qk_norm=True), ResidualConfig(name=variant, block_size=2)).double().eval()
    with torch.no_grad():  # biases off zero and norm weights off one, so a skipped one shows
        for n, p in m.named_parameters():
            if n.endswith(("_proj.bias", "_norm.weight")):
                p.add_(0.3 * torch.randn_like(p))
    idx = tokens()
    with torch.no_grad():
        full = m(idx)[0]
        cache = m.kv_cache(2, 16)
        parts = [m(idx[:, :4], cache=cache)[0]] + [m(idx[:, t : t + 1], cache=cache)[0] for t in range(4, idx.shape[1])]
    torch.testing.assert_close(torch.cat(parts, 1), full, **TOL[torch.float64])
