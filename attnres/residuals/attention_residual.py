"""Attention Residuals (Kimi Team, 2026): each sublayer reads the earlier outputs through softmax
attention over depth. One class covers the paper's whole ablation family through five knobs:

- sources: "full" (the embedding and every earlier output), "window" (the embedding and the
  `window` most recent outputs), "block" (the embedding, the completed block sums and the
  running partial sum of the current block);
- query: "static" (a learned pseudo-query per reader), "input" (projected from the hidden state
  the previous sublayer read), "scalar" (a learned logit per reader and source, no keys);
- key_norm (RMSNorm on keys, a gain per reader), normaliser ("softmax" or renormalised
  "sigmoid"), heads (channel groups with their own normalisation over depth).

The equations and the choices where the paper is silent: docs/MATH.md.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .. import kernels
from ..depth_attention import NORMALISERS, depth_read, logits, read_chunk
from .base import Residual, check_positive_int

SOURCES = ("full", "window", "block")
QUERIES = ("static", "input", "scalar")
FULL_CHUNK = 8  # sublayers per phase-one read of Full (Block reads a block); the fastest on the C path


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: {', '.join(allowed)}")


class AttentionResidual(Residual):
    has_depth_weights = True

    def __init__(self, d_model: int, num_layers: int, *, sources: str = "full", block_size: Optional[int] = None,
                 window: Optional[int] = None, query: str = "static", key_norm: bool = True,
                 normaliser: str = "softmax", heads: int = 1, eps: float = 1e-6):
        super().__init__(d_model, num_layers)
        _check_choice("sources", sources, SOURCES)
        _check_choice("query", query, QUERIES)
        _check_choice("normaliser", normaliser, NORMALISERS)
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or d_model % heads:
            raise ValueError(f"heads={heads!r} must be a positive divisor of d_model={d_model}")
        if sources == "block" and not (isinstance(block_size, int) and 1 <= block_size <= num_layers):
            raise ValueError(f"block_size={block_size!r} must be between 1 and num_layers={num_layers} (it counts sublayers)")
        if sources == "window" and not (isinstance(window, int) and window >= 1):
            raise ValueError(f"window={window!r} must be a positive number of recent sublayer outputs")
        self.sources, self.query_kind, self.normaliser, self.heads, self.eps = sources, query, normaliser, heads, eps
        self.key_norm = key_norm and query != "scalar"  # scalar logits have no keys to normalise
        self.block_size = block_size if sources == "block" else 1
        self.window = window
        self.num_columns = (math.ceil(num_layers / self.block_size) if sources == "block" else num_layers) + 1
        self.chunk = self.block_size if sources == "block" else FULL_CHUNK

        L, d = num_layers, d_model
        if query == "scalar":  # rows: the L sublayers, then the output read; columns: sources
            self.mixing_logits = nn.Parameter(torch.zeros(L + 1, self.num_columns))
        else:
            if query == "static":
                self.pseudo_queries = nn.Parameter(torch.zeros(L, d))
            self.output_query = nn.Parameter(torch.zeros(d))
            if self.key_norm:
                self.key_norms = nn.ModuleList(nn.RMSNorm(d, eps=eps) for _ in range(L))
                self.output_norm = nn.RMSNorm(d, eps=eps)
        if query == "input":
            self.query_projections = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(L))
        self.columns = [self._visible_columns(l) for l in range(L + 1)]  # in the order `visible` lists them
        self.reset_parameters()

    def extra_repr(self) -> str:
        where = {"block": f", block_size={self.block_size}", "window": f", window={self.window}"}.get(self.sources, "")
        return (f"{super().extra_repr()}, sources={self.sources}{where}, query={self.query_kind}, "
                f"key_norm={self.key_norm}, normaliser={self.normaliser}, heads={self.heads}")

    def reset_parameters(self) -> None:
        """The paper's init: zero queries (every read starts as the plain mean of its sources), gains
        1, zero query projections and scalar logits. Call it after the submodules' own resets (for a
        model built on the meta device): nn.Linear's would not zero a projection."""
        with torch.no_grad():
            for name in ("pseudo_queries", "output_query", "mixing_logits"):
                if hasattr(self, name):
                    getattr(self, name).zero_()
            for proj in getattr(self, "query_projections", []):
                proj.weight.zero_()
            if self.key_norm:
                for norm in [*self.key_norms, self.output_norm]:
                    norm.reset_parameters()

    # --- structure -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.num_columns - 1 if self.sources == "block" else self.num_layers

    def block_ends(self, l: int) -> bool:
        """Whether sublayer l closes its block: every S, and the last one (which takes a remainder)."""
        return (l + 1) % self.block_size == 0 or l == self.num_layers - 1

    def _visible_columns(self, l: int) -> list[int]:
        """The columns reader l sees (readers: the L sublayers, then the output read)."""
        L = self.num_layers
        if self.sources == "block":
            done = l // self.block_size if l < L else self.num_columns - 1  # blocks completed before reader l
            partial = [done + 1] if l < L and l % self.block_size else []  # the current block's partial sum
            return list(range(done + 1)) + partial
        if self.sources == "window":
            return [0] + list(range(max(1, l + 1 - self.window), l + 1))
        return list(range(l + 1))

    def visibility(self) -> torch.Tensor:
        """(readers, columns) bool: the sources each reader sees."""
        visible = torch.zeros(self.num_layers + 1, self.num_columns, dtype=torch.bool, device="cpu")
        for l, cols in enumerate(self.columns):
            visible[l, cols] = True
        return visible

    def visible(self, completed: list, partial: Optional[torch.Tensor]) -> list:
        """The sources of the next read: for a window the embedding and the most recent outputs."""
        if self.sources == "window" and len(completed) > self.window + 1:
            completed = completed[:1] + completed[-self.window:]
        return completed + ([partial] if partial is not None else [])

    def effective_queries(self) -> torch.Tensor:
        """Static queries times their key-norm gains, (L+1, d): the sublayers, then the output read."""
        q = torch.cat([self.pseudo_queries, self.output_query[None]])
        return q * torch.stack([n.weight for n in [*self.key_norms, self.output_norm]]) if self.key_norm else q

    # --- the stream --------------------------------------------------------------------------------
    def stream(self, x, sublayers, want_weights):
        if not want_weights and self.query_kind == "static" and kernels.two_phase(self.sources, x, self.output_query):
            return self.two_phase(x, sublayers), None
        completed, partial = [x], None  # Block: b_0..b_{n-1}, and b_n^{i-1}, the partial sum of block n
        h, rows = x, []
        for l, f in enumerate(sublayers):
            h, weights = self.read(l, self.visible(completed, partial), h, want_weights)
            v = f(h)
            self.observe(h, v)
            rows.append(weights)
            if self.sources != "block":
                completed.append(v)
                continue
            partial = v if partial is None else partial + v
            if self.block_ends(l):
                completed.append(partial)
                partial = None
        out, weights = self.read(self.num_layers, self.visible(completed, None), h, want_weights)
        return out, (self.weight_table(rows + [weights]) if want_weights else None)

    def read(self, l: int, sources: list, h_prev: torch.Tensor, want_weights: bool = False):
        """Reader l (0..L−1 the sublayers, L the output read) over its visible sources: h and, if
        wanted, its weights (..., heads, n)."""
        if self.query_kind == "scalar":
            alpha = torch.softmax(logits(self.mixing_logits[l, self.columns[l]], self.normaliser), -1).to(h_prev.dtype)
            h = sum(a * v for a, v in zip(alpha, sources))
            return h, (alpha.expand(*h.shape[:-1], 1, -1) if want_weights else None)
        if l == self.num_layers:
            q, gain = self.output_query, (self.output_norm.weight if self.key_norm else None)
        else:
            q = self.query_projections[l](h_prev) if self.query_kind == "input" else self.pseudo_queries[l]
            gain = self.key_norms[l].weight if self.key_norm else None
        out = depth_read(q, sources, gain, key_norm=self.key_norm, eps=self.eps, normaliser=self.normaliser,
                         heads=self.heads, return_weights=want_weights)
        return out if want_weights else (out, None)

    def two_phase(self, x, sublayers):
        """The paper's two-phase computation of the same stream, for static queries. The sublayers go
        in chunks (Block: its blocks; Full: FULL_CHUNK sublayers). Phase one reads the sources
        completed before a chunk once, for all the chunk's queries (the output read joins the last
        chunk); phase two continues each sublayer's read with the sources that appeared inside the
        chunk (Full: its outputs so far; Block: the partial sum), from the state phase one left."""
        L, Q = self.num_layers, self.effective_queries()
        opts = dict(key_norm=self.key_norm, eps=self.eps, normaliser=self.normaliser, heads=self.heads)
        completed = [x]
        for start in range(0, L, self.chunk):
            stop = min(start + self.chunk, L)
            outs, lse = read_chunk(Q[start : stop + (stop == L)], completed, **opts)
            new = []
            for i, l in enumerate(range(start, stop)):
                h = depth_read(Q[l], new, state=(outs[i], lse[i]), **opts) if new else outs[i]
                v = sublayers[l](h.to(x.dtype))
                self.observe(h, v)
                new = [new[0] + v] if self.sources == "block" and new else new + [v]
            completed += new
        return depth_read(Q[L], new, state=(outs[-1], lse[-1]), **opts).to(x.dtype)

    def weight_table(self, rows: list) -> torch.Tensor:
        """Each read's weights (mean over heads) scattered into columns: (L+1, ..., columns), zeros
        where a source is not visible."""
        table = rows[-1].new_zeros(len(rows), *rows[-1].shape[:-2], self.num_columns)
        for l, w in enumerate(rows):
            table[l][..., self.columns[l]] = w.mean(-2).to(table.dtype)
        return table

    def mixing_flops_per_token(self) -> int:
        """Per read: a dot product per visible source (2·n·d, none for scalar logits) and an axpy per
        source (2·n·d), the normaliser (5·n per head); each new source's rms (3·d) with key norms;
        Block's partial sums (d per sublayer after the first of its block); input queries' d×d
        projections."""
        d, L = self.d_model, self.num_layers
        n = sum(len(c) for c in self.columns)
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


