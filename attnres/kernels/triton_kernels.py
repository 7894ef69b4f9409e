"""Triton kernels of one depth read, forward and backward, for any number of readers at once.

Imported lazily (only when the Triton path runs), so that `attnres` imports without Triton and so
that tests can set TRITON_INTERPRET=1 before the kernels are decorated.

The operation (docs/MATH.md, "One depth read" and "The two-phase computation"), for readers r = 1..R:

    s_ri = (q_r · v_i) · ρ_i            ρ_i = 1/rms(v_i), shared by every reader (1 without key norm)
    t_ri = s_ri  (softmax)  or  log σ(s_ri)  (sigmoid, renormalised: σ_i/Σσ_j = softmax_i(log σ_i))
    out_r = Σ_i softmax_i(t_ri) v_i,   lse_r = log Σ_i exp(t_ri)

q_r is already the key-norm gain times the pseudo-query (RMSNorm(v)·w = (g∘w)·v/rms(v)).

How:
- Sources arrive as a table of data pointers, not a stacked tensor: a read never copies its
  sources, and one launch reads any number of them. Every source is read once per launch, for
  all R readers (phase 1 of the paper's Algorithm 1 reads the completed blocks once for the S
  sublayers of a block).
- Online softmax over sources (Milakov & Gimelshein 2018, as in FlashAttention): the running max
  m, sum ℓ and unnormalised output travel with the loop, so sources are read in one pass.
- An optional initial state (o0, lse0) is a pseudo-source whose logit is given: continuing an
  online softmax from a saved (normalised output, log-sum-exp) pair is exactly the paper's phase-2
  merge, so one kernel does both phases.
- Channel groups (heads): a (N, d) source is viewed as (N·H, d/H) rows; row ρ is token ρ // H and
  head ρ % H. A multi-head read is a single-head read over rows whose query slice depends on the
  head, with the token's 1/rms shared by its H rows (the key norm spans all d channels).
- fp32 state and arithmetic whatever the storage type (bf16/fp16/fp32).
- The backward recomputes scores from the saved sources and the saved lse (no weights stored),
  reads each source twice (once with BWD_DQ_SECOND_PASS off), accumulates the softmax-backward term Δ
  in fp32 from the sources (not from the possibly-bf16 stored output), and writes each source's
  gradient once, summed over the readers. The output itself is not needed for backward.
"""
from __future__ import annotations

import contextlib
import inspect
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# tl.sum, tl.zeros and tl.sigmoid are avoided: they are @triton.jit functions of Triton's standard
# library, created when Triton is first imported, so a process that imported Triton before
# setting TRITON_INTERPRET=1 (torch does, through dynamo) could not call them from an interpreted
# kernel. The sum is tl.reduce with the standard library's own combine function (what tl.sum is),
# which the interpreter recognises and runs as one numpy sum; tl.full and exp are builtins.
@triton.jit
def _add(a, b):
    return a + b


_SUM_COMBINE = getattr(tl.standard, "_sum_combine", _add)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _SUM_COMBINE)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _log_sigmoid(s):
    # log σ(s) = min(s, 0) − log(1 + e^{−|s|}): no overflow for either sign.
    return tl.minimum(s, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(s)))


@triton.jit
def _source_raw(src_table, i, src0, tile, ok, ALIGNED: tl.constexpr):
    """Source i's [T, W] tile in the sources' own dtype (zeros where not ok), through the table of
    data pointers (src0: one of the sources, for their element type)."""
    src = tl.load(src_table + i).to(tl.pointer_type(src0.dtype.element_ty))
    if ALIGNED:  # a pointer from the table carries no alignment: without this, 2-byte loads
        src = tl.multiple_of(src, 16)
    return tl.load(src + tile, mask=ok, other=0.0)


@triton.jit
def _source(src_table, i, src0, tile, tile_ok, ALIGNED: tl.constexpr):
    """Source i's [T, W] tile in fp32."""
    return _source_raw(src_table, i, src0, tile, tile_ok, ALIGNED).to(tl.float32)


@triton.jit
def _source_ahead(src_table, i, n_src, src0, tile, tile_ok, ALIGNED: tl.constexpr):
    """Source i's tile in the sources' own dtype, zeros past the last source (PREFETCH: the load is
    issued one iteration before its use, and converting it to fp32 here would wait for it). At
    i = n_src the table's next entry is read (a 1/rms pointer or the closing 0), the load masked off."""
    return _source_raw(src_table, i, src0, tile, tile_ok & (tl.full([1, 1], i, tl.int32) < n_src), ALIGNED)


