"""model.init_from: a Llama/Qwen Hugging Face checkpoint as the first weights of a run of any variant
(harness/hf_import.py). Tiny random checkpoints are made by transformers itself; no download."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnres import DecoderLM, ModelConfig, ResidualConfig
from harness import hf_import
from harness.checkpoint import run_key
from harness.config import ConfigError, to_plain, validate

transformers = pytest.importorskip("transformers", reason="the checkpoints are made with transformers (pip install -e '.[hf]')")

from harness_testing import compose, run_cli  # noqa: E402

ATOL = 1e-5  # float32 logits of the imported baseline against the checkpoint's own
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64)


def checkpoint(folder: Path, kind: str = "llama", **overrides) -> tuple[Path, torch.nn.Module]:
    """A random tiny checkpoint of `kind` saved with save_pretrained (float32 safetensors)."""
    torch.manual_seed(0)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    model = model_cls(config_cls(**{**SHAPE, "head_dim": 8, **overrides})).eval()
    with torch.no_grad():  # norms off their all-ones init and biases off zero, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder, model


def imported(folder: Path, residual: str = "baseline", seed: int = 0) -> DecoderLM:
    shape = hf_import.shape_of(hf_import.read_config(folder))
    torch.manual_seed(seed)
    model = DecoderLM(ModelConfig(**shape, max_seq_len=64), ResidualConfig(name=residual, block_size=2))
    hf_import.load_into(model, folder)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_the_baseline_computes_what_the_llama_checkpoint_computes(tmp_path, tied):
    folder, hf = checkpoint(tmp_path / "llama", tie_word_embeddings=tied, rope_theta=500000.0)
    ours = imported(folder)
    assert ours.config.rope_theta == 500000.0 and ours.config.norm_eps == 1e-5 and ours.config.n_kv_heads == 2
    assert ours.config.tie_embeddings is tied
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(idx).logits, ours(idx)[0]
    assert torch.allclose(got, want, rtol=0, atol=ATOL), float((got - want).abs().max())


@pytest.mark.parametrize("kind, bias, norm", [("qwen2", True, False), ("qwen3", False, True)])
def test_the_baseline_computes_what_a_qwen_checkpoint_computes(tmp_path, kind, bias, norm):
    """Qwen2's q/k/v biases (model.qkv_bias) and Qwen3's per-head q/k RMSNorms before RoPE (model.qk_norm)."""
    folder, hf = checkpoint(tmp_path / kind, kind=kind, rope_theta=1000000.0)
    ours = imported(folder)
    assert (ours.config.qkv_bias, ours.config.qk_norm) == (bias, norm)
    attn = ours.sublayers[2].op
    assert (attn.q_proj.bias is not None, attn.q_norm is not None) == (bias, norm)
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(idx).logits, ours(idx)[0]
        assert torch.allclose(got, want, rtol=0, atol=ATOL), float((got - want).abs().max())
        cache = ours.kv_cache(2, 40)  # prefill then one token at a time: the same logits as one forward
        steps = [ours(idx[:, :30], cache=cache)[0]] + [ours(idx[:, t : t + 1], cache=cache)[0] for t in range(30, 40)]
    assert torch.allclose(torch.cat(steps, 1), want, rtol=0, atol=ATOL)


def test_a_sharded_bfloat16_checkpoint_imports_widened(tmp_path):
    """Shards (model.safetensors.index.json) and bf16 weights, widened exactly to the run's float32."""
    _, hf = checkpoint(tmp_path / "fp32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="40KB")
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    ours = imported(tmp_path / "bf16")
    widened = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    idx = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(ours(idx)[0], widened(idx).logits, rtol=0, atol=ATOL)


@pytest.mark.parametrize("residual", ["block", "full", "mhc", "denseformer"])
def test_other_variants_keep_their_own_init_and_take_every_other_weight(tmp_path, residual):
    folder, hf = checkpoint(tmp_path / "llama")
    ours = imported(folder, residual=residual, seed=3)
    torch.manual_seed(3)
    fresh = DecoderLM(ours.config, ours.residual_config)  # what the run builds before the import
    for name, value in ours.state_dict().items():
        if name.startswith("residual."):
            assert torch.equal(value, fresh.state_dict()[name]), name
    hf_state = hf.state_dict()
    assert torch.equal(ours.embed.weight, hf_state["model.embed_tokens.weight"])
    assert torch.equal(ours.sublayers[2].op.kv_proj.weight[:16], hf_state["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(ours.sublayers[3].op.gate_up.weight[64:], hf_state["model.layers.1.mlp.up_proj.weight"])


def test_what_decoderlm_cannot_hold_is_refused_in_one_line(tmp_path):
    qwen2, _ = checkpoint(tmp_path / "qwen2", kind="qwen2")
    with pytest.raises(hf_import.ImportRefused, match="bias") as error:  # a model built without model.qkv_bias
        hf_import.load_into(DecoderLM(ModelConfig(vocab_size=256, d_model=32, layers=2, n_heads=4, n_kv_heads=2, d_ff=64)), qwen2)
    assert "\n" not in str(error.value)
    for kind in ("llama", "qwen3"):  # attention_bias: o_proj's bias as well, which DecoderLM has no place for
        biased, _ = checkpoint(tmp_path / f"{kind}_bias", kind=kind, attention_bias=True)
        with pytest.raises(hf_import.ImportRefused, match="attention_bias"):
            hf_import.read_config(biased)
    windowed, _ = checkpoint(tmp_path / "qwen2_window", kind="qwen2", use_sliding_window=True, sliding_window=16)
    with pytest.raises(hf_import.ImportRefused, match="sliding"):
        hf_import.read_config(windowed)
    qwen3_wide, _ = checkpoint(tmp_path / "qwen3_wide", kind="qwen3", head_dim=16)
    with pytest.raises(hf_import.ImportRefused, match="head_dim"):
        hf_import.read_config(qwen3_wide)
    scaled, _ = checkpoint(tmp_path / "scaled", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(hf_import.ImportRefused, match="RoPE"):
        hf_import.read_config(scaled)
    wide, _ = checkpoint(tmp_path / "wide", head_dim=16)
    with pytest.raises(hf_import.ImportRefused, match="head_dim"):
        hf_import.read_config(wide)
    with pytest.raises(hf_import.ImportRefused, match="config.json"):
        hf_import.read_config(tmp_path / "nowhere")
    (tmp_path / "no_weights").mkdir()
    plain, _ = checkpoint(tmp_path / "plain")
    (tmp_path / "no_weights" / "config.json").write_text((plain / "config.json").read_text())
    with pytest.raises(hf_import.ImportRefused, match="safetensors"):
        hf_import.load_into(DecoderLM(ModelConfig()), tmp_path / "no_weights")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(hf_import.ImportRefused, match="model_type"):
        hf_import.read_config(tmp_path / "gpt2")


def test_the_run_takes_the_checkpoints_shape_and_a_key_of_its_own(tmp_path):
    folder, _ = checkpoint(tmp_path / "llama")
    plain_spec = validate(compose(["model=tiny", "train.device=cpu"]))
    assert not hasattr(plain_spec.cfg.model, "init_from")  # DecoderLM and what it saves: the core's config
    spec = validate(compose(["model=tiny", "train.device=cpu", f"model.init_from={folder}", "residual=block"]))
    m = spec.cfg.model
    assert (m.d_model, m.layers, m.n_heads, m.n_kv_heads, m.d_ff, m.norm_eps) == (32, 2, 4, 2, 64, 1e-5)
    assert m.init_from == str(folder.resolve())
    plain = to_plain(spec.cfg)
    assert plain["model"]["init_from"] == str(folder.resolve())
    again = to_plain(validate(compose(["model=tiny", "train.device=cpu", "residual=block"])).cfg)
    assert run_key(again) != run_key(plain)
    assert run_key(dict(again, model={**again["model"], "init_from": None})) == run_key(again)  # NEUTRAL at None


def test_bad_checkpoints_are_config_errors(tmp_path):
    folder, _ = checkpoint(tmp_path / "big_vocab", vocab_size=300)
    for override, match in ((f"model.init_from={tmp_path / 'nowhere'}", "nowhere"),
                            (f"model.init_from={folder}", "vocab_size=300")):
        with pytest.raises(ConfigError, match=match) as error:
            validate(compose(["model=tiny", "train.device=cpu", override]))
        assert "\n" not in str(error.value)


@pytest.mark.slow  # two run.py processes: most of a minute on a small machine
def test_run_py_continues_training_an_imported_checkpoint(tmp_path):
    folder, hf = checkpoint(tmp_path / "llama")
    common = ["model=tiny", "train.device=cpu", "train.steps=2", "train.batch_size=2", "train.seq_len=32",
              "train.eval_batches=1", "tracking.log_plots=false", "tracking.log_explorer=false"]
    done = run_cli([*common, f"model.init_from={folder}", "residual=block"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (last,) = (tmp_path / "ckpt").rglob("last.pt")
    trained = torch.load(last, map_location="cpu", weights_only=True)
    assert trained["config"]["model"]["init_from"] == str(folder.resolve())
    # two small AdamW steps from the checkpoint's weights, not from a random init (σ 0.02 apart)
    start = hf.state_dict()["model.embed_tokens.weight"]
    assert float((trained["model"]["embed.weight"] - start).abs().max()) < 0.01
    assert trained["model"]["residual.pseudo_queries"].abs().max() < 0.01  # Block's queries near their zero init
    bad = run_cli([*common, f"model.init_from={tmp_path / 'nowhere'}"], tmp_path)
    assert bad.returncode == 2
    assert str(tmp_path / "nowhere") in bad.stderr.strip().splitlines()[-1] and "Traceback" not in bad.stderr


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_an_imported_qwen_checkpoint_exports_with_the_checkpoints_logits(tmp_path, kind):
    """Import, save, export (its own reload check) and reload: transformers' model's logits (float32, ATOL)."""
    import attnres
    from evaluation.export import export

    folder, hf = checkpoint(tmp_path / kind, kind=kind)
    attnres.save_pretrained(imported(folder), tmp_path / "ck")
    out = export(str(tmp_path / "ck"), str(tmp_path / "hf"))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    idx = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(again(idx).logits, hf(idx).logits, rtol=0, atol=ATOL)