class FullAttentionResidual(AttentionResidual):
    """Full AttnRes as a drop-in module: every sublayer reads the embedding and every earlier
    output; `out` is one more read over all L+1 sources. num_layers counts sublayers."""

    def __init__(self, d_model: int, num_layers: int, eps: float = 1e-6):
        super().__init__(d_model, num_layers, sources="full", eps=eps)


class BlockAttentionResidual(AttentionResidual):
    """Block AttnRes as the PyTorch RFC's drop-in module (num_layers counts sublayers; num_blocks
    must divide it). Unlike the RFC's sketch it follows the paper: a block's first sublayer reads
    no all-zero partial source, the embedding is a source of its own, and `out` is a final read
    over all N+1 block representations, not the last partial sum.

    `res(embedding, sublayers)`: each sublayer is h -> f(h) with its own PreNorm and no residual
    add; the result goes to your final norm. Keep its parameters out of weight decay (decayed
    queries pull every read back to the plain mean; see DecoderLM.optimizer_groups)."""

    def __init__(self, d_model: int, num_layers: int, num_blocks: int, eps: float = 1e-6):
        check_positive_int("num_layers", num_layers, "it counts sublayers")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1 or num_layers % num_blocks:
            raise ValueError(f"num_blocks={num_blocks!r} must divide num_layers={num_layers} (both count sublayers); "
                             "allowed: " + ", ".join(str(n) for n in range(1, num_layers + 1) if num_layers % n == 0))
        super().__init__(d_model, num_layers, sources="block", block_size=num_layers // num_blocks, eps=eps)
