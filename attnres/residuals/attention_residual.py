"""Attention Residuals (Kimi Team, 2026): each sublayer reads earlier outputs through softmax
attention over depth. One class covers the whole family of the paper's ablation through five
orthogonal knobs:

- sources: "full" (every earlier output v_i), "window" (the embedding plus the `window` most
  recent outputs: the paper's W = 1 + window), "block" (completed block sums b_0..b_{n-1} plus
  the running partial sum b_n^{i-1});
- query: "static" (a learned pseudo-query per sublayer, zero-initialised), "input" (projected from
  the hidden state, see below), "scalar" (a learned logit per (reader, source), no query or key);
- key_norm: RMSNorm on keys (with its own gain per reader) or raw keys;
- normaliser: "softmax" or "sigmoid" (renormalised, see depth_attention.normalise_scores);
- heads: channel groups with their own normalisation over depth.

Design decisions where the paper is silent:
- input-dependent query: the query of sublayer l is W_l·h_{l-1}, a projection of the hidden state
  that the previous sublayer read (for the first sublayer, the embedding). h_l itself is what the
  read computes, so the latest state that exists when sublayer l reads is h_{l-1}; it is
  per-token, causal, and with W_l zero-initialised the variant starts as Full AttnRes. The output
  read keeps a static query.
- multi-head: the key norm uses the rms of all d channels (one rms per source, shared by every
  head and every reader, as in the single-head kernel); each group of d/H channels scores with its
  slice of the query.
- block with L not a multiple of S: the last block takes the remainder (the paper's rule).

Speed without changing the math: RMSNorm_l(v)·w_l = (g_l∘w_l)·v / rms(v). Each source's 1/rms is
computed once, shared by all its readers; sources are never stacked. How the reads run is chosen
in `attnres.kernels` (see kernels/readers.py): the Triton kernels on CUDA, the C kernels on CPU
in eager mode, the PyTorch path elsewhere (for static queries, a completed source is scored for
all its readers by one matmul; under torch.compile Inductor fuses it);
for static queries with block or full sources, the two-phase schedule of the paper's Algorithm 1
(phase 1 reads the sources completed before a chunk of sublayers once for all of them, phase 2
merges each sublayer's newer sources by online softmax). Every path and schedule computes the same
function (tests/test_kernels.py); forcing one: ATTNRES_KERNEL, ATTNRES_SCHEDULE. Every path gives
first derivatives; a second derivative through the reads (create_graph=True) raises on all of
them (kernels/ops.py), where the functional reference `attnres.depth_read` has any order.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import nn

from .. import kernels
from ..depth_attention import NORMALISERS
from .base import Residual, SublayerFn, check_positive_int

SOURCES = ("full", "window", "block")
QUERIES = ("static", "input", "scalar")


class AttentionResidual(Residual):
    has_depth_weights = True

    def __init__(
        self,
        d_model: int,
        num_layers: int,
        *,
        sources: str = "full",
        block_size: Optional[int] = None,
        window: Optional[int] = None,
        query: str = "static",
        key_norm: bool = True,
        normaliser: str = "softmax",
        heads: int = 1,
        eps: float = 1e-6,
    ):
        super().__init__(d_model, num_layers)
        _check_choice("sources", sources, SOURCES)
        _check_choice("query", query, QUERIES)
        _check_choice("normaliser", normaliser, NORMALISERS)
        if heads < 1 or d_model % heads:
            raise ValueError(f"heads={heads} must be a positive divisor of d_model={d_model}")
        if sources == "block" and not (block_size and 1 <= block_size <= num_layers):
            raise ValueError(f"block_size={block_size} must be between 1 and num_layers={num_layers} (it counts sublayers)")
        if sources == "window" and not (window and window >= 1):
            raise ValueError(f"window={window} must be a positive number of recent sublayer outputs")
        self.sources, self.query_kind, self.key_norm = sources, query, key_norm
        self.normaliser, self.heads, self.eps = normaliser, heads, eps
        self.block_size = block_size if sources == "block" else 1
        self.window = window
        self.num_columns = (math.ceil(num_layers / self.block_size) if sources == "block" else num_layers) + 1

        L, d = num_layers, d_model
        if query == "scalar":
            # Rows: the L sublayers then the output read; columns: sources. Zero: the plain mean.
            self.mixing_logits = nn.Parameter(torch.zeros(L + 1, self.num_columns))
            self.key_norm = False  # no keys to normalise
        else:
            if query == "static":
                self.pseudo_queries = nn.Parameter(torch.zeros(L, d))
            self.output_query = nn.Parameter(torch.zeros(d))
            if key_norm:
                self.key_norms = nn.ModuleList(nn.RMSNorm(d, eps=eps) for _ in range(L))
                self.output_norm = nn.RMSNorm(d, eps=eps)
        if query == "input":
            self.query_projections = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(L))
        self.reset_parameters()

    def extra_repr(self) -> str:
        where = {"block": f", block_size={self.block_size}", "window": f", window={self.window}"}.get(self.sources, "")
        return (f"{super().extra_repr()}, sources={self.sources}{where}, query={self.query_kind}, "
                f"key_norm={self.key_norm}, normaliser={self.normaliser}, heads={self.heads}")

    def reset_parameters(self) -> None:
        """The paper's init: zero queries (every read starts as the plain mean of its sources),
        key-norm gains 1; zero input-query projections and scalar logits. nn.Module's convention,
        so that a module built on the meta device gets it back after `to_empty` (FSDP, torchtitan).
        Call it after the submodules' own reset_parameters: nn.Linear's would not zero a projection."""
        with torch.no_grad():
            for name in ("pseudo_queries", "output_query", "mixing_logits"):
                p = getattr(self, name, None)
                if p is not None:
                    p.zero_()
            for proj in getattr(self, "query_projections", []):
                proj.weight.zero_()
            if hasattr(self, "key_norms"):
                for norm in [*self.key_norms, self.output_norm]:
                    norm.reset_parameters()

    # --- structure -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.num_columns - 1 if self.sources == "block" else self.num_layers

    def block_ends(self, l: int) -> bool:
        """Whether sublayer l (0-based) closes its block: every S, and the last one (remainder)."""
        return (l + 1) % self.block_size == 0 or l == self.num_layers - 1

    def visibility(self) -> torch.Tensor:
        L, C = self.num_layers, self.num_columns
        visible = torch.zeros(L + 1, C, dtype=torch.bool)
        for l in range(L + 1):
            if self.sources == "block":
                done = l // self.block_size if l < L else C - 1  # completed blocks before reader l
                visible[l, : done + 1] = True
                if l < L and l % self.block_size:  # the partial sum of the current block
                    visible[l, done + 1] = True
            else:
                visible[l, : l + 1] = True
                if self.sources == "window":
                    visible[l, 1 : max(1, l + 1 - self.window)] = False
        return visible

    # --- the stream ----------------------------------------------------------------------------
    def effective_queries(self) -> torch.Tensor:
        """Query ∘ key-norm gain per static reader: (L+1, d), rows the sublayers then the output
        read; with input-dependent queries only the output read is static: (1, d)."""
        if self.query_kind == "input":
            q, norms = self.output_query[None], [self.output_norm] if self.key_norm else []
        else:
            q = torch.cat([self.pseudo_queries, self.output_query[None]])
            norms = list(self.key_norms) + [self.output_norm] if self.key_norm else []
        if norms:
            q = q * torch.stack([n.weight for n in norms])
        return q

    def first_readers(self) -> list[int]:
        """For each column, the first reader that sees it (readers: the L sublayers, then the
        output read L): a completed source's scores are only computed for the readers from there
        on. Plain integers, so that torch.compile traces no data-dependent shapes."""
        if self.sources == "block":  # block c closes after sublayer c·S − 1 (the last one: L − 1)
            return [0] + [min(c * self.block_size, self.num_layers) for c in range(1, self.num_columns)]
        return list(range(self.num_columns))  # the output of sublayer c − 1 is first read by sublayer c

    def last_readers(self) -> list[int]:
        """For each column, the last reader that sees it: the output read L, except in a sliding
        window, where the output of sublayer c − 1 leaves the window after reader c + W − 1."""
        L = self.num_layers
        if self.sources == "window":
            return [L] + [min(c + self.window - 1, L) for c in range(1, self.num_columns)]
        return [L] * self.num_columns

    def stream(self, embedding: torch.Tensor, sublayers: Sequence[SublayerFn], want_weights: bool):
        # The read path (PyTorch, Triton or C kernels) and the Block schedule (per read or two-phase)
        # are chosen in attnres.kernels; every combination computes the same model.
        reader = kernels.make_reader(self, embedding, want_weights)
        reader.add(embedding)
        partial: Optional[torch.Tensor] = None
        prev_h = embedding
        rows: list[torch.Tensor] = []
        visible = self.visibility() if want_weights else None  # once per pass, not per read
        for l, f in enumerate(sublayers):
            h, alpha = reader.read(l, partial, prev_h)
            v = f(h)
            self.observe(h, v)
            prev_h = h
            if want_weights:
                rows.append(self._row(alpha, visible[l], h))
            if self.sources == "block":
                partial = v if partial is None else partial + v
                if self.block_ends(l):
                    reader.add(partial)
                    partial = None
            else:
                reader.add(v)
        out, alpha = reader.read(self.num_layers, None, prev_h)
        if want_weights:
            rows.append(self._row(alpha, visible[self.num_layers], out))
        return out, (torch.stack(rows) if want_weights else None)

    def _row(self, alpha, visible_columns: torch.Tensor, like) -> torch.Tensor:
        """Scatter one read's weights (mean over heads) into the (B, T, columns) layout."""
        row = like.new_zeros(*like.shape[:-1], self.num_columns)
        vis = visible_columns.nonzero().flatten().tolist()
        row[..., vis] = alpha.mean(-2).expand(*like.shape[:-1], -1).to(row.dtype)
        return row

    def mixing_flops_per_token(self) -> int:
        """Per read: an axpy per visible source (2·n·d) and the normaliser (5·n per head: each head
        normalises over the sources on its own); a dot product per
        visible source (2·n·d) unless the scores are learned scalars (full_scalar); the rms of every
        new source or partial sum (3·d) only with key norms; Block's running partial sums (d per
        sublayer after the first of its block); input queries add their d×d projection."""
        d, L = self.d_model, self.num_layers
        n = int(self.visibility().sum())
        flops = 2 * d * n + 5 * n * self.heads
        if self.query_kind != "scalar":
            flops += 2 * d * n
        if self.key_norm:
            flops += 3 * d * (L + 1)
        if self.sources == "block":
            flops += d * (L - self.num_blocks)
        if self.query_kind == "input":
            flops += 2 * d * d * L
        return flops


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: {', '.join(allowed)}")