@triton.jit(do_not_specialize=["rows_bucket"])
def _read_fwd_kernel(
    src_table, rms_table, src0, q_ptr, o0_ptr, lse0_ptr, out_ptr, lse_ptr,
    n_src, n_rows, reader_stride, d, H, W, rows_bucket,
    R: tl.constexpr, R_PAD: tl.constexpr, BLOCK_T: tl.constexpr, W_PAD: tl.constexpr,
    KEY_NORM: tl.constexpr, SIGMOID: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_INIT: tl.constexpr,
    ALIGNED: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, W_PAD)
    readers = tl.arange(0, R_PAD)
    row_ok = rows < n_rows
    tile = rows[:, None].to(tl.int64) * W + cols[None, :]  # [T, W] offsets into a (N, d) tensor
    tile_ok = row_ok[:, None] & (cols < W)[None, :]
    tokens = rows // H
    state = readers[:, None, None].to(tl.int64) * reader_stride + tile[None, :, :]  # [R, T, W]
    state_ok = (readers < R)[:, None, None] & tile_ok[None, :, :]
    row_state = readers[:, None].to(tl.int64) * n_rows + rows[None, :]  # [R, T]
    row_state_ok = (readers < R)[:, None] & row_ok[None, :]

    if PER_TOKEN:
        q = tl.load(q_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)[None, :, :]
    else:
        q_off = readers[:, None, None] * d + ((rows % H) * W)[None, :, None] + cols[None, None, :]
        q = tl.load(q_ptr + q_off, mask=state_ok, other=0.0).to(tl.float32)

    if HAS_INIT:
        acc = tl.load(o0_ptr + state, mask=state_ok, other=0.0).to(tl.float32)
        m = tl.load(lse0_ptr + row_state, mask=row_state_ok, other=0.0)
        ell = tl.full([R_PAD, BLOCK_T], 1.0, tl.float32)
    else:
        acc = tl.full([R_PAD, BLOCK_T, W_PAD], 0.0, tl.float32)
        m = tl.full([R_PAD, BLOCK_T], float("-inf"), tl.float32)
        ell = tl.full([R_PAD, BLOCK_T], 0.0, tl.float32)

    if PREFETCH:
        v_next = _source_ahead(src_table, 0, n_src, src0, tile, tile_ok, ALIGNED)
    for i in range(n_src):
        if PREFETCH:  # source i + 1 is on its way while source i is used
            v = v_next.to(tl.float32)
            v_next = _source_ahead(src_table, i + 1, n_src, src0, tile, tile_ok, ALIGNED)
        else:
            v = _source(src_table, i, src0, tile, tile_ok, ALIGNED)  # read once for all readers
        s = _sum(q * v[None, :, :], 2)
        if KEY_NORM:
            rms = tl.load(rms_table + i).to(tl.pointer_type(tl.float32))
            s = s * tl.load(rms + tokens, mask=row_ok, other=1.0)[None, :]
        if SIGMOID:
            s = _log_sigmoid(s)
        m_new = tl.maximum(m, s)
        rescale = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        ell = ell * rescale + p
        acc = acc * rescale[:, :, None] + p[:, :, None] * v[None, :, :]
        m = m_new

    out = acc / ell[:, :, None]
    tl.store(out_ptr + state, out.to(out_ptr.dtype.element_ty), mask=state_ok)
    tl.store(lse_ptr + row_state, m + tl.log(ell), mask=row_state_ok)


