"""The multi-hop probe: well-formed examples that need exactly k hops, and per-k accuracy."""
from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest
import torch

from attnres import DecoderLM, ModelConfig
from harness.data import DataConfig, DataError, MultiHopProbe, load_data, resolve
from harness.data.multihop import SEPARATOR

STATEMENT = re.compile(r"^[a-z]=[a-z0-9]$")


@pytest.fixture(scope="module")
def probe():
    return MultiHopProbe(hops=(1, 2, 3, 4, 6), n_vars=10, train_examples=500, val_examples=250, seed=3)


def test_examples_need_exactly_k_hops(probe):
    lengths = set()
    for k, examples in probe.val_set().items():
        assert len(examples) == 50
        for ex in examples:
            assert ex.k == k and resolve(ex.prompt) == (ex.answer, k)
            body, query = ex.prompt.rsplit("?", 1)
            statements = body.rstrip(";").split(";")
            assert len(statements) == probe.n_vars and all(STATEMENT.match(s) for s in statements)
            names = [s[0] for s in statements]
            assert len(set(names)) == probe.n_vars  # each variable assigned once: one path
            assert re.fullmatch(r"[a-z]=", query)
            literals = [s[2] for s in statements if s[2].isdigit()]
            assert literals.count(ex.answer) == 1  # only the chain's own digit is the answer
            lengths.add(len(ex.text))
    assert lengths == {probe.example_len}  # every k has the same length


def test_statement_order_is_shuffled(probe):
    # The chain's first statement (the one holding the digit) is not always in the same place.
    positions = Counter()
    for ex in probe.val_set()[4]:
        statements = ex.prompt.rsplit("?", 1)[0].rstrip(";").split(";")
        positions[next(i for i, s in enumerate(statements) if s[2] == ex.answer)] += 1
    assert len(positions) > 4


def test_deterministic_and_disjoint(probe):
    again = MultiHopProbe(hops=(1, 2, 3, 4, 6), n_vars=10, train_examples=500, val_examples=250, seed=3)
    assert again.val_set() == probe.val_set() and again.train_set() == probe.train_set()
    other = MultiHopProbe(hops=(1, 2, 3, 4, 6), n_vars=10, train_examples=500, val_examples=250, seed=4)
    assert other.val_set() != probe.val_set()
    val_prompts = {ex.prompt for exs in probe.val_set().values() for ex in exs}
    assert not val_prompts & {ex.prompt for ex in probe.train_set()}
    assert Counter(ex.k for ex in probe.train_set()) == {k: 100 for k in probe.hops}


def test_load_data_multihop_tokens():
    cfg = DataConfig(name="multihop", hops=[1, 2], n_vars=6, train_examples=100, val_examples=20, seed=1)
    data = load_data(cfg, seq_len=64)
    probe = MultiHopProbe.from_config(cfg)
    text = bytes(data.train.tolist()).decode("ascii")
    assert text == "".join(ex.text for ex in probe.train_set())
    assert data.train.numel() == 100 * probe.example_len and data.val.numel() == 20 * probe.example_len
    for line in text.split(SEPARATOR)[:-1]:
        prompt, answer = line[:-1], line[-1]
        assert resolve(prompt)[0] == answer
    fp = data.fingerprint
    assert fp["source"] == "multihop" and fp["hops"] == [1, 2] and fp == load_data(cfg, 64).fingerprint


class Oracle(torch.nn.Module):
    """Reads the prompt back from the token ids and puts all logit mass on the true answer."""

    def forward(self, idx, targets=None):
        logits = torch.zeros(*idx.shape, 256)
        for b, row in enumerate(idx.tolist()):
            text = bytes(row).decode("ascii")
            assert text.startswith(SEPARATOR) and text.endswith("=")
            answer, _ = resolve(text[1:])
            logits[b, -1, ord(answer)] = 1.0
        return logits, None


class Constant(torch.nn.Module):
    def __init__(self, token: int):
        super().__init__()
        self.token = token

    def forward(self, idx, targets=None):
        logits = torch.zeros(*idx.shape, 256)
        logits[..., self.token] = 1.0
        return logits, None


