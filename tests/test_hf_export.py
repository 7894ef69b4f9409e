"""`python -m evaluation.export`: a run as a Hugging Face folder that transformers loads with
trust_remote_code, for every residual variant, with attnres.load's logits (float32, atol 1e-5)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnres
from attnres import VARIANTS, DecoderLM, ModelConfig, ResidualConfig

transformers = pytest.importorskip("transformers", reason="the Hugging Face doors need transformers (pip install -e '.[hf]')")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from evaluation.export import LOGITS_ATOL, export, main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-5  # float32 logits, the export's own check too
assert LOGITS_ATOL == ATOL


def tiny(variant: str, seed: int = 0, **model) -> DecoderLM:
    """A small model whose residual parameters are moved off their init, so that every variant's
    mixing shows in the logits (at init several variants equal the baseline)."""
    torch.manual_seed(seed)
    cfg = dict(d_model=32, layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48, **model)
    m = DecoderLM(ModelConfig(**cfg), ResidualConfig(name=variant, block_size=2, window=2, heads=2, streams=2))
    with torch.no_grad():
        for p in m.residual.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m.eval()


def exported(tmp_path: Path, model: DecoderLM, extra=None) -> tuple[Path, Path]:
    attnres.save_pretrained(model, tmp_path / "ck", extra=extra)
    return tmp_path / "ck", export(str(tmp_path / "ck"), str(tmp_path / "hf"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_loads_with_auto_classes_and_gives_attnres_logits(variant, tmp_path):
    ck, out = exported(tmp_path, tiny(variant))
    assert {"config.json", "model.safetensors", "modeling_attnres.py", "tokenization_attnres.py",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_attnres.AttnResForCausalLM"
    assert config["attnres_residual"]["name"] == variant
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    loaded, _ = attnres.load(str(ck), device="cpu")
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = hf(idx).logits, loaded(idx)[0]
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=0, atol=ATOL), float((got - want).abs().max())


def test_greedy_generate_uses_the_cache_and_agrees_without_it(tmp_path):
    model = tiny("block")
    _, out = exported(tmp_path, model)
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    widths = []
    hf.model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    prompt = torch.tensor([[72, 101, 108, 108, 111], [87, 111, 114, 108, 100]])
    cached = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert widths == [5] + [1] * 11  # one prefill, then one token per step from the cache
    widths.clear()
    recomputed = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                             use_cache=False)
    assert widths == list(range(5, 17))
    assert cached.tolist() == recomputed.tolist() == model.generate(prompt, 12, temperature=0).tolist()


def test_left_padding_is_refused_not_attended(tmp_path):
    _, out = exported(tmp_path, tiny("baseline"))
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    ids = torch.tensor([[0, 0, 72, 101], [72, 101, 108, 108]])
    with pytest.raises(ValueError, match="padding"):
        hf(ids, attention_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
    # right padding without a cache changes nothing for the real tokens
    right = hf(ids, attention_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])).logits
    assert torch.equal(right, hf(ids).logits)


def test_tied_embeddings_survive_the_round_trip(tmp_path):
    model = tiny("full", tie_embeddings=True)
    _, out = exported(tmp_path, model)
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    assert hf.model.lm_head.weight.data_ptr() == hf.model.embed.weight.data_ptr()
    idx = torch.arange(30)[None]
    with torch.no_grad():
        assert torch.allclose(hf(idx).logits, model(idx)[0], rtol=0, atol=ATOL)


def test_the_byte_tokenizer_is_the_runs(tmp_path):
    # A model trained on a text file conditions an empty context on a newline (lm-eval's prefix token).
    _, out = exported(tmp_path, tiny("baseline"), extra={"data": {"name": "text"}})
    tok = AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    text = "héllo\nworld\x00 ok"
    ids = tok(text).input_ids
    assert ids == list(text.encode("utf-8"))  # bytes, no bos or eos added, special bytes included
    assert tok.decode(ids) == text and tok.decode(ids, skip_special_tokens=True) == text.replace("\x00", "")
    assert (tok.bos_token_id, tok.eos_token_id) == (ord("\n"), 0)
    assert tok.decode([104, 195]) == "h"  # a cut multi-byte character is dropped, as evaluation.tokenizer does


def test_cli_writes_the_folder_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    attnres.save_pretrained(tiny("baseline"), tmp_path / "ck")
    assert main([str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    capsys.readouterr()
    # a folder that is not empty is never overwritten
    assert main([str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    # a missing checkpoint: one line naming it, nothing written
    assert main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "nowhere") in err[0]
    assert not (tmp_path / "hf2").exists()
    # --log-to-run needs a run, not a folder
    assert main([str(tmp_path / "ck"), "--out", str(tmp_path / "hf3"), "--log-to-run"]) == 2
    assert not (tmp_path / "hf3").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


@pytest.mark.slow  # creating an MLflow SQLite store takes most of 20 s
def test_log_to_run_puts_the_folder_into_the_run(tmp_path):
    import mlflow

    attnres.save_pretrained(tiny("block"), tmp_path / "ck")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.tracking.MlflowClient(uri)
    run = client.create_run(client.create_experiment("hf-export", artifact_location=(tmp_path / "art").as_uri()))
    client.log_artifacts(run.info.run_id, str(tmp_path / "ck"), "model")
    run_id = run.info.run_id
    assert main([run_id, "--out", str(tmp_path / "hf"), "--tracking-uri", uri, "--log-to-run"]) == 0
    logged = {a.path for a in client.list_artifacts(run_id, "hf")}
    assert {"hf/config.json", "hf/model.safetensors", "hf/modeling_attnres.py"} <= logged
    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="hf", dst_path=str(tmp_path / "dl"),
                                                tracking_uri=uri)
    hf = AutoModelForCausalLM.from_pretrained(local, trust_remote_code=True)
    assert hf.config.attnres_residual["name"] == "block"


def test_without_attnres_the_code_says_what_is_missing_in_one_line(monkeypatch):
    import importlib.util

    monkeypatch.setitem(sys.modules, "attnres", None)  # as if attnres were not installed
    path = ROOT / "evaluation" / "hf" / "modeling_attnres.py"
    spec = importlib.util.spec_from_file_location("modeling_attnres_without_core", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importing the file works: transformers' loader needs that
    with pytest.raises(ImportError, match="attnres") as error:
        module.AttnResConfig()
    assert "\n" not in str(error.value) and "pip install" in str(error.value)


@pytest.mark.slow  # a fresh interpreter importing transformers: most of 20 s
def test_without_attnres_the_folder_says_what_is_missing_in_one_line(tmp_path):
    _, out = exported(tmp_path, tiny("baseline"))
    script = ("import sys; sys.modules['attnres'] = None\n"  # as if attnres were not installed
              "from transformers import AutoModelForCausalLM\n"
              f"AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n")
    env = {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and "attnres" in last and "pip install" in last, last


def test_lm_eval_stock_hf_model_scores_as_the_attnres_adapter(tmp_path):
    """lm-eval's own `hf` model on the exported folder and our `attnres` model on the checkpoint: the
    same per-document scores (float32, atol 1e-5) and metrics on the offline tasks of each request type."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed")
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (pip install -e '.[hf]')")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from evaluation.lm_eval_adapter import AttnResLM
    from test_eval_cli import TASKS, write_tasks

    ck, out = exported(tmp_path, tiny("block"), extra={"data": {"name": "text"}})
    (tmp_path / "tasks").mkdir()
    write_tasks(tmp_path / "tasks")
    run = dict(tasks=list(TASKS), task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
               bootstrap_iters=0, log_samples=True)
    ours = lm_eval.simple_evaluate(model=AttnResLM(pretrained=str(ck), device="cpu", batch_size=4), **run)
    stock = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={out},trust_remote_code=True,device=cpu", **run)
    for task in TASKS:
        a, b = ours["results"][task], stock["results"][task]
        for metric, value in a.items():
            if isinstance(value, float):
                assert b[metric] == pytest.approx(value, rel=1e-6, abs=1e-6), (task, metric)
        resp_a = [s["filtered_resps"] for s in ours["samples"][task]]
        resp_b = [s["filtered_resps"] for s in stock["samples"][task]]
        if task == "tiny_generate":
            assert resp_a == resp_b
        else:
            flat = lambda r: torch.tensor([x[0] if isinstance(x, (tuple, list)) else x for doc in r for x in doc])  # noqa: E731
            assert torch.allclose(flat(resp_a), flat(resp_b), rtol=0, atol=ATOL), task


