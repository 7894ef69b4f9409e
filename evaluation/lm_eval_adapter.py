"""The lm-evaluation-harness model `attnres`: any checkpoint or MLflow run as an lm-eval LM.

    attnres-lm-eval --model attnres --model_args pretrained=<path or run id> --tasks hellaswag
    lm_eval.simple_evaluate(model=AttnResLM(pretrained=...), tasks=[...])     # in Python

Importing this module registers `attnres`, after lm-eval's own models: lm-eval fills its registry
from `lm_eval.models` only while it is empty, so registering first would hide `hf` and the rest.
Built on TemplateLM, which owns request tokenisation; this class only scores and generates.
"""
from __future__ import annotations

import warnings
from typing import Optional, Union

import lm_eval.models  # noqa: F401  (see below)
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from .tokenizer import prefix_id, tokenizer_for


@register_model("attnres")
class AttnResLM(TemplateLM):
    """An attnres DecoderLM for lm-eval.

    pretrained: a checkpoint folder or file, an MLflow run id or runs:/ URI, or a DecoderLM already
    in memory (then pass `config`, its config dict, for the tokenizer choice).
    tokenizer: "bytes" or "gpt2" to override the choice by vocabulary size, or a tokenizer object.
    """

    def __init__(
        self,
        pretrained: Union[str, torch.nn.Module],
        device: Optional[str] = None,
        batch_size: Union[int, str] = 16,
        max_batch_size: Optional[int] = None,
        max_length: Optional[int] = None,
        max_gen_toks: int = 256,
        tokenizer=None,
        prefix_token_id: Optional[int] = None,
        tracking_uri: Optional[str] = None,
        config: Optional[dict] = None,
        **unused,
    ) -> None:
        super().__init__()
        if unused:
            # lm-eval forwards generic settings to every model; say which ones do nothing here.
            warnings.warn(f"attnres: ignoring model arguments {sorted(unused)}", stacklevel=2)
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's CLI asks for cuda:0 unless told otherwise; the HF adapter falls back too.
            warnings.warn(f"attnres: device {device!r} requested but CUDA is not available; using the CPU", stacklevel=2)
            device = "cpu"
        if isinstance(pretrained, torch.nn.Module):
            model, config = pretrained, config or {}
            if device is not None:
                model = model.to(device)
        else:
            from attnres.io import load
            from harness.config import default_tracking_uri

            # A run id is read from run.py's store wherever lm_eval starts (not ./mlflow.db).
            model, config = load(str(pretrained), device=device, tracking_uri=tracking_uri or default_tracking_uri())
        self.model = model.eval()
        self.config = config
        self._device = next(model.parameters()).device
        self.tok = tokenizer if tokenizer is not None and not isinstance(tokenizer, str) else tokenizer_for(
            model.config.vocab_size, tokenizer
        )
        # "auto" asks HF models to probe memory; a fixed size is right for these small models.
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        if max_batch_size:
            self.batch_size = min(self.batch_size, int(max_batch_size))
        self.max_length = int(max_length or model.config.max_seq_len)
        if not 1 < self.max_length <= model.config.max_seq_len:
            raise ValueError(f"max_length={self.max_length} must be in 2..{model.config.max_seq_len} (the model's max_seq_len)")
        self.max_gen_toks = int(max_gen_toks)
        self._prefix = int(prefix_token_id) if prefix_token_id is not None else prefix_id(self.tok, config)

    # --- what TemplateLM needs ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"attnres-{self.tok.name}"

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tok.decode(tokens)

    def get_model_info(self) -> dict:
        counts = self.model.param_counts()
        return {
            "model_num_parameters": counts["total"],
            "attnres_variant": self.model.residual_config.name,
            "attnres_tokenizer": self.tok.name,
        }

    # --- scoring --------------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        # Longest first, so each batch pads little; answers go back in the original order.
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[Optional[tuple[float, bool]]] = [None] * len(requests)
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="attnres loglikelihood"):
            chunk = order[start : start + self.batch_size]
            inputs, spans = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                if not continuation:
                    raise ValueError("an empty continuation cannot be scored")
                if len(continuation) > self.max_length:
                    raise ValueError(f"a continuation of {len(continuation)} tokens does not fit the model's "
                                     f"window of max_length={self.max_length} tokens")
                # A context that encodes to nothing (lm-eval moves a whitespace-only context's
                # spaces to the continuation) is conditioned like an empty one: on the prefix token.
                whole = ((list(context) or [self.prefix_token_id]) + list(continuation))[-(self.max_length + 1):]
                inputs.append(whole[:-1])
                spans.append(len(continuation))
            width = max(len(x) for x in inputs)
            batch = torch.zeros(len(inputs), width, dtype=torch.long, device=self.device)
            for row, x in enumerate(inputs):
                batch[row, : len(x)] = torch.tensor(x, dtype=torch.long)  # right padding: causal, so harmless
            logprobs = F.log_softmax(self.model(batch)[0].float(), dim=-1)
            for row, i in enumerate(chunk):
                n, end = spans[row], len(inputs[row])
                target = torch.tensor(requests[i][2][-n:], dtype=torch.long, device=self.device)
                lp = logprobs[row, end - n : end]
                answer = (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="attnres rolling loglikelihood"):
            (text,) = req.args
            windows = [
                (None, context, continuation)
                for context, continuation in map(
                    make_disjoint_window,
                    get_rolling_token_windows(
                        token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length, context_len=1,
                    ),
                )
            ]
            total = sum(lp for lp, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="attnres generate"):
            context, gen_kwargs = req.args
            text = self._generate(context, dict(gen_kwargs or {}))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def _generate(self, context: str, kwargs: dict) -> str:
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        sample = bool(kwargs.pop("do_sample", False)) and temperature > 0
        # The whole window of context: each step reads the last max_length tokens anyway, so
        # reserving room for max_gen_toks (HF's rule) only threw context away; with the default
        # 256 new tokens and a 128-token model it kept one token of the prompt.
        ids = (self.tok_encode(context) or [self.prefix_token_id])[-self.max_length:]
        new: list[int] = []
        cache = self.model.kv_cache(1, self.max_length)
        for _ in range(max_new):
            seq = ids + new
            if len(seq) > self.max_length:
                # The window slid: every position moved, so its keys are recomputed, not reused.
                logits = self.model(torch.tensor([seq[-self.max_length:]], device=self.device))[0][0, -1].float()
            else:  # the prompt at once, then each new token from the cache
                step = seq[cache.length :]
                logits = self.model(torch.tensor([step], device=self.device), cache=cache)[0][0, -1].float()
            if sample:
                nxt = int(torch.multinomial(F.softmax(logits / temperature, dim=-1), 1))
            else:
                nxt = int(logits.argmax())
            if nxt == self.eot_token_id:
                break
            new.append(nxt)
            text = self.tok_decode(new)
            cut = min((text.find(s) for s in until if s and s in text), default=-1)
            if cut >= 0:
                return text[:cut]
        return self.tok_decode(new)