@triton.jit(do_not_specialize=["rows_bucket", "programs_per_sm"])
def _read_bwd_kernel(
    src_table, rms_table, src0, q_ptr, o0_ptr, lse0_ptr, lse_ptr, gout_ptr, glse_ptr,
    dsrc_ptr, drms_ptr, dq_ptr, do0_ptr, dlse0_ptr, scratch_ptr,
    n_src, n_rows, reader_stride, d, H, W, rows_bucket, programs_per_sm,
    R: tl.constexpr, R_PAD: tl.constexpr, BLOCK_T: tl.constexpr, W_PAD: tl.constexpr,
    KEY_NORM: tl.constexpr, SIGMOID: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_GLSE: tl.constexpr, DQ_ROWS: tl.constexpr, ALIGNED: tl.constexpr, ACCUMULATE: tl.constexpr,
    DQ_SECOND_PASS: tl.constexpr, PREFETCH: tl.constexpr, FOLD_RMS: tl.constexpr,
):
    # dL/dt_i = α_i (B_i − Δ) with B_i = g·v_i and Δ = Σ_i α_i B_i − g_lse. Δ is accumulated here
    # in fp32 from the sources rather than taken as g·out from the stored output, which may be
    # bf16: with a peaked softmax, B_i − Δ cancels and the rounding of out would dominate it.
    # Pass 1 reads each source once: α_i, B_i, q·v_i go to a small scratch, and
    # dq = Σ_i c_i (B_i − Δ) v_i (c_i = ρ_i α_i, times σ(−s_i) for sigmoid) is accumulated without
    # knowing Δ yet, as P = Σ c_i (B_i − m) v_i around the running α-weighted mean m of the B_i
    # (updated Welford-style, so that P never holds the large cancelling terms Σ c B v and Δ·Σ c v)
    # and Q = Σ c_i v_i; then dq = P + (m − Δ)·Q. Pass 2 writes each source's gradient from the
    # scalars, g and q (no read of v).
    # DQ_SECOND_PASS: pass 1 keeps no dq accumulators (two fewer [R, T, W] tiles, no Welford
    # update) and pass 2 reads each source again for dq = Σ_i ds_i ρ_i v_i with Δ known
    # (BWD_DQ_SECOND_PASS, the default: the read costs less than the registers).
    # Each program walks row tiles pid, pid + P, … (P programs, a few per SM): a static query's
    # gradient is summed over its tiles in its own slice of dq, so the partial sums the wrapper
    # adds up are P, not one per tile (16k of them at BLOCK_T = 1 and d = 2048).
    # ACCUMULATE: the readers are one group of several (READER_GROUP); the sources' gradients and
    # 1/rms gradients are added to what the groups before wrote (each element by one program).
    # FOLD_RMS (one head, key norm): the sources' 1/rms are constants to autograd, and the key
    # norm's gradient is added to each source's gradient here, from the source read again in pass 2.
    # rows_bucket and programs_per_sm: read by the autotuner (its key, the grid), not here
    pid = tl.program_id(0)
    cols = tl.arange(0, W_PAD)
    readers = tl.arange(0, R_PAD)
    n_tiles = tl.cdiv(n_rows, BLOCK_T)
    for tile_id in range(pid, n_tiles, tl.num_programs(0)):
        rows = tile_id * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < n_rows
        tile = rows[:, None].to(tl.int64) * W + cols[None, :]
        tile_ok = row_ok[:, None] & (cols < W)[None, :]
        tokens = rows // H
        state = readers[:, None, None].to(tl.int64) * reader_stride + tile[None, :, :]
        state_ok = (readers < R)[:, None, None] & tile_ok[None, :, :]
        row_state = readers[:, None].to(tl.int64) * n_rows + rows[None, :]
        row_state_ok = (readers < R)[:, None] & row_ok[None, :]
        # scratch (n, 3, R_PAD, n_rows): α, B, q·v of every source for this program's rows
        plane = R_PAD * n_rows
        scr = readers[:, None].to(tl.int64) * n_rows + rows[None, :]

        if PER_TOKEN:
            q = tl.load(q_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)[None, :, :]
        else:
            q_off = readers[:, None, None] * d + ((rows % H) * W)[None, :, None] + cols[None, None, :]
            q = tl.load(q_ptr + q_off, mask=state_ok, other=0.0).to(tl.float32)

        g = tl.load(gout_ptr + state, mask=state_ok, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row_state, mask=row_state_ok, other=0.0)
        delta = tl.full([R_PAD, BLOCK_T], 0.0, tl.float32)
        if HAS_INIT:
            o0 = tl.load(o0_ptr + state, mask=state_ok, other=0.0).to(tl.float32)
            a0 = tl.exp(tl.load(lse0_ptr + row_state, mask=row_state_ok, other=0.0) - lse)
            b0 = _sum(g * o0, 2)
            delta += a0 * b0

        if not DQ_SECOND_PASS:
            acc_p = tl.full([R_PAD, BLOCK_T, W_PAD], 0.0, tl.float32)
            acc_q = tl.full([R_PAD, BLOCK_T, W_PAD], 0.0, tl.float32)
            mean = tl.full([R_PAD, BLOCK_T], 0.0, tl.float32)
        weight = tl.full([R_PAD, BLOCK_T], 0.0, tl.float32)
        scr_i = scratch_ptr
        if PREFETCH:
            v_next = _source_ahead(src_table, 0, n_src, src0, tile, tile_ok, ALIGNED)
        for i in range(n_src):
            if PREFETCH:
                v = v_next.to(tl.float32)
                v_next = _source_ahead(src_table, i + 1, n_src, src0, tile, tile_ok, ALIGNED)
            else:
                v = _source(src_table, i, src0, tile, tile_ok, ALIGNED)
            qv = _sum(q * v[None, :, :], 2)
            b = _sum(g * v[None, :, :], 2)
            if KEY_NORM:
                rms = tl.load(rms_table + i).to(tl.pointer_type(tl.float32))
                rho = tl.load(rms + tokens, mask=row_ok, other=1.0)[None, :]
            else:
                rho = tl.full([1, BLOCK_T], 1.0, tl.float32)
            s = qv * rho
            if SIGMOID:
                alpha = tl.exp(_log_sigmoid(s) - lse)
                c = rho * alpha * _sigmoid(-s)  # d log σ(s)/ds = σ(−s)
            else:
                alpha = tl.exp(s - lse)
                c = rho * alpha
            delta += alpha * b
            weight_new = weight + alpha
            if not DQ_SECOND_PASS:
                mean_new = mean + tl.where(weight_new > 0, alpha * (b - mean) / tl.maximum(weight_new, 1e-30), 0.0)
                acc_p += (c * (b - mean_new))[:, :, None] * v[None, :, :] - (mean_new - mean)[:, :, None] * acc_q
                acc_q += c[:, :, None] * v[None, :, :]
                mean = mean_new
            weight = weight_new
            tl.store(scr_i + scr, alpha, mask=row_state_ok)
            tl.store(scr_i + plane + scr, b, mask=row_state_ok)
            tl.store(scr_i + 2 * plane + scr, qv, mask=row_state_ok)
            scr_i += 3 * plane
        # The weights e^(t − lse) sum to 1 only up to the rounding of the fp32 lse (|lse|·2⁻²⁴),
        # and through a peaked softmax B_i − Δ cancels only if they sum to 1: every weight (α_i,
        # a0, and c_i in P and Q) is divided by their sum z (the mean m does not change).
        z = weight
        if HAS_INIT:
            z += a0
        z = tl.where(z > 0, z, 1.0)
        delta = delta / z
        if HAS_GLSE:
            delta -= tl.load(glse_ptr + row_state, mask=row_state_ok, other=0.0)
        if HAS_INIT:
            a0 = a0 / z
            tl.store(do0_ptr + state, (a0[:, :, None] * g).to(do0_ptr.dtype.element_ty), mask=state_ok)
            tl.store(dlse0_ptr + row_state, a0 * (b0 - delta), mask=row_state_ok)
        if DQ_SECOND_PASS:
            dq = tl.full([R_PAD, BLOCK_T, W_PAD], 0.0, tl.float32)
        else:
            dq = (acc_p + (mean - delta)[:, :, None] * acc_q) / z[:, :, None]

        dsrc_i, drms_i, scr_i = dsrc_ptr, drms_ptr, scratch_ptr  # 64-bit pointer steps, no i·N·d product
        for i in range(n_src):
            alpha = tl.load(scr_i + scr, mask=row_state_ok, other=0.0) / z
            b = tl.load(scr_i + plane + scr, mask=row_state_ok, other=0.0)
            qv = tl.load(scr_i + 2 * plane + scr, mask=row_state_ok, other=0.0)
            scr_i += 3 * plane
            if KEY_NORM:
                rms = tl.load(rms_table + i).to(tl.pointer_type(tl.float32))
                rho_rows = tl.load(rms + tokens, mask=row_ok, other=1.0)
                rho = rho_rows[None, :]
            else:
                rho = tl.full([1, BLOCK_T], 1.0, tl.float32)
            ds = alpha * (b - delta)
            if SIGMOID:
                ds = ds * _sigmoid(-(qv * rho))
            # value path α·g plus key path ds·ρ·q, summed over the readers: one write per source.
            dv = _sum(alpha[:, :, None] * g + (ds * rho)[:, :, None] * q, 0)
            if DQ_SECOND_PASS or FOLD_RMS:
                v = _source(src_table, i, src0, tile, tile_ok, ALIGNED)
            if KEY_NORM:
                drho = _sum(ds * qv, 0)  # ∂s/∂ρ = q·v, summed over the readers
                if FOLD_RMS:  # ∂ρ/∂v = −ρ³·v/d (one head: the row is the token's whole width)
                    dv += (drho * rho_rows * rho_rows * rho_rows * (-1.0 / d))[:, None] * v
                else:  # the rms backward (shared by all readers of the source) runs once, outside
                    if ACCUMULATE:
                        drho += tl.load(drms_i + rows, mask=row_ok, other=0.0)
                    tl.store(drms_i + rows, drho, mask=row_ok)
                    drms_i += n_rows
            if ACCUMULATE:
                dv += tl.load(dsrc_i + tile, mask=tile_ok, other=0.0).to(tl.float32)
            tl.store(dsrc_i + tile, dv.to(dsrc_ptr.dtype.element_ty), mask=tile_ok)
            dsrc_i += reader_stride
            if DQ_SECOND_PASS:
                dq += (ds * rho)[:, :, None] * v[None, :, :]

        if PER_TOKEN:
            tl.store(dq_ptr + tile, _sum(dq, 0), mask=tile_ok)
        elif DQ_ROWS:
            tl.store(dq_ptr + state, dq, mask=state_ok)  # per row; the wrapper sums rows of each head
        else:  # added to this program's slice (zeroed by the wrapper); the barrier orders the
            # next tile's read of it after this store, whichever threads hold which elements
            part = pid.to(tl.int64) * R_PAD * W + readers[:, None] * W + cols[None, :]
            part_ok = (readers < R)[:, None] & (cols < W)[None, :]
            tl.store(dq_ptr + part, tl.load(dq_ptr + part, mask=part_ok, other=0.0) + _sum(dq, 1), mask=part_ok)
            tl.debug_barrier()