def test_accuracy_with_dummy_models(probe):
    oracle = Oracle().train()
    assert probe.accuracy(oracle, "cpu", batch_size=16) == {k: 1.0 for k in probe.hops}
    assert oracle.training  # mode restored
    constant = probe.accuracy(Constant(ord("0")), "cpu", max_per_hop=40)
    for k, acc in constant.items():
        expected = sum(ex.answer == "0" for ex in probe.val_set()[k][:40]) / 40
        assert acc == pytest.approx(expected)


def test_accuracy_with_the_real_model():
    torch.manual_seed(0)
    probe = MultiHopProbe(hops=(1, 2), n_vars=4, train_examples=10, val_examples=8)
    model = DecoderLM(ModelConfig(d_model=32, layers=1, n_heads=2, max_seq_len=64))
    acc = probe.accuracy(model, torch.device("cpu"))
    assert set(acc) == {1, 2} and all(0.0 <= a <= 1.0 for a in acc.values())


def test_extra_queries_answer_other_variables_and_keep_the_scored_prefix():
    """data.queries: after the scored answer, that many queries about other variables, each with
    the digit its chain resolves to; every example keeps one length, and the scored query still
    comes first, so the prompt the model is scored on is a prefix of what it trained on."""
    plain = MultiHopProbe(hops=(1, 2, 3, 4), n_vars=8, train_examples=200, val_examples=80, seed=5)
    multi = MultiHopProbe(hops=(1, 2, 3, 4), n_vars=8, train_examples=200, val_examples=80, seed=5,
                          queries=7)
    assert multi.example_len == plain.example_len + 4 * 7
    depths = Counter()
    for k, examples in multi.val_set().items():
        assert all(e.k == k and resolve(e.prompt) == (e.answer, k) for e in examples)
        for ex in examples:
            assert len(ex.text) == multi.example_len
            asked = re.findall(r"\?([a-z])=([0-9])", ex.extra)
            assert len(asked) == 7 and len({v for v, _ in asked}) == 7
            assert ex.prompt[-2] not in {v for v, _ in asked}  # never the scored variable again
            body = ex.prompt.rsplit("?", 1)[0]
            for var, digit in asked:
                ans, hops = resolve(f"{body}?{var}=")
                assert ans == digit
                depths[hops] += 1
    assert set(depths) >= {1, 2}  # the extra queries practise lookups of several depths
    assert all(ex.text.startswith(ex.prompt + ex.answer + "?") for ex in multi.train_set())
    assert multi.fingerprint(*(multi.tokens(s) for s in ("train", "val")))["queries"] == 7
    assert "queries" not in plain.fingerprint(*(plain.tokens(s) for s in ("train", "val")))


def test_queries_outside_the_variables_are_a_data_error():
    from harness.data import DataError

    with pytest.raises(DataError):
        MultiHopProbe(n_vars=6, queries=6)
    with pytest.raises(DataError):
        MultiHopProbe(n_vars=6, queries=-1)


def test_copy_accuracy_is_the_mean_of_one_over_the_prompts_distinct_digits():
    """Recomputed here from the prompts by a regular expression; exact in float64. With every
    variable in the chain (n_vars = max hops) the answer is the prompt's only digit at that hop
    count: copying scores 1, which is why the probe needs distractors."""
    probe = MultiHopProbe(hops=(1, 2, 3, 4), n_vars=6, val_examples=80)
    got = probe.copy_accuracy()
    for k, exs in probe.val_set().items():
        want = sum(1 / len(set(re.findall(r"[0-9]", ex.prompt))) for ex in exs) / len(exs)
        assert got[k] == pytest.approx(want, abs=1e-15) and 0.1 <= got[k] <= 1
    assert MultiHopProbe(hops=(1, 2, 3, 4), n_vars=4, val_examples=40).copy_accuracy()[4] == 1.0


