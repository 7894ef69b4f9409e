"""attnres.nn.TransformerEncoder: torch's encoder exactly, or the core's attention residuals."""
import pytest
import torch
from torch import nn

from attnres import BlockAttentionResidual, FullAttentionResidual
from attnres.nn import TransformerEncoder

D, HEADS, FF, LAYERS, B, T = 16, 2, 32, 3, 3, 7
FORMS = ["standard", "block_attention", "full_attention"]


def layer(batch_first=True, norm_first=True):
    return nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first)


def pair(residual, batch_first=True, norm_first=True, num_blocks=3):
    """A torch encoder and ours with the same weights (ours built from the same layer)."""
    torch.manual_seed(0)
    proto = layer(batch_first, norm_first)
    ref = nn.TransformerEncoder(proto, LAYERS, norm=nn.LayerNorm(D), enable_nested_tensor=False)
    ours = TransformerEncoder(proto, LAYERS, norm=nn.LayerNorm(D), enable_nested_tensor=False,
                              residual=residual, attn_residual_num_blocks=num_blocks)
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("attn_residual.") for k in missing)
    if ours.attn_residual is not None:
        with torch.no_grad():  # non-zero queries, so reads are not plain means
            for p in ours.attn_residual.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return ref, ours


def masks():
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[0, 5:] = True
    padding[2, 3:] = True
    return causal, padding


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_standard_is_torch(batch_first, norm_first, training):
    ref, ours = pair("standard", batch_first, norm_first)
    ref.train(training)
    ours.train(training)
    x = torch.randn((B, T, D) if batch_first else (T, B, D))
    causal, padding = masks()
    bool_causal = causal.isinf()
    calls = [
        {},
        {"mask": causal},
        {"mask": causal, "is_causal": True},
        {"src_key_padding_mask": padding},
        {"mask": bool_causal, "src_key_padding_mask": padding},
    ]
    for kw in calls:
        with torch.no_grad():
            got, want = ours(x, **kw), ref(x, **kw)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, equal_nan=True)


def test_forms_use_the_core_modules():
    assert isinstance(pair("block_attention")[1].attn_residual, BlockAttentionResidual)
    assert isinstance(pair("full_attention")[1].attn_residual, FullAttentionResidual)
    assert pair("standard")[1].attn_residual is None
    # Block AttnRes with one sublayer per block is Full AttnRes (the paper's S = 1 limit).
    _, block = pair("block_attention", num_blocks=2 * LAYERS)
    _, full = pair("full_attention")
    full.attn_residual.load_state_dict(block.attn_residual.state_dict())
    x = torch.randn(B, T, D)
    with torch.no_grad():
        torch.testing.assert_close(block(x), full(x))


@pytest.mark.parametrize("residual", FORMS)
@pytest.mark.parametrize("how", ["is_causal", "mask", "bool_mask"])
def test_causal_masks_are_honoured(residual, how):
    _, enc = pair(residual)
    enc.eval()
    causal, _ = masks()
    kw = {"is_causal": {"is_causal": True}, "mask": {"mask": causal}, "bool_mask": {"mask": causal.isinf()}}[how]
    x = torch.randn(B, T, D)
    changed = x.clone()
    changed[:, 4:] += torch.randn(B, T - 4, D)  # the future from position 4 on
    with torch.no_grad():
        a, b = enc(x, **kw), enc(changed, **kw)
    torch.testing.assert_close(a[:, :4], b[:, :4], atol=1e-6, rtol=0)
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-3  # and the future does change


@pytest.mark.parametrize("residual", FORMS)
def test_padded_keys_are_honoured(residual):
    _, enc = pair(residual)
    enc.eval()
    _, padding = masks()
    x = torch.randn(B, T, D)
    changed = x.clone()
    changed[padding] += 5 * torch.randn(int(padding.sum()), D)  # only padded positions change
    with torch.no_grad():
        a, b = enc(x, src_key_padding_mask=padding), enc(changed, src_key_padding_mask=padding)
    keep = ~padding
    torch.testing.assert_close(a[keep], b[keep], atol=1e-6, rtol=0)


@pytest.mark.parametrize("residual", ["block_attention", "full_attention"])
def test_attention_forms_train_and_report_weights(residual):
    _, enc = pair(residual)
    enc.train()
    x = torch.randn(B, T, D)
    out, weights = enc(x, return_weights=True)
    readers = 2 * LAYERS + 1
    columns = (3 + 1) if residual == "block_attention" else (2 * LAYERS + 1)
    assert out.shape == x.shape and weights.shape == (readers, B, T, columns)
    torch.testing.assert_close(weights.sum(-1), torch.ones(readers, B, T))
    out.square().mean().backward()
    assert enc.attn_residual.pseudo_queries.grad.abs().sum() > 0
    assert enc.layers[0].linear1.weight.grad.abs().sum() > 0


def test_bad_arguments_are_one_clear_line():
    with pytest.raises(ValueError, match="allowed: standard, block_attention, full_attention"):
        TransformerEncoder(layer(), 2, residual="attention")
    with pytest.raises(ValueError, match="norm_first=True"):
        TransformerEncoder(layer(norm_first=False), 2, residual="full_attention")
    with pytest.raises(ValueError, match=r"attn_residual_num_blocks=8 must divide the 6 sublayers.*allowed: 1, 2, 3, 6"):
        TransformerEncoder(layer(), 3, residual="block_attention")
    with pytest.raises(ValueError, match="return_weights"):
        TransformerEncoder(layer(), 2, enable_nested_tensor=False)(torch.randn(1, 3, D), return_weights=True)
