"""An attnres DecoderLM as a Hugging Face causal LM (AutoModelForCausalLM with trust_remote_code).

This file is shipped inside every folder `python -m evaluation.export` writes. The network itself is
attnres' DecoderLM, imported from the installed `attnres` package rather than copied here: the core is
a package (residual variants, C and Triton kernels) that the remote-code loader, which copies single
files of one folder, cannot carry, and one copy of the numerics is what the tests check.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from attnres import DecoderLM, ModelConfig, ResidualConfig
except ImportError:  # a try block: transformers' own import check skips it and our one line is shown
    DecoderLM = ModelConfig = ResidualConfig = None

try:
    from transformers import DynamicCache
except ImportError:  # pragma: no cover  (every transformers this file supports has it)
    DynamicCache = None

MISSING_CORE = ("this model needs the `attnres` package (its DecoderLM): install the attnres project, "
                "e.g. pip install -e <its checkout> or pip install git+<its repository>")
_OUTPUT_FIELDS = set(CausalLMOutputWithPast.__dataclass_fields__)
_CACHE_FIELD = "cache" if "cache" in _OUTPUT_FIELDS else "past_key_values"  # renamed in transformers 5


def _require_core() -> None:
    if DecoderLM is None:
        raise ImportError(MISSING_CORE)


class AttnResConfig(PretrainedConfig):
    """attnres' ModelConfig and ResidualConfig as two dicts, and the usual names read from them."""

    model_type = "attnres"

    def __init__(self, attnres_model: Optional[dict] = None, attnres_residual: Optional[dict] = None, **kwargs):
        _require_core()
        self.attnres_model = dict(attnres_model or {})
        self.attnres_residual = dict(attnres_residual or {})
        m = ModelConfig(**self.attnres_model)
        ResidualConfig(**self.attnres_residual)  # a bad residual fails here, not at the first forward
        self.vocab_size, self.hidden_size, self.num_hidden_layers = m.vocab_size, m.d_model, m.layers
        self.num_attention_heads, self.num_key_value_heads = m.n_heads, m.n_kv_heads
        self.head_dim, self.intermediate_size = m.d_model // m.n_heads, m.d_ff
        self.max_position_embeddings, self.rope_theta, self.rms_norm_eps = m.max_seq_len, m.rope_theta, m.norm_eps
        kwargs["tie_word_embeddings"] = m.tie_embeddings
        super().__init__(**kwargs)


class _CacheView:
    """A transformers Cache seen as attnres' KVCache (check, update, length): DecoderLM.forward(cache=)."""

    def __init__(self, cache):
        self.cache, self.length = cache, cache.get_seq_length()

    def check(self, batch: int, new: int) -> None:
        pass  # a transformers cache grows as it is written

    def update(self, slot: int, k: torch.Tensor, v: torch.Tensor):
        return self.cache.update(k, v, slot)


class AttnResForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = AttnResConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLM"]  # the residual reads every sublayer's output: one device for all

    def __init__(self, config: AttnResConfig):
        _require_core()
        super().__init__(config)
        self.model = DecoderLM(ModelConfig(**config.attnres_model), ResidualConfig(**config.attnres_residual))
        if config.tie_word_embeddings:
            self._tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}
        self.post_init()

    def _init_weights(self, module):
        pass  # DecoderLM initialises itself (its residual at the paper's init); loading overwrites all

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids=None, cache=None, past_key_values=None, inputs_embeds=None,
                labels: Optional[torch.LongTensor] = None, use_cache: Optional[bool] = None,
                logits_to_keep: int = 0, return_dict: Optional[bool] = None, **kwargs):
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("attnres models take input_ids only (no inputs_embeds)")
        cache = cache if cache is not None else past_key_values
        if getattr(cache, "is_compileable", False):  # a static cache returns its whole buffer, zeros included
            raise ValueError("attnres models decode with transformers' dynamic cache only (not cache_implementation='static')")
        if cache is None and use_cache:
            cache = DynamicCache(config=self.config)
        _check_mask(attention_mask, cached=cache is not None)
        # positions come from the cache's length: position_ids agree with them for unpadded input
        logits, _ = self.model(input_ids, cache=None if cache is None else _CacheView(cache))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})


def _check_mask(mask: Optional[torch.Tensor], cached: bool) -> None:
    """DecoderLM attends to every position before a token: a mask may only drop trailing padding of a
    forward without a cache (right padding, whose logits nobody reads)."""
    if mask is None or bool(mask.all()):
        return
    right_padded = mask.dim() == 2 and bool((mask[:, 1:] <= mask[:, :-1]).all())
    if cached or not right_padded:
        raise ValueError("attnres models take no padding mask: a batch padded on the left (or a cached forward with "
                         "padding) would attend to the pads; generate one sequence at a time (lm-eval: batch_size=1) "
                         "or pad on the right without a cache")