@triton.jit
def _inv_rms_fwd_kernel(x_ptr, out_ptr, n_rows, d, eps, BLOCK_T: tl.constexpr, D_PAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D_PAD)
    ok = (rows < n_rows)[:, None] & (cols < d)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * d + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, 1.0 / tl.sqrt(_sum(x * x, 1) / d + eps), mask=rows < n_rows)


# --- launchers -----------------------------------------------------------------------------------

def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# The knobs of the kernels' algorithm on a GPU (tiles and warps are the autotuner's, below);
# tile_sweep.py times each one moved.

# The backward's query gradient from a second read of the sources, Δ known (see _read_bwd_kernel),
# instead of two more accumulators in its first pass: fewer registers for one more read.
BWD_DQ_SECOND_PASS = True

# Readers one launch takes at most (None: all of a read's readers). A tile pads its readers to a
# power of two (Full's last phase-1 read has 9, padded to 16, and spills); groups pad less and hold
# smaller tiles, for one more read of the sources per group.
READER_GROUP = 4

# Each loop over the sources issues the load of source i + 1 before it uses source i: one more tile
# in flight per program, for one more tile of registers.
PREFETCH = True

# The knobs above, which the benchmarks set (model_bench.py --triton NAME=VALUE, tile_sweep.py).
KNOBS = ("READER_GROUP", "BWD_DQ_SECOND_PASS", "PREFETCH")
# The knobs that are switches: gpu_check.py and tile_sweep.py try each one toggled, untimed first.
SWITCHES = ("PREFETCH", "BWD_DQ_SECOND_PASS")


