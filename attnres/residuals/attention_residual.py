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
from ..config import divisors, is_positive_int, positive_int
from ..depth_attention import NORMALISERS, acc_dtype, logits, read
from .base import Residual

SOURCES = ("full", "window", "block")
QUERIES = ("static", "input", "scalar")
FULL_CHUNK = 8  # sublayers per phase-one read of Full (Block reads a block)


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
        positive_int("heads", heads, "channel groups with their own softmax over depth")
        if d_model % heads:
            raise ValueError(f"heads={heads} must divide d_model={d_model}; allowed: {divisors(d_model, most=64)}")
        if sources == "block":
            positive_int("block_size", block_size, "sublayers per block")
            if block_size > num_layers:
                raise ValueError(f"block_size={block_size} must be between 1 and the number of sublayers L={num_layers}")
        if sources == "window":
            positive_int("window", window, "the number of recent sublayer outputs a read sees")
        self.sources, self.query_kind, self.normaliser, self.heads, self.eps = sources, query, normaliser, heads, eps
        self.key_norm = key_norm and query != "scalar"  # scalar logits have no keys to normalise
        self.block_size = block_size if sources == "block" else 1
        self.window = window
        self.num_columns = (math.ceil(num_layers / self.block_size) if sources == "block" else num_layers) + 1
        self.chunk = self.block_size if sources == "block" else FULL_CHUNK
        self.opts = dict(key_norm=self.key_norm, eps=eps, normaliser=normaliser, heads=heads)

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

    def visible(self, sources: list) -> list:
        """The sources of the next read: for a window the embedding and the most recent outputs."""
        if self.sources == "window" and len(sources) > self.window + 1:
            return sources[:1] + sources[-self.window:]
        return sources

    def effective_queries(self) -> torch.Tensor:
        """Static queries times their key-norm gains, (L+1, d): the sublayers, then the output read."""
        q = torch.cat([self.pseudo_queries, self.output_query[None]])
        return q * torch.stack([n.weight for n in [*self.key_norms, self.output_norm]]) if self.key_norm else q

    # --- the stream ----------------------------------------------------------------------------------
    def stream(self, x, sublayers, want_weights):
        """The sublayers go in chunks (Block: its blocks; else FULL_CHUNK sublayers): `done` holds the
        sources completed before the chunk, `new` those inside it (Block: the partial sum). Per read,
        reader l reads done + new. Two-phase (static Block/Full, docs/MATH.md): phase one reads `done`
        once for all the chunk's readers (the output read joins the last chunk), phase two continues
        each reader's read with `new` from the state phase one left. For the kernels, sources and
        reads are rows (tokens, d), their layout, reshaped once each rather than at every read."""
        static, L, chunk, shape = self.query_kind == "static", self.num_layers, self.chunk, x.shape
        plan = (kernels.Plan("torch", False) if self.query_kind == "scalar"  # no query, nothing for a kernel to read
                else kernels.plan(self.sources if static else None, x, self.output_query, weights=want_weights))
        Q = self.effective_queries() if static else None
        flat = plan.kernel != "torch"
        unflat = (lambda t: t.view(shape)) if flat else (lambda t: t)  # noqa: E731
        x = x.reshape(-1, shape[-1]) if flat else x
        done, new, rows, h = [], [x], [], x
        for l, f in enumerate(sublayers):
            if l % chunk == 0:
                done, new = done + new, []
            if plan.two_phase and l % chunk == 0:  # phase one; the kernels keep its state in fp32 at least
                stop = min(l + chunk, L)
                outs, lse, _ = read(Q[l : stop + (stop == L)], done, kernel=plan.kernel, with_lse=True, **self.opts,
                                    out_dtype=None if plan.kernel == "torch" else acc_dtype(done[-1].dtype))
            if plan.two_phase:
                i = l % chunk
                h = (read(Q[l : l + 1], new, (outs[i], lse[i]), kernel=plan.kernel, **self.opts)[0][0] if new
                     else outs[i]).to(x.dtype)
            elif self.query_kind == "scalar":
                h, w = self.scalar_read(l, self.visible(done + new), h, want_weights)
                rows.append(w)
            else:
                outs, _, w = read(self.query(l, unflat(h), Q, flat), self.visible(done + new), kernel=plan.kernel,
                                  per_token=self.query_kind == "input", with_weights=want_weights, **self.opts)
                h = outs[0]
                rows.append(w and w[0])
            h_in = unflat(h)
            v = f(h_in)
            self.observe(l, h_in, v)
            v = v.reshape(x.shape) if flat else v
            new = [new[0] + v] if self.sources == "block" and new else new + [v]
        if plan.two_phase:
            return unflat(read(Q[L:], new, (outs[-1], lse[-1]), kernel=plan.kernel, **self.opts)[0][0].to(x.dtype)), None
        if self.query_kind == "scalar":
            out, w = self.scalar_read(L, self.visible(done + new), h, want_weights)
        else:
            outs, _, w = read(self.query(L, unflat(h), Q, flat), self.visible(done + new), kernel=plan.kernel,
                              with_weights=want_weights, **self.opts)
            out, w = outs[0], w and w[0]
        return unflat(out), (self.weight_table(rows + [w]) if want_weights else None)

    def query(self, l: int, h_prev: torch.Tensor, Q: Optional[torch.Tensor], rows: bool) -> torch.Tensor:
        """Reader l's query, its key-norm gain folded in: a row of the static queries Q (1, d), or
        projected from the hidden state the previous sublayer read (..., d; `rows`: (tokens, d))."""
        if Q is not None:
            return Q[l : l + 1]
        if l == self.num_layers:  # the output read's query is static for every query kind
            q = self.output_query[None]
            return q * self.output_norm.weight if self.key_norm else q
        q = self.query_projections[l](h_prev)
        q = q * self.key_norms[l].weight if self.key_norm else q
        return q.reshape(-1, self.d_model) if rows else q

    def scalar_read(self, l: int, sources: list, h_prev: torch.Tensor, want_weights: bool):
        """Reader l with learned logits per source instead of a query: h and, if wanted, its weights."""
        alpha = torch.softmax(logits(self.mixing_logits[l, self.columns[l]], self.normaliser), -1).to(h_prev.dtype)
        h = sum(a * v for a, v in zip(alpha, sources))
        return h, (alpha.expand(*h.shape[:-1], 1, -1) if want_weights else None)

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
        super().__init__(d_model, num_layers, sources="block", block_size=block_size_for(num_blocks, num_layers), eps=eps)


def block_size_for(num_blocks: int, num_layers: int, name: str = "num_blocks", layers: str = "") -> int:
    """S = L / N for N blocks, which must divide the L sublayers; `name` and `layers` say N and L in
    the caller's terms (the default: this class's arguments)."""
    positive_int("num_layers", num_layers, "it counts sublayers")
    if not is_positive_int(num_blocks) or num_layers % num_blocks:
        layers = layers or f"num_layers={num_layers} (both count sublayers)"
        raise ValueError(f"{name}={num_blocks!r} must divide {layers}; allowed: {divisors(num_layers)}")
    return num_layers // num_blocks
