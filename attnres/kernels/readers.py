"""How the reads of an `AttentionResidual` are computed: two paths × two schedules, one math.

Paths:
- `TorchReader`, the PyTorch path (CPU, float64, the scalar-query variant, and anywhere Triton is
  absent). Each completed source gets its 1/rms once and, for static queries, its scores for
  every reader that will see it from one matmul against the stacked effective queries (unbound
  once, so that a read gathers its column without a scatter in backward). Reads then normalise
  the gathered scores and mix the sources in place (`mix.mix`, `mix.merge_read`): no stacking.
- `FusedReader`, the fused path (`ops.read`: the Triton kernels on CUDA, the C kernels of
  csrc/depth_read.c on CPU): per source its 1/rms once (a kernel), and each read one kernel call
  over the list of sources, scores computed in the kernel. On the C path the reads of one reader
  and one head — phase-2 merges and per-sublayer reads — run `ops.read_one` (csrc/depth_read_one.c),
  which computes the sources' 1/rms itself; a source's 1/rms is then only computed (once) if a
  phase-1 read or a multi-head read needs it.

Schedules, for static queries with `sources="block"` or `"full"`:
- per read: every sublayer reads all its visible sources in one read;
- two-phase (paper, Algorithm 1): the sublayers are taken in chunks — Block: the S sublayers of
  a block; Full: runs of `FULL_CHUNK` consecutive sublayers (the same algorithm, since queries do
  not depend on the input: the paper's observation holds for any group of readers). At the first
  sublayer of a chunk, one read of the sources completed before the chunk by all the chunk's
  queries (phase 1: those sources are read once; each query keeps its normalised output o and
  log-sum-exp ℓ). Each sublayer of the chunk then continues its own read with the sources that
  appeared inside the chunk — Block: the partial sum b_n^{i-1}; Full: the outputs of the chunk's
  earlier sublayers — merged by online softmax (phase 2): with logits t_k of those sources,
  h = (e^ℓ·o + Σ_k e^{t_k}·u_k) / (e^ℓ + Σ_k e^{t_k}). That is exactly the softmax over all visible
  sources (and, with t = log σ(s), the renormalised sigmoid), so the schedule never changes the
  model. Per token and layer, Full AttnRes then reads about L/(2·C) + C/2 sources instead of L/2.
The output read joins the last chunk as one more reader (its phase-1 read is shared, and it
merges the last chunk's sources). Window, input-dependent and scalar queries always read per
sublayer. Default: two-phase (`attnres.kernels.schedule`, ATTNRES_SCHEDULE).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..depth_attention import acc_dtype, inv_rms, normalise_scores
from . import ops
from .mix import merge_read, mix, source_scores

# Sublayers per phase-1 read for Full AttnRes (Block uses its block size). Per token the reads
# touch about L/(2·C) + C/2 sources per sublayer, flat between 4 and 8 at L = 32; 8 measured
# faster on the CPU (C kernels: 49 vs 56 ms of overhead per step at the shape, fewer
# phase-1 calls and reader blocks of 4 that fill the registers; PyTorch path: 109 vs 117 ms).
FULL_CHUNK = 8


class _Source:
    __slots__ = ("v", "column", "rho", "cols", "first")

    def __init__(self, v, column, rho, cols=None, first=0):
        # v (N, d); rho: 1/rms (N, 1) or (N,), or None; cols[l - first]: scores (N, H) for reader l.
        self.v, self.column, self.rho, self.cols, self.first = v, column, rho, cols, first


class _ReaderBase:
    def __init__(self, res, x: torch.Tensor, want_weights: bool, two_phase: bool):
        self.res = res
        self.lead, self.d = x.shape[:-1], x.shape[-1]
        self.N = x.numel() // self.d
        self.H, self.L = res.heads, res.num_layers
        self.sigmoid = res.normaliser == "sigmoid"
        self.dtype = x.dtype
        self.want_weights = want_weights
        self.q_all = None if res.query_kind == "scalar" else res.effective_queries()
        self.two_phase = two_phase and res.sources in ("block", "full") and res.query_kind == "static"
        self.chunk = res.block_size if res.sources == "block" else FULL_CHUNK
        self.completed: list[_Source] = []
        self.phase = None  # state of the current chunk, set by its first sublayer

    # --- shared helpers ------------------------------------------------------------------------
    def visible(self) -> list[_Source]:
        W = self.res.window
        if self.res.sources == "window" and len(self.completed) > W + 1:
            return self.completed[:1] + self.completed[-W:]
        return self.completed

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.N, self.d)

    def weights_shape(self, alpha: torch.Tensor) -> torch.Tensor:
        """(N, H, n) → (*lead, H, n), the layout AttentionResidual._row scatters into columns."""
        return alpha.reshape(*self.lead, self.H, alpha.shape[-1]) if alpha.shape[0] == self.N else alpha

    def query(self, l: int, prev_h: torch.Tensor) -> torch.Tensor:
        """Effective query of reader l: (d,) static or (N, d) per token (gain folded in)."""
        res = self.res
        if res.query_kind == "input":
            if l == self.L:
                return self.q_all[0]
            q = res.query_projections[l](prev_h)
            q = q * res.key_norms[l].weight if res.key_norm else q
            return self.flat(q)
        return self.q_all[l]

    def torch_logits(self, v: torch.Tensor, rho: Optional[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
        """Scores (N, H) of source v (N, d) for one query (d,) or (N, d), with 1/rms rho."""
        H = self.H
        if q.dim() == 1 and H == 1:
            s = (v @ q.to(v.dtype)).unsqueeze(-1)
        elif q.dim() == 1:
            s = torch.linalg.vecdot(v.view(self.N, H, -1), q.to(v.dtype).view(H, -1))  # by head
        else:
            s = torch.linalg.vecdot(v.view(self.N, H, -1), q.to(v.dtype).view(self.N, H, -1))
        return s * rho.view(self.N, 1) if rho is not None else s

    def extras(self, l: int, partial: Optional[torch.Tensor]) -> list[_Source]:
        """Sources that appeared inside reader l's chunk, what phase 2 adds to the phase-1 read:
        Full: the chunk's earlier outputs; Block: the partial sum (and, for the output read, the
        last block, completed inside the last chunk)."""
        inside = self.completed[self.phase["n_before"] :]
        return inside + ([_Source(self.flat(partial), -1, None)] if partial is not None else [])

    def merge_weights(self, l: int, extras: list[_Source]) -> torch.Tensor:
        """Depth weights of a two-phase read (for the recorder only; never changes the output)."""
        with torch.no_grad():
            i = l - self.phase["start"]
            lse, alpha = self.phase["lse"][i], self.phase["alpha"][i]
            t = [lse]
            for src in extras:
                u = src.v
                rho = inv_rms(u, self.res.eps) if self.res.key_norm else None
                s = self.torch_logits(u, rho, self.q_all[l])
                t.append(F.logsigmoid(s) if self.sigmoid else s)
            w = torch.softmax(torch.stack(t, -1).to(acc_dtype(self.dtype)), -1)
            return torch.cat([alpha * w[..., :1], w[..., 1:]], -1)

    def read(self, l: int, partial: Optional[torch.Tensor], prev_h: torch.Tensor):
        if self.two_phase:
            if l < self.L and l % self.chunk == 0:
                stop = min(l + self.chunk, self.L)
                # The output read joins the last chunk as one more reader: its phase-1 read of the
                # sources before that chunk is shared, and it merges the chunk's new sources.
                self.phase_one(l, stop + 1 if stop == self.L else stop)
            h, alpha = self.phase_two(l, self.extras(l, partial))
        else:
            h, alpha = self.read_once(l, None if partial is None else self.flat(partial), prev_h)
        return h.view(*self.lead, self.d), (self.weights_shape(alpha) if alpha is not None else None)


class TorchReader(_ReaderBase):
    """The PyTorch path (see the module docstring)."""

    def __init__(self, res, x, want_weights, two_phase):
        super().__init__(res, x, want_weights, two_phase)
        self.static = res.query_kind == "static"
        if self.static:
            self.first_reader, self.last_reader = res.first_readers(), res.last_readers()

    def add(self, v: torch.Tensor) -> None:
        res, v = self.res, self.flat(v)
        column = len(self.completed)
        if not self.static:
            self.completed.append(_Source(v, column, inv_rms(v, res.eps) if res.key_norm else None))
            return
        first, last = self.first_reader[column], self.last_reader[column]
        # Scores for every reader that will ever see this source, in one product.
        s = source_scores(v, self.q_all[first : last + 1], self.H, res.eps if res.key_norm else None)
        self.completed.append(_Source(v, column, None, s.unbind(-1), first))

    def read_once(self, l, partial, prev_h):
        visible = self.visible()
        values = [s.v for s in visible] + ([partial] if partial is not None else [])
        if self.res.query_kind == "scalar":
            cols = [s.column for s in visible] + ([len(visible)] if partial is not None else [])
            scores = self.res.mixing_logits[l, cols].to(acc_dtype(self.dtype)).view(1, 1, -1)
            alpha = normalise_scores(scores, self.res.normaliser, dim=-1)
            return mix(alpha.expand(self.N, self.H, -1)[None], values, self.dtype)[0], alpha
        if self.static:
            q, cols = self.q_all[l], [s.cols[l - s.first] for s in visible]
        else:
            q = self.query(l, prev_h)
            cols = [self.torch_logits(s.v, s.rho, q) for s in visible]
        if partial is not None:
            rho = inv_rms(partial, self.res.eps) if self.res.key_norm else None
            cols.append(self.torch_logits(partial, rho, q))
        alpha = normalise_scores(torch.stack(cols, dim=-1), self.res.normaliser, dim=-1)  # (N, H, n)
        return mix(alpha[None], values, self.dtype)[0], alpha

    def phase_one(self, start: int, stop: int) -> None:
        """One read of the sources completed before the chunk, by every query of the chunk."""
        before = list(self.completed)
        t = torch.stack([torch.stack([s.cols[r - s.first] for s in before], -1) for r in range(start, stop)])
        t = F.logsigmoid(t) if self.sigmoid else t  # σ_i/Σσ_j = softmax_i(log σ_i)
        lse = torch.logsumexp(t, -1)  # (R, N, H)
        alpha = torch.exp(t - lse.unsqueeze(-1))
        # Readers after the first merge (phase 2), and their merges supply their weight gradient.
        o = mix(alpha, [s.v for s in before], acc_dtype(self.dtype), alpha_grad_readers=1)
        self.phase = dict(start=start, n_before=len(before), o=o, lse=lse.unbind(0), alpha=alpha.unbind(0), sources=before)

    def phase_two(self, l: int, extras: list[_Source]):
        i = l - self.phase["start"]
        o, lse = self.phase["o"][i], self.phase["lse"][i]
        weights = self.merge_weights(l, extras) if self.want_weights else None
        if i == 0:  # the chunk's first sublayer: its phase-1 read is all it reads
            return o.to(self.dtype), weights
        h = merge_read(
            o, lse, self.q_all[l], [src.v for src in extras], self.phase["alpha"][i], [s.v for s in self.phase["sources"]],
            eps=self.res.eps, key_norm=self.res.key_norm, sigmoid=self.sigmoid, out_dtype=self.dtype,
        )
        return h, weights


class FusedReader(_ReaderBase):
    """The fused path (see the module docstring). Depth weights, only computed when recorded,
    come from the PyTorch formula beside the kernel's output, which they never change.

    A kernel reads sources of one storage type. Under autocast the embedding is fp32 while the
    sublayers return bf16/fp16, so the Triton kernels keep the sources in the sublayers' type: the
    embedding is cast once, when the first sublayer output arrives (its 1/rms stays the fp32 one).
    The C kernels read fp32 only, so there every source is stored in fp32."""

    def __init__(self, res, x, want_weights, two_phase):
        super().__init__(res, x, want_weights, two_phase)
        self.c_kernels = ops.uses_c_kernels(x)  # they read fp32 only
        self.store = torch.float32 if self.c_kernels else None  # storage type of the sources
        # 1/rms outside autograd, its gradient folded into each read's backward (ops.read): the C
        # kernels in eager mode, where the sources are then exactly the tensors their 1/rms was
        # taken of; the Triton kernels with one head when their knob says so (ops.fold_rms_in_triton).
        self.fold_rms = (not torch.compiler.is_compiling()) if self.c_kernels else ops.fold_rms_in_triton(self.H)
        self.read_one_max, self.split = None, None  # sources ops.read_one takes, its token ranges: at the first read

    def rms(self, v: torch.Tensor) -> torch.Tensor:
        return ops.inv_rms_values(v, self.res.eps) if self.fold_rms else ops.inv_rms(v, self.res.eps)

    def stored(self, v: torch.Tensor) -> torch.Tensor:
        v = self.flat(v)
        if self.store is None:
            self.store = v.dtype
        elif v.dtype != self.store:
            if not self.c_kernels and len(self.completed) == 1 and self.completed[0].v.dtype == self.store:
                self.store = v.dtype  # the first sublayer output: adopt its type
                self.completed[0].v = self.completed[0].v.to(v.dtype)
            else:
                v = v.to(self.store)
        return v.contiguous()

    def add(self, v: torch.Tensor) -> None:
        stored = self.stored(v)
        # 1/rms from the value as it arrived (an fp32 embedding before a cast to bf16 storage); on
        # the C path the keys are the stored fp32 values, and 1/rms waits for a read that needs it
        keys = stored if stored.dtype == torch.float32 else self.flat(v).contiguous()
        later = self.fold_rms and self.c_kernels
        rho = self.rms(keys) if self.res.key_norm and not later else None
        self.completed.append(_Source(stored, len(self.completed), rho))

    def rhos(self, sources: list[_Source]) -> list:
        """The sources' 1/rms (None without key norm), each computed the first time it is needed."""
        if self.res.key_norm:
            for src in sources:
                if src.rho is None:
                    src.rho = self.rms(src.v)
        return [src.rho for src in sources]

    def one_reader(self, n: int) -> bool:
        """Whether a read of n sources by one reader runs ops.read_one. Decided, with the token
        ranges, once per reader: with the cold caches of a training step each line of a read's
        Python costs (benchmarks/RESULTS.md)."""
        if self.read_one_max is None:
            c_eager = self.fold_rms and self.c_kernels
            self.read_one_max = ops.c_read_one_sources(self.completed[0].v, self.H) if c_eager else 0
            if self.read_one_max:
                self.split = ops.cpu_kernels.read_one_split(self.N)
        return 0 < n <= self.read_one_max

    def _op(self, sources, rhos, q, init=None, out_dtype=None, per_token=False):
        if q.dim() == 1:
            q = q[None]
        o0, lse0 = init if init is not None else (None, None)
        return ops.read(
            sources, [r for r in rhos if r is not None], q.contiguous(), o0, lse0, self.H, self.sigmoid,
            per_token, out_dtype or self.dtype, self.fold_rms,
        )

    def _weights(self, sources, rhos, q) -> torch.Tensor:
        with torch.no_grad():
            s = torch.stack([self.torch_logits(v.float(), r, q.float()) for v, r in zip(sources, rhos)], -1)
            return normalise_scores(s, self.res.normaliser, dim=-1)

    def read_once(self, l, partial, prev_h):
        visible = list(self.visible())
        q = self.query(l, prev_h)
        if partial is not None:
            visible.append(_Source(self.stored(partial), -1, None))
        sources = [s.v for s in visible]
        if self.one_reader(len(sources)):
            out = ops.read_one(sources, q, None, None, self.res.eps, self.res.key_norm, self.sigmoid, self.split)
            weights = self._weights(sources, self.rhos(visible), q) if self.want_weights else None
            return out.to(self.dtype), weights
        rhos = self.rhos(visible)
        out, _ = self._op(sources, rhos, q, per_token=q.dim() == 2)
        return out[0], (self._weights(sources, rhos, q) if self.want_weights else None)

    def phase_one(self, start: int, stop: int) -> None:
        before = list(self.completed)
        sources, rhos = [s.v for s in before], self.rhos(before)
        o, lse = self._op(sources, rhos, self.q_all[start:stop], out_dtype=torch.float32)
        alpha = None
        if self.want_weights:
            alpha = [self._weights(sources, rhos, self.q_all[r]) for r in range(start, stop)]
        self.phase = dict(start=start, n_before=len(before), o=list(o), lse=lse.unbind(0), alpha=alpha)

    def phase_two(self, l: int, extras: list[_Source]):
        i = l - self.phase["start"]
        o, lse = self.phase["o"][i], self.phase["lse"][i]
        weights = self.merge_weights(l, extras) if self.want_weights else None
        if not extras:  # (on the C path each reader's phase-1 output is a tensor of its own)
            return o.to(self.dtype), weights
        us = [self.stored(src.v) for src in extras]
        if self.one_reader(len(us)):
            h = ops.read_one(us, self.q_all[l], o, lse, self.res.eps, self.res.key_norm, self.sigmoid, self.split)
            return h.to(self.dtype), weights
        for src, u in zip(extras, us):
            if self.res.key_norm and src.rho is None:
                src.rho = self.rms(u)
        rhos = [src.rho for src in extras]
        out, _ = self._op(us, rhos, self.q_all[l], init=(o.unsqueeze(0), lse.unsqueeze(0)))
        return out[0], weights
