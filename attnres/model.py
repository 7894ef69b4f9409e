"""A small decoder-only language model whose residual stream belongs to a pluggable variant.

The model owns the embedding, the flat list of sublayers (attention, MLP, attention, MLP, …), the
final RMSNorm and the LM head; the residual module owns everything in between, so the model never
writes `x = x + f(x)`. Parameter and FLOP counting are methods of the model, so the harness and
the analysis never re-derive them.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, ResidualConfig, positive_int
from .instrumentation import DepthRecorder
from .layers import KVCache, RMSNorm, Sublayer
from .residuals import build_residual


class DecoderLM(nn.Module):
    def __init__(self, model: ModelConfig, residual: Optional[ResidualConfig] = None):
        super().__init__()
        self.config, self.residual_config = model, residual or ResidualConfig()
        d = model.d_model
        self.embed = nn.Embedding(model.vocab_size, d)
        self.sublayers = nn.ModuleList(
            Sublayer(kind, model) for _ in range(model.layers) for kind in ("attn", "mlp")
        )
        self.residual = build_residual(self.residual_config, d, model.sublayers, eps=model.eps("residual_norm"))
        self.norm = RMSNorm(d, eps=model.eps("final_norm"))
        self.lm_head = nn.Linear(d, model.vocab_size, bias=False)
        if model.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 style: N(0, σ²) for matrices, output projections scaled by 1/sqrt(L) (sublayers).
        The residual module keeps its own init (zero queries, identity mixing, …)."""
        std, embed_std = self.config.init_std, self.config.embed_std
        nn.init.normal_(self.embed.weight, std=std if embed_std is None else embed_std)
        if not self.config.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        for name, p in self.sublayers.named_parameters():
            if p.dim() == 2:
                scaled = name.endswith(("out_proj.weight", "down.weight"))
                nn.init.normal_(p, std=std / math.sqrt(self.config.sublayers) if scaled else std)
            elif name.endswith(".bias"):  # model.qkv_bias: zero, not nn.Linear's uniform draw
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None):
        """Logits (B, T, vocab) for token ids idx (B, T), and the loss when targets are given.
        With a `cache` (`kv_cache`), idx continues the sequences the cache holds: positions start at
        its length, the attention reads the cached keys and values, and the cache grows by T."""
        x = self.embed(idx)
        if cache is None:
            h = self.residual(x, self.sublayers)  # the residual variant owns the stream
        else:
            cache.check(idx.shape[0], idx.shape[1])
            # only the attention sublayers see the cache: the residual's depth reads are per position
            slots = {i: n for n, i in enumerate(i for i, s in enumerate(self.sublayers) if s.kind == "attn")}
            fns = [functools.partial(s, cache=cache, slot=slots[i]) if i in slots else s for i, s in enumerate(self.sublayers)]
            h = self.residual(x, fns)
            cache.length += idx.shape[1]
        logits = self.lm_head(self.norm(h))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    # --- decoding --------------------------------------------------------------------------------
    def kv_cache(self, batch: int, max_len: Optional[int] = None) -> KVCache:
        """An empty cache of every attention layer's keys and values for `batch` sequences of up to
        `max_len` positions (default: the model's max_seq_len)."""
        c = self.config
        return KVCache(c.layers, batch, c.max_seq_len if max_len is None else max_len, c.n_kv_heads, c.d_model // c.n_heads)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """idx (B, T) followed by max_new_tokens sampled tokens, (B, T + max_new_tokens): one
        prefill of the prompt, then one cached forward per token. temperature 0 is greedy; top_k
        keeps the k likeliest tokens; `generator` makes the sampling repeatable. Prompt and new
        tokens together must fit max_seq_len, the positions the model was built for."""
        if max_new_tokens != 0:
            positive_int("max_new_tokens", max_new_tokens, "tokens to sample; 0 returns the prompt")
        if not 0 <= float(temperature) < float("inf"):
            raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0: greedy)")
        if top_k is not None:
            positive_int("top_k", top_k, "the likeliest tokens to sample from; None: all")
        if idx.dim() != 2 or idx.shape[1] < 1:
            raise ValueError(f"idx must be token ids of shape (batch, T >= 1), got shape {tuple(idx.shape)}")
        total = idx.shape[1] + max_new_tokens
        if total > self.config.max_seq_len:
            raise ValueError(f"a prompt of {idx.shape[1]} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                             f"max_seq_len={self.config.max_seq_len}")
        cache, out, step = self.kv_cache(idx.shape[0], total), [idx], idx
        for _ in range(max_new_tokens):
            logits = self(step, cache=cache)[0][:, -1].float()
            if temperature == 0:
                step = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = logits.topk(top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                step = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            out.append(step)
        return torch.cat(out, dim=1)

    # --- accounting ------------------------------------------------------------------------------
    def param_counts(self) -> dict[str, int]:
        """Parameters by group: embedding (token embedding and LM head), residual (the mixing
        overhead of the variant), non_embedding (everything but the embedding group), total."""
        unique = {id(p): p for p in self.parameters()}
        total = sum(p.numel() for p in unique.values())
        embedding = sum(p.numel() for p in {id(p): p for p in (self.embed.weight, self.lm_head.weight)}.values())
        residual = sum(p.numel() for p in self.residual.parameters())
        return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "residual": residual}

    def flops_per_token(self, seq_len: int) -> dict[str, int]:
        """Analytic training FLOPs per token (forward + backward = 3 × forward).

        matmul: 6 × the weights of every matrix multiply (sublayers and LM head; the embedding is a
        lookup). attention: QKᵀ and AV over the full T×T square, 4·T·d forward per Transformer block,
        as FlopCounterMode counts SDPA (PaLM's convention; causal masking would halve it).
        residual: the variant's mixing (depth reads, stream mixing, additions).
        """
        c = self.config
        matmul_weights = sum(p.numel() for n, p in self.sublayers.named_parameters() if p.dim() == 2)
        matmul_weights += self.lm_head.weight.numel()
        out = {
            "matmul": 6 * matmul_weights,
            "attention": 3 * 4 * seq_len * c.n_heads * (c.d_model // c.n_heads) * c.layers,
            "residual": 3 * self.residual.mixing_flops_per_token(),
        }
        out["total"] = sum(out.values())
        return out

    # --- instrumentation ----------------------------------------------------------------------------
    @torch.no_grad()
    def inspect(self, idx: torch.Tensor) -> dict:
        """One forward pass with the depth recorder on: depth weights averaged over tokens and each
        reader's per-token entropy of them (None for variants without them), hidden-state and
        output RMS per sublayer and per Transformer block."""
        rec = DepthRecorder()
        self.residual.recorder = rec
        try:
            self(idx)
        finally:
            self.residual.recorder = None
        out_rms = torch.tensor(rec.output_rms, dtype=torch.float64).view(-1, 2)
        return {
            "depth_weights": None if rec.weights is None else rec.weights.tolist(),
            "depth_entropy": None if rec.entropy is None else rec.entropy.tolist(),
            "sublayer_kind": [s.kind for s in self.sublayers] + ["out"],
            "hidden_rms_sublayer": rec.hidden_rms,
            "output_rms_sublayer": rec.output_rms,
            "hidden_rms_block": rec.hidden_rms[::2],
            "output_rms_block": out_rms.pow(2).mean(1).sqrt().tolist(),
        }

    def grad_norm_per_block(self) -> list[float]:
        """L2 norm of the gradients of each Transformer block's parameters (after backward)."""
        norms = []
        for b in range(self.config.layers):
            sq = 0.0
            for sub in self.sublayers[2 * b : 2 * b + 2]:
                for p in sub.parameters():
                    if p.grad is not None:
                        sq += float(p.grad.detach().double().pow(2).sum())
            norms.append(math.sqrt(sq))
        return norms

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices of the sublayers, embedding and head only; none on norms, and
        none on the residual's mixing parameters (queries decayed to zero would pull every read
        back to the plain mean)."""
        decay, no_decay = {}, {}
        residual_ids = {id(p) for p in self.residual.parameters()}
        for p in self.parameters():
            target = decay if p.dim() >= 2 and id(p) not in residual_ids else no_decay
            target[id(p)] = p
        return [
            {"params": list(decay.values()), "weight_decay": weight_decay},
            {"params": list(no_decay.values()), "weight_decay": 0.0},
        ]