class FullAttentionResidual(AttentionResidual):
    """Full AttnRes as a drop-in module: every sublayer reads the embedding and every earlier
    output; `out` is one more read over all L+1 sources. num_layers counts sublayers."""

    def __init__(self, d_model: int, num_layers: int, eps: float = 1e-6):
        super().__init__(d_model, num_layers, sources="full", eps=eps)


class BlockAttentionResidual(AttentionResidual):
    """Block AttnRes as the PyTorch RFC's drop-in module (num_layers counts sublayers).

    Unlike the RFC sketch it follows the paper: the first sublayer of a block reads no (all-zero)
    partial source, the embedding is a source of its own, and `out` is the final read over all
    N+1 block representations rather than the last partial sum. The RFC's form requires that
    num_blocks divide num_layers; the model's `block` variant (block_size) allows a remainder.

    `res(embedding, sublayers)` (Residual.forward): each sublayer is h -> f(h) with its own PreNorm,
    no residual add; the result goes to your final norm. Give its parameters no weight decay:
    decayed pseudo-queries pull every read back to the plain mean (DecoderLM.optimizer_groups).
    """

    def __init__(self, d_model: int, num_layers: int, num_blocks: int, eps: float = 1e-6):
        check_positive_int("num_layers", num_layers, "it counts sublayers")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1 or num_layers % num_blocks:
            raise ValueError(
                f"num_blocks={num_blocks!r} must divide num_layers={num_layers} (both count sublayers); allowed: "
                + ", ".join(str(n) for n in range(1, num_layers + 1) if num_layers % n == 0)
            )
        super().__init__(d_model, num_layers, sources="block", block_size=num_layers // num_blocks, eps=eps)
