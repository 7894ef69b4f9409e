"""The lm-eval model `attnres`: its scores are the model's own log-probabilities."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'lm-eval==0.4.13')")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from attnres import DecoderLM, ModelConfig, ResidualConfig  # noqa: E402
from evaluation.lm_eval_adapter import AttnResLM  # noqa: E402
from evaluation.tokenizer import ByteTokenizer, TokenizerError, tokenizer_for  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = DecoderLM(ModelConfig(d_model=32, layers=2, n_heads=2, max_seq_len=24), ResidualConfig(name="block", block_size=2))
    with torch.no_grad():
        for p in m.residual.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m.eval()


def request(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


def direct_logprob(model, context_ids, continuation_ids):
    """Σ log p(continuation token | everything before it), one unpadded forward pass."""
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logp = F.log_softmax(model(ids[:, :-1])[0].float(), -1)[0]
    n = len(continuation_ids)
    target = ids[0, -n:]
    picked = logp[-n:].gather(-1, target[:, None])
    return float(picked.sum()), bool((logp[-n:].argmax(-1) == target).all())


def test_registered_under_attnres():
    assert get_model("attnres") is AttnResLM


def test_loglikelihood_is_the_sum_of_token_logprobs(model):
    lm = AttnResLM(pretrained=model, batch_size=2)
    pairs = [("The cat sat on", " the mat"), ("x", "yz"), ("def f(x):\n   ", " return x"), ("", "hello")]
    got = lm.loglikelihood([request("loglikelihood", p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    tok = ByteTokenizer()
    for (context, continuation), (logprob, greedy) in zip(pairs, got, strict=True):
        if context:
            # TemplateLM moves the context's trailing spaces onto the continuation.
            stripped = context.rstrip()
            ctx, cont = tok.encode(stripped), tok.encode(context[len(stripped):] + continuation)
        else:
            ctx, cont = [ord("\n")], tok.encode(continuation)  # empty context: the prefix token
        want, want_greedy = direct_logprob(model, ctx, cont)
        assert logprob == pytest.approx(want, abs=1e-4) and greedy == want_greedy


def test_long_requests_keep_the_last_max_length_tokens(model):
    lm = AttnResLM(pretrained=model)
    context, continuation = "a long context, " * 4 + "and", " end"
    (logprob, _), = lm.loglikelihood([request("loglikelihood", (context, continuation))], disable_tqdm=True)
    ids = list((context + continuation).encode())[-(lm.max_length + 1):]
    want, _ = direct_logprob(model, ids[:-4], ids[-4:])
    assert logprob == pytest.approx(want, abs=1e-4)


def test_rolling_loglikelihood_covers_every_token(model):
    lm = AttnResLM(pretrained=model)
    short, long = "short text", "a text longer than the window " * 2
    got = lm.loglikelihood_rolling([request("loglikelihood_rolling", (short,)), request("loglikelihood_rolling", (long,))], disable_tqdm=True)
    want_short, _ = direct_logprob(model, [ord("\n")], list(short.encode()))
    assert got[0] == pytest.approx(want_short, abs=1e-4)
    # Every token is predicted once, in windows of max_length tokens, each conditioned on as much
    # of the text before it (prefix token included) as fits in the model's window.
    ids, L, total = list(long.encode()), lm.max_length, 0.0
    for start in range(0, len(ids), L):
        pred = ids[start : start + L]
        before = ([ord("\n")] + ids)[: start + 1]
        total += direct_logprob(model, before[-(L + 1 - len(pred)):], pred)[0]
    assert got[1] == pytest.approx(total, abs=1e-3)


def test_whitespace_only_context_is_conditioned_on_the_prefix_token(model):
    """("   ", "x"): lm-eval moves the spaces onto the continuation and the context encodes to
    nothing; it is scored like an empty context (the prefix token, newline for this model), fp32
    to 1e-4; it failed with a size mismatch. A continuation longer than the window is one clear
    error."""
    lm = AttnResLM(pretrained=model)
    (logprob, _), = lm.loglikelihood([request("loglikelihood", ("   ", "x"))], disable_tqdm=True)
    assert logprob == pytest.approx(direct_logprob(model, [ord("\n")], list(b"   x"))[0], abs=1e-4)
    with pytest.raises(ValueError, match="does not fit the model's window of max_length=24"):
        lm.loglikelihood([request("loglikelihood", ("a", "b" * 30))], disable_tqdm=True)


def test_generate_until_is_greedy_and_stops(model):
    lm = AttnResLM(pretrained=model, max_gen_toks=12)
    context = "abc"
    ids = list(context.encode())
    for _ in range(12):  # greedy decoding, done by hand
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids[-lm.max_length:]]))[0][0, -1].argmax()))
    greedy = bytes(ids[3:]).decode("utf-8", errors="ignore")
    out = lm.generate_until([request("generate_until", (context, {"until": [], "max_gen_toks": 12}))], disable_tqdm=True)
    assert out == [greedy]
    stop = greedy[4:6]
    if stop and greedy.find(stop) > 0:
        cut = lm.generate_until([request("generate_until", (context, {"until": [stop], "max_gen_toks": 12}))], disable_tqdm=True)
        assert cut == [greedy[: greedy.find(stop)]]


def test_generate_until_keeps_the_prompt_when_asked_for_more_tokens_than_the_window(model):
    """max_gen_toks (30) above the model's window (24): each step still conditions on the last 24
    tokens of prompt + generated text, greedy, as a naive loop does; the prompt was cut to one
    token before."""
    lm = AttnResLM(pretrained=model)
    context = "The quick brown fox jumps over"
    ids = list(context.encode())
    for _ in range(30):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids[-lm.max_length:]]))[0][0, -1].argmax()))
    greedy = bytes(ids[len(context):]).decode("utf-8", errors="ignore")
    out = lm.generate_until([request("generate_until", (context, {"until": [], "max_gen_toks": 30}))], disable_tqdm=True)
    assert out == [greedy.split("\x00")[0]]  # byte 0 is end of text: generation stops there


@pytest.mark.parametrize("variant", ["baseline", "block", "full", "mhc"])
def test_generate_until_decodes_from_the_cache_as_recomputing_the_window_does(variant):
    """Sampled at temperature 1.5 with the global seed: the same text as the loop that reruns the
    last max_length tokens for every new token (the adapter's former path, float32), and the model
    sees the prompt once, then one token per step until the text outgrows the window (24)."""
    torch.manual_seed(0)
    m = DecoderLM(ModelConfig(d_model=32, layers=2, n_heads=2, max_seq_len=24), ResidualConfig(name=variant, block_size=2))
    with torch.no_grad():
        for p in m.residual.parameters():
            p.add_(0.2 * torch.randn_like(p))
    m.eval()
    context, n, temperature = "Once upon", 20, 1.5
    torch.manual_seed(7)
    ids = list(context.encode())
    for _ in range(n):
        with torch.no_grad():
            logits = m(torch.tensor([ids[-24:]]))[0][0, -1].float()
        nxt = int(torch.multinomial(F.softmax(logits / temperature, dim=-1), 1))
        if nxt == 0:  # end of text
            break
        ids.append(nxt)
    want = bytes(ids[len(context):]).decode("utf-8", errors="ignore")
    fed = []
    hook = m.embed.register_forward_hook(lambda mod, args, out: fed.append(tuple(args[0].shape)))
    try:
        lm = AttnResLM(pretrained=m)
        torch.manual_seed(7)
        out = lm.generate_until([request("generate_until", (context, {"until": [], "max_gen_toks": n, "do_sample": True,
                                                                         "temperature": temperature}))], disable_tqdm=True)
    finally:
        hook.remove()
    assert out == [want]
    cached = 24 - len(context) + 1  # steps while prompt + new text fits the window
    assert fed[0] == (1, len(context)) and all(shape == (1, 1) for shape in fed[1:cached])
    assert all(shape == (1, 24) for shape in fed[cached:])


def test_tokenizer_choice():
    assert tokenizer_for(256).name == "bytes" and tokenizer_for(512).name == "bytes"
    with pytest.raises(TokenizerError, match="vocab_size=100"):
        tokenizer_for(100)
    with pytest.raises(TokenizerError, match="allowed"):
        tokenizer_for(256, "sentencepiece")
    try:  # GPT-2 BPE needs tiktoken and, on first use, its BPE files: either it works or says why
        assert tokenizer_for(50304).name == "gpt2"
    except TokenizerError as e:
        assert "tiktoken" in str(e) and "\n" not in str(e)


def test_a_custom_tokenizer_object(model):
    """The adapter only needs encode / decode / eot_id / name: BPE goes through the same code."""

    class EveryOtherByte(ByteTokenizer):
        name = "toy"

        def encode(self, text):
            return [b for b in text.encode() if b % 2 == 0]

    lm = AttnResLM(pretrained=model, tokenizer=EveryOtherByte())
    (logprob, _), = lm.loglikelihood([request("loglikelihood", ("hello", " world"))], disable_tqdm=True)
    ctx = [b for b in b"hello" if b % 2 == 0]
    cont = [b for b in b"hello world" if b % 2 == 0][len(ctx):]
    assert logprob == pytest.approx(direct_logprob(model, ctx, cont)[0], abs=1e-4)
