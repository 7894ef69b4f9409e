"""`model.init_from=<folder>`: a Llama- or Qwen-style Hugging Face checkpoint as the start of a run.

    python run.py model.init_from=path/to/llama residual=block

The folder's config.json gives the model's shape (d_model, layers, heads, d_ff, RoPE θ, RMSNorm ε,
tied embeddings; Qwen2's q/k/v biases as model.qkv_bias, Qwen3's per-head q/k norms as model.qk_norm);
its safetensors weights replace the embedding, every sublayer, the final norm and the head of the
run's freshly built DecoderLM, whose residual keeps its own init (the paper's). With residual=baseline
the model computes what the checkpoint does. Read with safetensors alone: no transformers needed.
Both families use the GPT-NeoX half-split RoPE layout (rotate_half), so q and k are
copied as they are. What DecoderLM cannot hold (an output-projection or MLP bias, scaled RoPE, sliding
windows, a head_dim other than d_model / n_heads) is refused in one line.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

MODEL_TYPES = ("llama", "qwen2", "qwen3")
CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME = "config.json", "model.safetensors", "model.safetensors.index.json"


class ImportRefused(ValueError):
    """A checkpoint that cannot start a run (one line: what, where, what is allowed)."""


def read_config(folder: str | Path) -> dict:
    """The checkpoint's config.json, checked to be one DecoderLM can hold."""
    root = Path(folder).expanduser()
    if not (root / CONFIG_NAME).is_file():
        raise ImportRefused(f"model.init_from={folder}: no {CONFIG_NAME} there; allowed: a Hugging Face checkpoint "
                            f"folder ({CONFIG_NAME} and {WEIGHTS_NAME}) of model_type {', '.join(MODEL_TYPES)}")
    try:
        config = json.loads((root / CONFIG_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ImportRefused(f"model.init_from={folder}: {CONFIG_NAME} is not readable JSON ({_one_line(e)})") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in MODEL_TYPES:
        raise ImportRefused(f"model.init_from={folder}: model_type={kind!r} is not importable; allowed: {', '.join(MODEL_TYPES)}")
    _check_architecture(config, folder)
    return config


def _check_architecture(c: dict, where: Any) -> None:
    def refuse(what: str) -> None:
        raise ImportRefused(f"model.init_from={where}: {what}, which DecoderLM cannot hold")

    if c.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act={c['hidden_act']!r} (DecoderLM's MLP is SwiGLU: silu)")
    for key in ("attention_bias", "mlp_bias"):  # attention_bias biases o_proj too (Qwen2's q/k/v biases are not it)
        if c.get(key):
            refuse(f"{key}=true")
    if c.get("use_sliding_window"):
        refuse(f"sliding-window attention (sliding_window={c.get('sliding_window')})")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        refuse(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} (DecoderLM's RoPE is unscaled)")
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads) or c["hidden_size"] % heads:
        refuse(f"head_dim={c.get('head_dim')} with hidden_size={c['hidden_size']} and {heads} heads "
               "(DecoderLM's head_dim is hidden_size / heads)")


def shape_of(config: dict) -> dict:
    """The ModelConfig fields the checkpoint fixes."""
    rope = config.get("rope_parameters") or {}
    return {
        "vocab_size": config["vocab_size"], "d_model": config["hidden_size"], "layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "d_ff": config["intermediate_size"], "rope_theta": float(rope.get("rope_theta", config.get("rope_theta") or 10000.0)),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)), "prenorm_eps": None, "final_norm_eps": None,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "qkv_bias": config["model_type"] == "qwen2", "qk_norm": config["model_type"] == "qwen3",
    }


def run_model_config(model, data_vocab: int):
    """The run's model config with the checkpoint's shape and init_from made absolute; the checkpoint's
    weights are checked to be there and importable (names only: the tensors are read when training starts)."""
    folder = Path(model.init_from).expanduser().resolve()
    config = read_config(folder)
    shape = shape_of(config)
    if shape["vocab_size"] != model.vocab_size or shape["vocab_size"] < data_vocab:
        raise ImportRefused(
            f"model.init_from={model.init_from}: vocab_size={shape['vocab_size']} differs from this run's "
            f"model.vocab_size={model.vocab_size} (data.vocab_size={data_vocab}); allowed: a checkpoint trained with the "
            "run's tokenizer, or model.vocab_size set to the checkpoint's when its tokenizer is the data's")
    _check_names(_weight_names(folder), shape, folder)
    return replace(model, init_from=str(folder), **shape)


def load_into(model: torch.nn.Module, folder: str | Path) -> None:
    """Copy the checkpoint's weights into DecoderLM `model` (in place: an optimizer built on it keeps
    its parameters); the residual's parameters are left as they are."""
    folder = Path(folder)
    config = read_config(folder)
    shape = shape_of(config)
    state = _read_tensors(folder)
    _check_names(set(state), shape, folder)
    ours = _converted(state, shape)
    target = {k: v for k, v in model.state_dict().items() if not k.startswith("residual.")}
    if shape["tie_embeddings"]:
        target.pop("lm_head.weight", None)
    missing, unplaced = sorted(set(target) - set(ours)), sorted(set(ours) - set(target))
    if missing:
        raise ImportRefused(f"model.init_from={folder}: no weights for {', '.join(missing[:4])}")
    if unplaced:  # a model built without the checkpoint's qkv_bias / qk_norm (run_model_config sets them)
        raise ImportRefused(f"model.init_from={folder}: the model has no {unplaced[0]}; allowed: a model built with "
                            f"qkv_bias={shape['qkv_bias']}, qk_norm={shape['qk_norm']} as the checkpoint")
    with torch.no_grad():
        for name, value in ours.items():
            if tuple(value.shape) != tuple(target[name].shape):
                raise ImportRefused(f"model.init_from={folder}: {name} has shape {tuple(value.shape)}, "
                                    f"the run's model {tuple(target[name].shape)}")
            target[name].copy_(value)


def _converted(state: dict[str, torch.Tensor], shape: dict) -> dict[str, torch.Tensor]:
    """Hugging Face names and layout → DecoderLM's: k and v fused as kv_proj, gate and up as gate_up."""
    out = {"embed.weight": state["model.embed_tokens.weight"], "norm.weight": state["model.norm.weight"]}
    if not shape["tie_embeddings"]:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(shape["layers"]):
        hf, attn, mlp = f"model.layers.{i}.", f"sublayers.{2 * i}.", f"sublayers.{2 * i + 1}."
        out[attn + "norm.weight"] = state[hf + "input_layernorm.weight"]
        out[attn + "op.q_proj.weight"] = state[hf + "self_attn.q_proj.weight"]
        out[attn + "op.kv_proj.weight"] = torch.cat([state[hf + "self_attn.k_proj.weight"], state[hf + "self_attn.v_proj.weight"]])
        out[attn + "op.out_proj.weight"] = state[hf + "self_attn.o_proj.weight"]
        if shape["qkv_bias"]:
            out[attn + "op.q_proj.bias"] = state[hf + "self_attn.q_proj.bias"]
            out[attn + "op.kv_proj.bias"] = torch.cat([state[hf + "self_attn.k_proj.bias"], state[hf + "self_attn.v_proj.bias"]])
        if shape["qk_norm"]:
            out[attn + "op.q_norm.weight"] = state[hf + "self_attn.q_norm.weight"]
            out[attn + "op.k_norm.weight"] = state[hf + "self_attn.k_norm.weight"]
        out[mlp + "norm.weight"] = state[hf + "post_attention_layernorm.weight"]
        out[mlp + "op.gate_up.weight"] = torch.cat([state[hf + "mlp.gate_proj.weight"], state[hf + "mlp.up_proj.weight"]])
        out[mlp + "op.down.weight"] = state[hf + "mlp.down_proj.weight"]
    return out


def _expected_names(shape: dict) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if shape["tie_embeddings"] else {"lm_head.weight"})
    for i in range(shape["layers"]):
        names |= {f"model.layers.{i}.{k}.weight" for k in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        if shape["qkv_bias"]:
            names |= {f"model.layers.{i}.self_attn.{k}_proj.bias" for k in "qkv"}
        if shape["qk_norm"]:
            names |= {f"model.layers.{i}.self_attn.{k}_norm.weight" for k in "qk"}
    return names


def _check_names(names: set[str], shape: dict, folder: Path) -> None:
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding): harmless.
    extra = sorted(names - _expected_names(shape) - {"lm_head.weight"})
    if extra:
        raise ImportRefused(f"model.init_from={folder}: {extra[0]} ({len(extra)} such tensors) has no place in DecoderLM; "
                            "allowed: Llama's tensors, with Qwen2's q/k/v biases or Qwen3's q/k norms")
    missing = sorted(_expected_names(shape) - names)
    if missing:
        raise ImportRefused(f"model.init_from={folder}: the weights lack {missing[0]} ({len(missing)} tensors missing)")


def _weight_files(folder: Path) -> list[Path]:
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    if (folder / INDEX_NAME).is_file():
        try:
            shards = sorted(set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ImportRefused(f"model.init_from={folder}: {INDEX_NAME} is not a readable index ({_one_line(e)})") from None
        return [folder / s for s in shards]
    raise ImportRefused(f"model.init_from={folder}: no {WEIGHTS_NAME} or {INDEX_NAME}; allowed: safetensors "
                        "weights (save_pretrained's default; .bin files are not read)")


def _weight_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                names |= set(f.keys())
        except Exception as e:  # safetensors raises its own error types for a missing or corrupt file
            raise ImportRefused(f"model.init_from={folder}: {path.name} is not a readable safetensors file ({_one_line(e)})") from None
    return names


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        try:
            state.update(load_file(str(path)))
        except Exception as e:
            raise ImportRefused(f"model.init_from={folder}: {path.name} is not a readable safetensors file ({_one_line(e)})") from None
    return {k: v.float() for k, v in state.items()}  # bf16/fp16 checkpoints widen exactly; the run trains in fp32


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]