def test_answers_only_keeps_exactly_the_digits_after_a_query():
    """Targets survive only where the input ends "?v=": the scored answer and each extra query's
    digit; every other target becomes -100 (cross-entropy's ignore index). Checked against the
    positions found by a regular expression on the text."""
    from harness.data.multihop import answers_only

    probe = MultiHopProbe(n_vars=6, queries=2, train_examples=8, val_examples=4)
    tokens = probe.tokens("train")[:300].long()
    x, y = tokens[:-1][None], tokens[1:][None]
    kept = answers_only(x, y)[0]
    text = bytes(tokens.tolist()).decode("ascii")
    want = {m.start(1) - 1 for m in re.finditer(r"\?[a-z]=([0-9])", text)}  # target index = char index - 1
    assert {int(i) for i in torch.nonzero(kept != -100).flatten()} == want
    assert torch.equal(kept[kept != -100], y[0][kept != -100]) and len(want) >= 3 * 8 // 2


def test_loss_on_answers_needs_the_probe():
    with pytest.raises(DataError):
        load_data(DataConfig(name="stdlib", loss_on="answers", max_bytes=100_000), 64)
    with pytest.raises(DataError):
        load_data(DataConfig(name="multihop", loss_on="digits"), 128)


COMPACT = re.compile(r"^(?:[a-z][a-z0-9])+$")


def test_compact_format_is_the_same_chains_without_separators():
    """data.format=compact writes statement "x=3;" as "x3" and query "?x=" as "?x": the examples
    are those of the assign format (same seed) with "=" and ";" removed, and still resolve."""
    kw = dict(hops=(1, 2, 3), n_vars=6, train_examples=60, val_examples=30, queries=2, seed=5)
    assign, compact = MultiHopProbe(**kw), MultiHopProbe(**kw, format="compact")
    for a, c in zip(assign.train_set(), compact.train_set()):
        assert c.prompt == a.prompt.replace("=", "").replace(";", "") and c.answer == a.answer
        assert c.extra == a.extra.replace("=", "")
        assert resolve(c.prompt) == (c.answer, c.k) and COMPACT.match(c.prompt.rsplit("?", 1)[0])
        assert len(c.text) == compact.example_len == 2 * 6 + 3 + 3 * 2 + 1
    with pytest.raises(DataError):
        MultiHopProbe(format="json")
    with pytest.raises(DataError):  # refused by every source, not only the probe
        load_data(DataConfig(name="stdlib", format="json", max_bytes=100_000), 64)


def test_answers_only_in_the_compact_format_keeps_the_digit_after_each_query():
    from harness.data.multihop import answers_only

    probe = MultiHopProbe(n_vars=6, queries=3, train_examples=8, val_examples=4, format="compact")
    tokens = probe.tokens("train").long()
    x, y = tokens[:-1][None], tokens[1:][None]
    kept = answers_only(x, y, compact=True)[0]
    text = bytes(tokens.tolist()).decode("ascii")
    want = {m.start(1) - 1 for m in re.finditer(r"\?[a-z]([0-9])", text)}
    assert {int(i) for i in torch.nonzero(kept != -100).flatten()} == want and len(want) == 8 * 4
    assert torch.equal(kept[kept != -100], y[0][kept != -100])


def test_aligned_windows_are_one_example_each_after_its_newline():
    """data.aligned=true: with train.seq_len = the example length, every training window is the
    newline that ends the example before, then one whole example, as the accuracy's prompts begin."""
    from harness.data import batch_iterator

    cfg = DataConfig(name="multihop", hops=[1, 2], n_vars=5, queries=4, train_examples=300, val_examples=40,
                     format="compact", aligned=True, loss_on="answers")
    probe = MultiHopProbe.from_config(cfg)
    data = load_data(cfg, probe.example_len)
    texts = {ex.text for ex in probe.train_set()}
    assert data.train.numel() == 300 * probe.example_len + 1
    for x, y in itertools.islice(batch_iterator(data.train, 16, probe.example_len, seed=2, aligned=True), 20):
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            assert chr(row_x[0]) == SEPARATOR and bytes(row_y).decode("ascii") in texts
    assert data.fingerprint["aligned"] and data.fingerprint["format"] == "compact"
    with pytest.raises(DataError):  # a window of another length would hold parts of two examples
        load_data(cfg, probe.example_len + 1)