def stand_in_gpt2():
    """A small tiktoken encoding with GPT-2's split pattern and a few merges: GPT-2's own BPE file
    needs the network. Each merged token's parts have lower ranks, as in a trained BPE."""
    import tiktoken

    ranks = {bytes([b]): b for b in range(256)}
    for token in (b"th", b"the", b" t", b" the", b"in", b"ing", b" a", b"he", b"llo", b"hello"):
        ranks[token] = len(ranks)
    pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding("gpt2", pat_str=pat, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)})


def test_a_gpt2_run_gets_tiktokens_encoding_as_a_fast_tokenizer(tmp_path, monkeypatch):
    tiktoken = pytest.importorskip("tiktoken", reason="GPT-2 runs' tokenizer comes from tiktoken (pip install -e '.[hf]')")
    enc = stand_in_gpt2()
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: enc)
    model = tiny("block", vocab_size=enc.n_vocab + 3)  # a vocabulary padded past the tokenizer's, as GPT-2 runs do
    attnres.save_pretrained(model, tmp_path / "ck")
    out = export(str(tmp_path / "ck"), str(tmp_path / "hf"), tokenizer="gpt2")
    tok = AutoTokenizer.from_pretrained(str(out))
    text = "hello there, the thing in the ring 42\n\n  ok"
    assert tok(text).input_ids == enc.encode_ordinary(text)
    assert tok.decode(tok(text).input_ids) == text
    assert tok.eos_token_id == tok.bos_token_id == enc.eot_token
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == enc.eot_token


