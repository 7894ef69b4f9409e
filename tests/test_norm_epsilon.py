"""The RMSNorm epsilon against what the norms see: `norm_input_mean_squares` measures, per family of
norms, the smallest mean square a forward pass feeds them; the default epsilon must be small
against it for every variant at the study's shape (d_model 64, 16 blocks), at initialisation,
where AttnRes's convex combinations feed the norms vectors far smaller than a growing sum does."""
import os
from pathlib import Path

import pytest
import torch

from attnres import VARIANTS, DecoderLM, ModelConfig, ResidualConfig
from attnres.instrumentation import norm_input_mean_squares

STUDY_SHAPE = dict(d_model=64, layers=16, n_heads=2, d_ff=192, max_seq_len=128)


def text_batch() -> torch.Tensor:
    """8 rows of 128 bytes of real text read from disk (the standard library's os.py)."""
    raw = Path(os.__file__).read_bytes()[: 8 * 128]
    return torch.tensor(list(raw), dtype=torch.long).view(8, 128)


def at_init(variant: str, **model) -> dict:
    torch.manual_seed(0)
    m = DecoderLM(ModelConfig(**{**STUDY_SHAPE, **model}), ResidualConfig(name=variant))
    return norm_input_mean_squares(m, text_batch())


def test_full_feeds_its_norms_vectors_a_thousand_times_smaller_than_the_baseline_at_init():
    """The mechanism behind Full's sensitivity to epsilon: a plain mean over the embedding and small
    sublayer outputs instead of their sum. Baseline PreNorm inputs are about the embedding's mean
    square (N(0, 0.02²): 4e-4); Full's fall to ~4e-7, the size of an epsilon of 1e-6."""
    base, full = at_init("baseline"), at_init("full")
    assert base["prenorm"] > 1e-4 and base["residual_norm"] is None
    for family in ("prenorm", "final_norm"):
        assert full[family] < base[family] / 300
    assert full["residual_norm"] < full["prenorm"]  # the keys: single sublayer outputs


def test_the_measurement_sees_what_each_family_is_fed():
    """Scaling the embedding by 10 (embed_std 0.2) scales the baseline's PreNorm inputs by ~100."""
    small, large = at_init("baseline"), at_init("baseline", embed_std=0.2)
    assert large["prenorm"] / small["prenorm"] == pytest.approx(100, rel=0.2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_default_epsilon_is_a_hundredth_of_the_least_any_norm_is_fed_at_init(variant):
    """docs/MATH.md's rule for model.norm_eps, which looks at no result: at most 1% of the smallest
    mean square any family of norms is fed at initialisation, at the study's shape on real text,
    for every variant. A default that binds (1e-6 for Full: 3x its keys' mean square) fails here."""
    default = ModelConfig().norm_eps
    fed = [m for m in at_init(variant).values() if m is not None]
    assert default <= 0.01 * min(fed), (variant, default, min(fed))


def test_the_old_default_binds_for_full_and_not_for_the_baseline():
    """What the rule guards against, measured: 1e-6 is more than 1% of what Full's norms are fed at
    init, and less than 1% of what the baseline's are."""
    full = [m for m in at_init("full").values() if m is not None]
    base = [m for m in at_init("baseline").values() if m is not None]
    assert 1e-6 > 0.01 * min(full) and 1e-6 < 0.01 * min(base)