@contextlib.contextmanager
def knobs(**values):
    """Within the block, the named KNOBS take these values; after it, their previous ones."""
    unknown = sorted(set(values) - set(KNOBS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a knob of the Triton kernels; allowed: {', '.join(KNOBS)}")
    saved = {name: globals()[name] for name in values}
    globals().update(values)
    try:
        yield
    finally:
        globals().update(saved)


def _reader_groups(R: int) -> list[tuple[int, int]]:
    size = READER_GROUP or R
    return [(r0, min(r0 + size, R)) for r0 in range(0, R, size)]


# Tiles, warps and the backward's programs per SM are chosen by triton.autotune, per kernel
# specialisation and per power of two of the rows, among the candidates below (`_candidates`): rows
# per program such that one [R, T, W] fp32 tile holds FWD_TILE / BWD_TILE elements (the forward
# holds about three such tiles, the backward four), 4 or 8 warps, and for the backward's
# persistent grid 4 or 8 programs per SM. The choice is made once per shape, in the first read of
# it (each candidate compiled and timed, a few ms each), and kept on disk where Triton caches
# results. Under the interpreter one candidate: large tiles (fewer programs, each a numpy call
# sequence) are what makes it fast, and nothing is timed.
FWD_TILE, BWD_TILE = (1024, 8192), (1024, 4096)
BLOCK_TS, WARPS, PROGRAMS_PER_SM = (1, 2, 4, 8, 16, 32, 64), (4, 8), (4, 8)
INTERPRET_PROGRAMS = 3  # the backward's programs under the interpreter: the tests run its walk over tiles


def _tiles(r_pad: int, w_pad: int, backward: bool = False) -> tuple[int, int]:
    """Rows per program and warps under the interpreter: one [R, T, W] tile near 64k elements."""
    t = max(1, min(1024, (1 << 16) // (r_pad * w_pad)))
    return 1 << (t.bit_length() - 1), 4


def _candidates(configs: list, args: dict, backward: bool) -> list:
    """The configurations worth timing for these arguments (the kernel's, by name): rows per
    program T with R_PAD·T·W_PAD within the tile budget, as near it as the rows allow."""
    r_pad, w_pad, rows = args["R_PAD"], args["W_PAD"], args["n_rows"]
    if INTERPRET:
        t, warps = _tiles(r_pad, w_pad, backward)
        return [triton.Config({"BLOCK_T": t, **({"programs_per_sm": INTERPRET_PROGRAMS} if backward else {})},
                              num_warps=warps)]
    lo, hi = BWD_TILE if backward else FWD_TILE
    row, most = r_pad * w_pad, min(BLOCK_TS[-1], _pow2(rows))
    t_hi = max([t for t in BLOCK_TS if t <= most and row * t <= hi] or [1])
    t_lo = min([t for t in BLOCK_TS if t <= most and row * t >= lo] or [most])
    return [c for c in configs if min(t_lo, t_hi) <= c.kwargs["BLOCK_T"] <= t_hi]


def _configs(backward: bool) -> list:
    programs = PROGRAMS_PER_SM if backward else (None,)
    return [triton.Config({"BLOCK_T": t, **({"programs_per_sm": p} if p else {})}, num_warps=w)
            for t in BLOCK_TS for w in WARPS for p in programs]


def _bench(kernel_call, quantiles):
    """The autotuner's timing of one candidate: short, since every new shape pays it once per run."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


_saved: dict[str, torch.Tensor] = {}


def _bwd_before(args: dict, reset_only: bool = False) -> None:
    """Before each timed run of a backward candidate (and before the real run, reset_only): zero
    the query-gradient slices it adds to, and keep the source gradients a later reader group adds
    to (ACCUMULATE), so that timing leaves the results as one run would."""
    args["dq_ptr"].zero_()
    if args["ACCUMULATE"] and not reset_only:
        _saved.update(dsrc=args["dsrc_ptr"].clone(), drms=args["drms_ptr"].clone())


def _bwd_after(args: dict, exception=None) -> None:
    if _saved:
        args["dsrc_ptr"].copy_(_saved.pop("dsrc"))
        args["drms_ptr"].copy_(_saved.pop("drms"))


def _tuning_options() -> dict:
    """do_bench and disk caching where this Triton's autotune takes them (3.2 has neither)."""
    params = inspect.signature(triton.autotune).parameters
    opts = {"do_bench": lambda kernel_call, quantiles: _bench(kernel_call, quantiles)} if "do_bench" in params else \
        {"warmup": 5, "rep": 20}
    if "cache_results" in params:
        opts["cache_results"] = True
    return opts


_SPECIALISATION = ["rows_bucket", "R", "R_PAD", "W_PAD", "KEY_NORM", "SIGMOID", "PER_TOKEN", "HAS_INIT", "ALIGNED",
                   "PREFETCH"]
_read_fwd_kernel = triton.autotune(
    _configs(False), key=_SPECIALISATION, **_tuning_options(),
    prune_configs_by={"early_config_prune": lambda configs, named, **kw: _candidates(configs, {**named, **kw}, False)},
)(_read_fwd_kernel)
_read_bwd_kernel = triton.autotune(
    _configs(True), key=_SPECIALISATION + ["HAS_GLSE", "DQ_ROWS", "ACCUMULATE", "DQ_SECOND_PASS", "FOLD_RMS"],
    pre_hook=lambda args, reset_only=False: _bwd_before(args, reset_only),
    post_hook=lambda args, exception=None: _bwd_after(args, exception), **_tuning_options(),
    prune_configs_by={"early_config_prune": lambda configs, named, **kw: _candidates(configs, {**named, **kw}, True)},
)(_read_bwd_kernel)


def chosen() -> list[dict]:
    """The configurations chosen so far, by kernel and autotuning key (for the benchmarks' output)."""
    return [dict(kernel=kernel.base_fn.__name__, key=[str(k) for k in key], BLOCK_T=config.kwargs["BLOCK_T"],
                 num_warps=config.num_warps, programs_per_sm=config.kwargs.get("programs_per_sm"))
            for kernel in (_read_fwd_kernel, _read_bwd_kernel) for key, config in kernel.cache.items()]


# Pointer tables by device, stream and pointers (the key is the table's content, so a hit is always
# right). With the caching allocator a training step's tensors come back at the same addresses, so
# from the second step on a read finds its table here instead of building one and copying it to
# the device: on a GPU each build is a host tensor, a pinned copy and a host-to-device copy.
_TABLES: dict[tuple, torch.Tensor] = {}
_TABLES_KEPT = 1024


def _tables(sources: list[torch.Tensor], inv_rms: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device tables of the sources' and their 1/rms' data pointers (one table, two views)."""
    if not sources and not inv_rms:
        table = torch.zeros(1, dtype=torch.int64, device=device)  # not read (no source): any pointer
        return table, table
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, *(t.data_ptr() for t in sources), *(t.data_ptr() for t in inv_rms))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _TABLES_KEPT:
            del _TABLES[next(iter(_TABLES))]  # the oldest
        table = torch.tensor((*key[2:], 0), dtype=torch.int64)  # 0 past the end: PREFETCH reads it
        if device.type == "cuda":
            # From pinned memory (torch's caching host allocator) the copy is asynchronous; from pageable
            # memory CUDA may make the host wait, and a wait in every read would drain the launch queue.
            table = table.pin_memory()
        table = _TABLES[key] = table.to(device, non_blocking=True)
    n = len(sources)
    return table, (table[n:] if inv_rms else table)


def _aligned(tensors: list[torch.Tensor]) -> bool:
    """Every source starts on 16 bytes (what the caching allocator hands out; views may not), so
    the kernels may load rows in 16-byte vectors."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _sms(device: torch.device) -> int:
    return 1 if INTERPRET or device.type != "cuda" else torch.cuda.get_device_properties(device).multi_processor_count


def read_forward(sources, inv_rms, query, init_out, init_lse, heads, sigmoid, per_token, out_dtype):
    """sources: n (N, d) contiguous tensors of one dtype; inv_rms: n (N,) fp32 or []; query (R, d)
    or (N, d) when per_token; init_out (R, N, d), init_lse (R, N, H) fp32 or None.
    Returns out (R, N, d) in out_dtype and lse (R, N, H) fp32."""
    ref = sources[0] if sources else init_out
    N, d = ref.shape[-2], ref.shape[-1]
    H, W = heads, d // heads
    R = 1 if per_token else query.shape[0]
    device = ref.device
    out = torch.empty(R, N, d, device=device, dtype=out_dtype)
    lse = torch.empty(R, N, H, device=device, dtype=torch.float32)
    w_pad, n_rows = _pow2(W), N * H
    src_table, rms_table = _tables(sources, inv_rms, device)
    has_init = init_out is not None
    for r0, r1 in _reader_groups(R):  # readers r0..r1-1: slices of the (R, …) tensors
        _read_fwd_kernel[lambda meta: (triton.cdiv(n_rows, meta["BLOCK_T"]),)](
            src_table, rms_table, ref, query if per_token else query[r0:r1],
            init_out[r0:r1] if has_init else out, init_lse[r0:r1] if has_init else lse,
            out[r0:r1], lse[r0:r1], len(sources), n_rows, N * d, d, H, W, _pow2(n_rows),
            R=r1 - r0, R_PAD=_pow2(r1 - r0), W_PAD=w_pad, KEY_NORM=bool(inv_rms), SIGMOID=sigmoid,
            PER_TOKEN=per_token, HAS_INIT=has_init, ALIGNED=_aligned(sources), PREFETCH=PREFETCH,
        )
    return out, lse


def read_backward(sources, inv_rms, query, init_out, init_lse, lse, grad_out, grad_lse, heads, sigmoid, per_token,
                  fold_rms=False):
    """Gradients of read_forward: (d_sources (n, N, d), d_inv_rms (n, N) or None, d_query like
    query in fp32, d_init_out (R, N, d) fp32 or None, d_init_lse (R, N, H) or None). fold_rms (one
    head; `inv_rms` the sources' own): the key norm's gradient goes into d_sources, d_inv_rms is None."""
    R, N, d = grad_out.shape
    H, W = heads, d // heads
    device = grad_out.device
    n = len(sources)
    w_pad, n_rows = _pow2(W), N * H
    groups = _reader_groups(R)
    key_norm = bool(inv_rms)
    fold_rms = fold_rms and key_norm
    if fold_rms and H != 1:
        raise ValueError(f"fold_rms with {H} heads: allowed with one head (a row of the kernel is one head, 1/rms the token's)")
    dsrc = torch.empty(n, N, d, device=device, dtype=sources[0].dtype if n else grad_out.dtype)
    drms = torch.empty(n, n_rows, device=device, dtype=torch.float32) if key_norm and not fold_rms else dsrc
    dq_rows = not per_token and H > 1
    if per_token:
        dq = torch.empty(N, d, device=device, dtype=torch.float32)
    elif dq_rows:
        dq = torch.empty(R, N, d, device=device, dtype=torch.float32)
    else:
        dq = None  # a static single-head query's: summed below from dq_parts
    dq_parts = []  # per group, one slice per program (see the kernel)
    has_init = init_out is not None
    do0 = torch.empty(R, N, d, device=device, dtype=init_out.dtype) if has_init else grad_out
    dlse0 = torch.empty(R, N, H, device=device, dtype=torch.float32) if has_init else lse
    scratch = torch.empty(max(n, 1), 3, max(_pow2(r1 - r0) for r0, r1 in groups), n_rows, device=device, dtype=torch.float32)
    src_table, rms_table = _tables(sources, inv_rms, device)
    sms = _sms(device)
    # the persistent grid: programs_per_sm per SM, at most one per row tile; a static query's
    # gradient has a slice per program, as many as the largest candidate grid
    most = min(n_rows, (INTERPRET_PROGRAMS if INTERPRET else max(PROGRAMS_PER_SM)) * sms)
    grid = lambda meta: (min(triton.cdiv(n_rows, meta["BLOCK_T"]), meta["programs_per_sm"] * sms),)  # noqa: E731
    for r0, r1 in groups:  # readers r0..r1-1: slices of the (R, …) tensors
        r_pad = _pow2(r1 - r0)
        if not (per_token or dq_rows):
            dq_parts.append(torch.zeros(most, r_pad, W, device=device, dtype=torch.float32))
        _read_bwd_kernel[grid](
            src_table, rms_table, sources[0] if n else grad_out, query if per_token else query[r0:r1],
            init_out[r0:r1] if has_init else grad_out, init_lse[r0:r1] if has_init else lse, lse[r0:r1],
            grad_out[r0:r1], grad_lse[r0:r1] if grad_lse is not None else lse,
            dsrc, drms, dq if per_token else dq[r0:r1] if dq_rows else dq_parts[-1],
            do0[r0:r1] if has_init else do0, dlse0[r0:r1] if has_init else dlse0, scratch,
            n, n_rows, N * d, d, H, W, _pow2(n_rows),
            R=r1 - r0, R_PAD=r_pad, W_PAD=w_pad, KEY_NORM=key_norm, SIGMOID=sigmoid,
            PER_TOKEN=per_token, HAS_INIT=has_init, HAS_GLSE=grad_lse is not None, DQ_ROWS=dq_rows,
            ALIGNED=_aligned(sources), ACCUMULATE=r0 > 0, DQ_SECOND_PASS=BWD_DQ_SECOND_PASS,
            PREFETCH=PREFETCH, FOLD_RMS=fold_rms,
        )
    if dq_rows:
        dq = dq.view(R, N, d).sum(1)  # row ρ of head h holds channels h·W..h·W+W−1 of the query
    elif not per_token:
        dq = torch.cat([part.sum(0)[: r1 - r0] for part, (r0, r1) in zip(dq_parts, groups)])
    d_rms = drms.view(n, N, H).sum(-1) if key_norm and not fold_rms else None  # the heads of a token share its rms
    return dsrc, d_rms, dq, (do0 if has_init else None), (dlse0 if has_init else None)


def _rms_tiles(d: int) -> tuple[int, int]:
    d_pad = _pow2(d)
    budget = (1 << 16) if INTERPRET else 4096
    t = max(1, budget // d_pad)
    return 1 << (t.bit_length() - 1), (4 if d_pad * 1 <= 4096 else 8)


def inv_rms_forward(x: torch.Tensor, eps: float) -> torch.Tensor:
    N, d = x.shape
    out = torch.empty(N, device=x.device, dtype=torch.float32)
    block_t, warps = _rms_tiles(d)
    _inv_rms_fwd_kernel[(triton.cdiv(N, block_t),)](x, out, N, d, eps, BLOCK_T=block_t, D_PAD=_pow2(d), num_warps=warps)
    return out




def forward(sources, query, init_out, init_lse, heads, sigmoid, per_token, key_norm, eps, out_dtype):
    """cpu_read.forward's contract on the Triton kernels: (R outputs (N, d), lse (R, N, H), 1/rms (n, N))."""
    rhos = [inv_rms_forward(s, eps) for s in sources] if key_norm else []
    out, lse = read_forward(sources, rhos, query, init_out[None] if init_out is not None else None, init_lse, heads, sigmoid,
                            per_token, out_dtype)
    rho = torch.stack(rhos) if rhos else query.new_empty(0, dtype=torch.float32)
    return list(out.unbind(0)), lse, rho


def backward(sources, rho, query, init_out, init_lse, outs, lse, grad_outs, grad_lse, heads, sigmoid, per_token, key_norm,
             eps):
    """cpu_read.backward's contract on the Triton kernels."""
    rhos = list(rho.unbind(0)) if rho.numel() else []
    merge = init_lse is not None
    g = torch.stack([torch.zeros_like(o) if x is None else x for x, o in zip(grad_outs, outs)]).contiguous()
    glse = grad_lse.contiguous() if grad_lse is not None else None
    fold = bool(rhos) and heads == 1  # the kernel folds the key norm's gradient for one head only
    dsrc, drho, dq, do0, dlse0 = read_backward(sources, rhos, query, init_out[None] if merge else None, init_lse, lse, g, glse,
                                               heads, sigmoid, per_token, fold_rms=fold)
    if drho is not None:  # ρ = (mean v² + ε)^(-1/2): ∂ρ/∂v = −ρ³ v / d
        dsrc = dsrc + (-drho * rho.pow(3) / dsrc.shape[-1]).unsqueeze(-1).to(dsrc.dtype) * torch.stack(sources)
    return list(dsrc.unbind(0)), dq.to(query.dtype), (do0[0] if merge else None), dlse0