def test_a_static_cache_is_refused_not_read_as_keys(tmp_path):
    _, out = exported(tmp_path, tiny("baseline"))
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    prompt = torch.tensor([[72, 101, 108]])
    with pytest.raises(ValueError, match="dynamic cache"):
        hf.generate(prompt, max_new_tokens=3, do_sample=False, cache_implementation="static")


def test_labels_and_a_cache_continued_by_hand(tmp_path):
    model = tiny("mhc")
    _, out = exported(tmp_path, model)
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    idx = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        # transformers' convention: labels are the inputs, shifted inside
        loss = hf(idx, labels=idx).loss
        assert torch.allclose(loss, model(idx[:, :-1], targets=idx[:, 1:])[1], rtol=0, atol=ATOL)
        first = hf(idx[:, :12], use_cache=True)
        name = "cache" if hasattr(first, "cache") else "past_key_values"  # the name transformers 5 gave it
        rest = hf(idx[:, 12:], use_cache=True, **{name: getattr(first, name)})
        whole = hf(idx).logits
    assert torch.allclose(torch.cat([first.logits, rest.logits], 1), whole, rtol=0, atol=ATOL)


@pytest.mark.parametrize("options", [dict(qkv_bias=True), dict(qk_norm=True), dict(qkv_bias=True, qk_norm=True)])
def test_qwen_style_attention_round_trips_and_generates_with_the_cache(tmp_path, options):
    """model.qkv_bias (Qwen2) and model.qk_norm (Qwen3): in config.json, reloaded with the run's logits
    (float32, ATOL) and greedy generate with the cache equal to attnres' own."""
    model = tiny("block", **options)
    with torch.no_grad():  # biases off zero and norm weights off one, so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight")):
                p.add_(0.3 * torch.randn_like(p))
    _, out = exported(tmp_path, model)
    saved = json.loads((out / "config.json").read_text())["attnres_model"]
    assert {k: saved[k] for k in options} == options
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = hf(idx).logits, model(idx)[0]
    assert torch.allclose(got, want, rtol=0, atol=ATOL), float((got - want).abs().max())
    prompt = torch.tensor([[72, 101, 108, 108, 111], [87, 111, 114, 108, 100]])
    cached = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
    assert cached.tolist() == model.generate(prompt, 10, temperature=0).tolist()
