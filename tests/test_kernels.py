"""The fused depth-read kernels and the read schedules against the PyTorch reference (CPU).

Two fused implementations are tested, one math: the C kernel of the CPU path
(attnres/kernels/csrc/depth_read.c, built with the system C compiler on first use) and the Triton
kernels. The Triton kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set here for
the test process; the kernels module is imported lazily, on the first kernel call, and avoids
Triton's standard-library jit functions, so it works even if torch imported Triton first). Shapes
are small because the interpreter executes every program in numpy. On a GPU,
benchmarks/gpu_check.py runs the same comparisons on CUDA tensors. Tolerances: 1e-4 for a kernel
against the reference in fp32, 1e-5 between schedules, 1e-4 on the loss after 20 steps.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from attnres import DecoderLM, ModelConfig, ResidualConfig, build_residual, depth_read, kernels  # noqa: E402
from attnres.depth_attention import read  # noqa: E402
from attnres.residuals.attention_residual import FULL_CHUNK  # noqa: E402

needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
TOL = dict(rtol=1e-4, atol=1e-4)
# The fused backends. "cpu" is not skipped where the C kernels cannot be built: they are the CPU
# default, so such a machine fails these tests with the compiler's reason.
FUSED = [pytest.param("triton", marks=needs_triton), "cpu"]


@pytest.fixture
def path():
    """Select the read path and the Block schedule for one test; restore the defaults after."""

    def select(backend, schedule="auto"):
        kernels.set_backend(backend)
        kernels.set_schedule(schedule)

    yield select
    kernels.set_backend(None)
    kernels.set_schedule(None)


def fused_read(backend, *args, **kw):
    """depth_read on a forced fused path (the fixture restores the default after the test)."""
    kernels.set_backend(backend)
    return depth_read(*args, **kw)


def reference(*args, **kw):
    kernels.set_backend("torch")
    return depth_read(*args, **kw)


def _sources(n, shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g) * (0.5 + 0.5 * i)).to(dtype).requires_grad_() for i in range(n)]


# --- one read: the kernel against depth_read ------------------------------------------------------

@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("normaliser", ["softmax", "sigmoid"])
@pytest.mark.parametrize("per_token", [False, True])
# 24: masked, non-power-of-2 widths; 64 with 1 and 16 heads: the C kernels' wide and narrow-head
# vector paths (heads of 64 and of 4 channels; 4 × 8 at d 32 is narrow too)
@pytest.mark.parametrize("heads,d", [(1, 32), (4, 32), (1, 24), (4, 24), (1, 64), (16, 64)])
def test_kernel_read_and_gradients_match_reference(path, backend, key_norm, normaliser, per_token, heads, d):
    shape = (2, 7, d)
    srcs = _sources(5, shape, seed=heads + d)
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(*shape, generator=g) if per_token else torch.randn(d, generator=g)).requires_grad_()
    gain = (1 + 0.3 * torch.randn(d, generator=g)).requires_grad_()
    grad_out = torch.randn(shape, generator=g)
    kw = dict(key_norm=key_norm, normaliser=normaliser, heads=heads, eps=1e-6)
    inputs = srcs + [q] + ([gain] if key_norm else [])

    want = reference(q, srcs, gain, **kw)
    want_grads = torch.autograd.grad(want, inputs, grad_out)
    got = fused_read(backend, q, srcs, gain, **kw)
    got_grads = torch.autograd.grad(got, inputs, grad_out)

    torch.testing.assert_close(got, want, **TOL)
    names = [f"source {i}" for i in range(len(srcs))] + ["query", "key-norm gain"]
    for name, a, b in zip(names, got_grads, want_grads):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"gradient of the {name}: {m}")


@needs_triton
@pytest.mark.parametrize("variant", ["block", "block_multihead", "full_input_query"])
def test_triton_backward_programs_walking_several_row_tiles(path, monkeypatch, variant):
    """On a GPU the backward runs a few programs per SM, each over many row tiles, and sums a
    static query's gradient over its tiles in its own slice. Under the interpreter tiles are large;
    with 2-row tiles the 3 programs walk up to 5 tiles each (uneven last ones). Outputs and
    gradients of the two-phase schedule (1 and 3 readers, 1 and 4 heads, a per-token query) equal
    those with one large tile to 1e-6 (fp32: only the order of the query-gradient sum changes)
    and the PyTorch path's to 1e-4."""
    from attnres.kernels import triton_kernels

    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(5), requires_grad=True)
    subs, ws = _sublayers(8)
    res = _module(variant, 8, block_size=3)
    path("torch", "per_read")
    want = _run(res, x, subs, ws)
    path("triton", "two_phase")
    one_tile = _run(res, x, subs, ws)
    monkeypatch.setattr(triton_kernels, "_tiles", lambda r_pad, w_pad, backward=False: (2, 4))
    _fresh_tuning(monkeypatch, triton_kernels)
    walked = _run(res, x, subs, ws)
    _compare(walked, one_tile, dict(rtol=1e-6, atol=1e-6), f"{variant}, 2-row tiles vs one tile")
    _compare(walked, want, TOL, f"{variant}, 2-row tiles vs the PyTorch path")


@needs_triton
@pytest.mark.parametrize("variant,num_layers", [("full", FULL_CHUNK), ("block_multihead", 8), ("full_sigmoid", 5)])
def test_triton_reads_in_reader_groups_equal_one_group(path, monkeypatch, variant, num_layers):
    """READER_GROUP splits a read's readers over launches (Full's last phase-1 read has FULL_CHUNK
    + 1 readers: groups of 2 and 3 leave a group of 1; block at S = 3 reads with 3 and 4), the
    later groups adding to the sources' gradients: outputs and gradients equal one group's to
    1e-6 (fp32; only the order of the sums over readers changes), and the PyTorch path's to 1e-4."""
    from attnres.kernels import triton_kernels

    monkeypatch.setattr(triton_kernels, "READER_GROUP", None)
    run, want, one_group = _triton_against_torch(path, variant, num_layers, seed=6)
    for size in (1, 2, 3):
        monkeypatch.setattr(triton_kernels, "READER_GROUP", size)
        assert triton_kernels._reader_groups(7)[:2] == [(0, size), (size, 2 * size)]
        grouped = run()
        _compare(grouped, one_group, dict(rtol=1e-6, atol=1e-6), f"{variant}, groups of {size} vs one group")
        _compare(grouped, want, TOL, f"{variant}, groups of {size} vs the PyTorch path")


@needs_triton
@pytest.mark.parametrize("variant,num_layers", [("full", FULL_CHUNK), ("block_multihead", 8), ("full_sigmoid", 5),
                                                ("full_input_query", 6)])
def test_triton_query_gradient_from_a_second_pass_equals_the_first_passes(path, monkeypatch, variant, num_layers):
    """BWD_DQ_SECOND_PASS: the backward reads the sources again for the query gradient once Δ is
    known, instead of accumulating it around a running mean in its first pass. Static queries (one
    and four heads: per-program and per-row partial sums) and per-token queries, softmax and
    sigmoid: outputs and every gradient equal the one-pass backward's to 1e-5 (fp32; the sums run
    in another order) and the PyTorch path's to 1e-4."""
    from attnres.kernels import triton_kernels

    monkeypatch.setattr(triton_kernels, "BWD_DQ_SECOND_PASS", False)
    run, want, one_pass = _triton_against_torch(path, variant, num_layers, seed=7)
    monkeypatch.setattr(triton_kernels, "BWD_DQ_SECOND_PASS", True)
    second = run()
    _compare(second, one_pass, dict(rtol=1e-5, atol=1e-5), f"{variant}, dq in a second pass vs the first")
    _compare(second, want, TOL, f"{variant}, dq in a second pass vs the PyTorch path")


# Knobs that change when loads are issued, how a sum is reduced or which node of autograd adds a
# term, not the math: toggled, every output and gradient equals the untoggled one to this
# tolerance (fp32).
ORDER_KNOBS = {"PREFETCH": 1e-6}


@needs_triton
@pytest.mark.parametrize("knob", sorted(ORDER_KNOBS))
@pytest.mark.parametrize("variant,num_layers,others", [
    ("full", FULL_CHUNK, {}), ("full_input_query", 6, {}),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (  # the default run's time: these in CI's slow run
        ("block_multihead", 8, {}), ("full_sigmoid", 5, {}),
        ("full", FULL_CHUNK, {"READER_GROUP": None, "BWD_DQ_SECOND_PASS": False})))])
def test_triton_knobs_of_order_change_nothing(path, monkeypatch, knob, variant, num_layers, others):
    """PREFETCH: each loop over the sources loads source i + 1 before it uses source i (the last
    iteration's load masked off): only when the loads are issued changes (1e-6). Toggled, with the
    other knobs at their defaults and with one reader group and the one-pass backward: outputs and
    every gradient equal the untoggled ones, and the PyTorch path's to 1e-4 (fp32)."""
    from attnres.kernels import triton_kernels

    for name, value in others.items():
        monkeypatch.setattr(triton_kernels, name, value)
    run, want, plain = _triton_against_torch(path, variant, num_layers, seed=8)
    monkeypatch.setattr(triton_kernels, knob, not getattr(triton_kernels, knob))
    toggled = run()
    tol = dict(rtol=ORDER_KNOBS[knob], atol=ORDER_KNOBS[knob])
    _compare(toggled, plain, tol, f"{variant}, {knob} toggled vs not")
    _compare(toggled, want, TOL, f"{variant}, {knob} toggled vs the PyTorch path")


def _fresh_tuning(monkeypatch, tk):
    """The autotuner's choices forgotten for this test, and the earlier ones back after it."""
    for kernel in (tk._read_fwd_kernel, tk._read_bwd_kernel):
        monkeypatch.setattr(kernel, "cache", {})


@needs_triton
def test_autotune_candidates_fit_the_tile_budget_and_the_rows(monkeypatch):
    """What the autotuner times on a GPU (the interpreter's flag switched off; nothing runs):
    rows per program T with R_PAD·T·W_PAD in the tile budget (1k..8k elements forward, 1k..4k
    backward), 4 and 8 warps, 4 and 8 backward programs per SM; at d 2048 one row per program
    (the measured forward default) is among them; a one-row read (decoding one sequence) gets one
    row per program; a tile over the budget at T = 1 keeps T = 1. Under the interpreter: one
    candidate, large tiles."""
    from attnres.kernels import triton_kernels as tk

    def rows(r_pad, w_pad, n_rows, backward):
        configs = tk._candidates(tk._configs(backward), dict(R_PAD=r_pad, W_PAD=w_pad, n_rows=n_rows), backward)
        return sorted({c.kwargs["BLOCK_T"] for c in configs}), configs

    assert [len(c) for _, c in (rows(1, 2048, 16384, False), rows(1, 2048, 16384, True))] == [1, 1]
    assert rows(1, 2048, 16384, False)[1][0].kwargs["BLOCK_T"] == tk._tiles(1, 2048)[0] == 32
    monkeypatch.setattr(tk, "INTERPRET", False)
    fwd, configs = rows(1, 2048, 16384, False)
    assert fwd == [1, 2, 4] and sorted({c.num_warps for c in configs}) == [4, 8] and len(configs) == 6
    bwd, configs = rows(1, 2048, 16384, True)
    assert bwd == [1, 2] and len(configs) == 8 and {c.kwargs["programs_per_sm"] for c in configs} == {4, 8}
    assert rows(4, 1024, 16384, False)[0] == [1, 2] and rows(16, 1024, 16384, True)[0] == [1]
    assert rows(1, 64, 16384, False)[0] == [16, 32, 64] and rows(1, 64, 16384, True)[0] == [16, 32, 64]
    assert rows(1, 1024, 1, False)[0] == [1] and rows(1, 64, 3, True)[0] == [4]


@needs_triton
@pytest.mark.parametrize("variant,num_layers,group", [("full", FULL_CHUNK, 2), ("full_input_query", 6, None),
                                                      pytest.param("block_multihead", 8, None, marks=pytest.mark.slow)])
def test_autotuning_leaves_the_results_of_one_run(path, monkeypatch, variant, num_layers, group):
    """The autotuner runs each candidate several times before the real run. Two candidates (2-row
    and large tiles), each run twice when timed, the 2-row one chosen: outputs and gradients equal
    an untimed run's to 1e-6 (fp32: only the order of the query-gradient sums changes), reader
    groups that add to the sources' gradients (Full's 9 readers in groups of 2) and static query
    slices included, and the PyTorch path's to 1e-4."""
    from attnres.kernels import triton_kernels as tk

    monkeypatch.setattr(tk, "READER_GROUP", group)
    run, want, untimed = _triton_against_torch(path, variant, num_layers, seed=9)

    def two(configs, args, backward):
        big = tk._tiles(args["R_PAD"], args["W_PAD"], backward)[0]
        extra = {"programs_per_sm": tk.INTERPRET_PROGRAMS} if backward else {}
        return [tk.triton.Config({"BLOCK_T": t, **extra}, num_warps=4) for t in (2, big)]

    timed = []

    def bench(kernel_call, quantiles):
        kernel_call()
        kernel_call()
        timed.append(1)
        return [1.0 if len(timed) % 2 else 2.0] * 3  # the first of each pair (2-row tiles) is faster

    _fresh_tuning(monkeypatch, tk)
    monkeypatch.setattr(tk, "_candidates", two)
    monkeypatch.setattr(tk, "_bench", bench)
    tuned = run()
    assert timed and {c["BLOCK_T"] for c in tk.chosen()} == {2}
    _compare(tuned, untimed, dict(rtol=1e-6, atol=1e-6), f"{variant}, tuned vs untimed")
    _compare(tuned, want, TOL, f"{variant}, tuned vs the PyTorch path")


@needs_triton
def test_knobs_hold_within_their_block_only():
    """triton_kernels.knobs (how gpu_check and tile_sweep try a knob): the values inside the block,
    the previous ones after it, also when the block raises; a name that is no knob is one error."""
    from attnres.kernels import triton_kernels as tk

    before = (tk.READER_GROUP, tk.BWD_DQ_SECOND_PASS)
    inside = (3 if before[0] == 2 else 2, not before[1])
    with pytest.raises(RuntimeError, match="inside"):
        with tk.knobs(READER_GROUP=inside[0], BWD_DQ_SECOND_PASS=inside[1]):
            assert (tk.READER_GROUP, tk.BWD_DQ_SECOND_PASS) == inside
            assert tk._reader_groups(5)[0] == (0, inside[0])
            raise RuntimeError("inside")
    assert (tk.READER_GROUP, tk.BWD_DQ_SECOND_PASS) == before
    with pytest.raises(ValueError, match="READER_GROUPS: not a knob of the Triton kernels; allowed: READER_GROUP"):
        with tk.knobs(READER_GROUPS=2):
            pass


@needs_triton
def test_pointer_tables_are_kept_by_their_pointers(monkeypatch):
    """A read's table holds its sources' data pointers, then their 1/rms' (a view from the n-th
    entry), then 0 (what PREFETCH's load past the last source reads); the same pointers again find
    the same table, other pointers another one, and the oldest table goes first when the cache is full."""
    from attnres.kernels import triton_kernels

    monkeypatch.setattr(triton_kernels, "_TABLES", {})
    monkeypatch.setattr(triton_kernels, "_TABLES_KEPT", 2)
    cpu = torch.device("cpu")
    a, b, ra, rb = (torch.randn(4, 3), torch.randn(4, 3), torch.randn(4), torch.randn(4))
    src, rms = triton_kernels._tables([a, b], [ra, rb], cpu)
    assert src.tolist() == [t.data_ptr() for t in (a, b, ra, rb)] + [0] and rms.tolist() == [ra.data_ptr(), rb.data_ptr(), 0]
    again, _ = triton_kernels._tables([a, b], [ra, rb], cpu)
    assert again is src
    raw, raw_rms = triton_kernels._tables([b, a], [], cpu)  # raw keys: one table, both names
    assert raw.tolist() == [b.data_ptr(), a.data_ptr(), 0] and raw_rms is raw
    triton_kernels._tables([a], [], cpu)  # a third table: the first one goes
    assert triton_kernels._tables([a, b], [ra, rb], cpu)[0] is not src


@pytest.mark.parametrize("backend", FUSED)
def test_kernel_single_source_and_long_source_list(path, backend):
    """1 and 13 sources, and 70: past the 64 sources the C kernel's one-reader path takes."""
    for n in (1, 13, 70):
        srcs = _sources(n, (3, 5, 16), seed=n)
        q = torch.randn(16, generator=torch.Generator().manual_seed(n), requires_grad=True)
        got, want = fused_read(backend, q, srcs), reference(q, srcs)
        torch.testing.assert_close(got, want, **TOL)
        g = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
        for a, b in zip(torch.autograd.grad(got, [q, *srcs], g), torch.autograd.grad(want, [q, *srcs], g)):
            torch.testing.assert_close(a, b, **TOL)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_low_precision_inputs_accumulate_in_fp32(path, dtype):
    """bf16/fp16 storage, fp32 arithmetic: the result is the fp32 read of the rounded inputs,
    rounded once at the end (the Triton kernels; the C kernels read fp32 only)."""
    srcs = _sources(6, (2, 9, 32), seed=3, dtype=dtype)
    q = torch.randn(32, generator=torch.Generator().manual_seed(4))
    got = fused_read("triton", q, srcs)
    want = reference(q, [s.float() for s in srcs]).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2 * torch.finfo(dtype).eps * want.abs().max().item())
    got.float().sum().backward()
    assert all(s.grad is not None and s.grad.dtype == dtype for s in srcs)


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("normaliser", ["softmax", "sigmoid"])
@pytest.mark.parametrize("heads", [1, 2])
def test_phase_one_and_merge_equal_one_read(path, backend, normaliser, heads):
    """The two phases at the op level: R queries read the early sources at once (phase one), and
    continuing each reader's read with the late sources (depth_read's state) equals one read of all,
    outputs and gradients, on the fused path and on the reference."""
    d, N, R = 16, 11, 3
    early, late = _sources(4, (N, d), seed=5), _sources(2, (N, d), seed=6)
    Q = torch.randn(R, d, generator=torch.Generator().manual_seed(7), requires_grad=True)
    kw = dict(normaliser=normaliser, heads=heads)
    path(backend)
    outs, lse, _ = read(Q, early, kernel=kernels.path(*early, Q), with_lse=True, **kw)
    merged = torch.stack([depth_read(Q[r], late, state=(outs[r], lse[r]), **kw) for r in range(R)])
    path("torch")
    for r in range(R):
        torch.testing.assert_close(outs[r], depth_read(Q[r], early, **kw), **TOL)
    want = torch.stack([depth_read(Q[r], early + late, **kw) for r in range(R)])
    torch.testing.assert_close(merged, want, **TOL)
    g = torch.randn(R, N, d, generator=torch.Generator().manual_seed(8))
    inputs = early + late + [Q]
    for a, b in zip(torch.autograd.grad(merged, inputs, g), torch.autograd.grad(want, inputs, g)):
        torch.testing.assert_close(a, b, **TOL)


PEAKED_CASES = {  # name: (backend, heads, scale of the query, seed): logits of tens to hundreds
    "one-reader lanes of depth_read.c": ("cpu", 1, 10.0, 0),
    "one-reader lanes of depth_read.c, larger": ("cpu", 1, 30.0, 1),
    "one-reader lanes of depth_read.c, saturated": ("cpu", 1, 1e6, 0),
    "tiles of depth_read.c (2 heads)": ("cpu", 2, 30.0, 3),
    "Triton": ("triton", 1, 10.0, 0),
    "Triton (2 heads)": ("triton", 2, 30.0, 0),
    "Triton, dq pass toggled": ("triton_dq_toggled", 1, 10.0, 0),
    "Triton, dq pass toggled (2 heads)": ("triton_dq_toggled", 2, 30.0, 0),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=needs_triton) if PEAKED_CASES[c][0].startswith("triton") else c
                                  for c in sorted(PEAKED_CASES)])
def test_gradients_through_a_peaked_softmax_are_as_precise_as_the_pytorch_paths(path, monkeypatch, case):
    """Large logits (a static query of 10 to 1e6 times a random one over normalised keys): the
    weights are nearly one hot, and every gradient is a difference of terms that cancel, so fp32
    itself loses digits there (the PyTorch path's gradients are off by up to 1e-2 against
    float64). The kernels recompute the weights as e^(t − lse) from the forward's fp32 lse; they
    must lose no more than the PyTorch path: for each input's gradient (sources, query, key-norm
    gain), fp32, error against float64 at most 2 × the PyTorch path's + 1e-6 of the largest
    gradient. Weights that do not sum to 1 in Δ = Σ α g·v, or Δ = g·out (which does not cancel
    g·v of the heaviest source), or scores rounded differently forward and backward, once made
    the kernels' error 10× to 2e5× the PyTorch path's."""
    backend, heads, scale, seed = PEAKED_CASES[case]
    g = torch.Generator().manual_seed(seed)
    d, n = 12, 5
    us = [torch.randn(2, 3, d, generator=g, dtype=torch.float64) * (0.5 + 0.3 * i) for i in range(n)]
    q = torch.randn(d, generator=g, dtype=torch.float64) * scale
    gain = 1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    grad = torch.randn(2, 3, d, generator=g, dtype=torch.float64)

    def gradients(read, dtype):
        x = [t.to(dtype).requires_grad_() for t in (*us, q, gain)]
        return torch.autograd.grad(read(x[:n], x[n], x[n + 1]), x, grad.to(dtype))

    def on_reference(s, q, gain):
        return reference(q, s, gain, heads=heads)

    def kernel(s, q, gain):
        return fused_read("triton" if backend.startswith("triton") else backend, q, s, gain, heads=heads)

    exact = gradients(on_reference, torch.float64)
    pytorch = gradients(on_reference, torch.float32)
    if backend == "triton_dq_toggled":
        from attnres.kernels import triton_kernels

        monkeypatch.setattr(triton_kernels, "BWD_DQ_SECOND_PASS", not triton_kernels.BWD_DQ_SECOND_PASS)
    got = gradients(kernel, torch.float32)
    floor = 1e-6 * max(e.abs().max().item() for e in exact)
    names = [f"source {i}" for i in range(n)] + ["query", "key-norm gain"]
    for name, a, p, e in zip(names, got, pytorch, exact):
        allowed = 2 * (p.double() - e).abs().max().item() + floor
        assert (a.double() - e).abs().max().item() <= allowed, f"gradient of the {name}"


# --- the residual module: paths and schedules give the same model ----------------------------------

D, L = 16, 6
VARIANTS = ["full", "full_sigmoid", "full_no_rmsnorm", "full_input_query", "full_scalar", "sliding_window",
            "block", "block_multihead", "block_no_rmsnorm"]


def _module(variant, num_layers=L, block_size=3, seed=0):
    res = build_residual(ResidualConfig(name=variant, block_size=block_size, heads=4, window=3), D, num_layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in res.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else noise * (0.3 if "projections" in name else 1.0))
    return res


def _sublayers(n):
    g = torch.Generator().manual_seed(99)
    ws = [torch.nn.Parameter(torch.randn(D, D, generator=g) / D**0.5) for _ in range(n)]
    return [lambda h, w=w: torch.tanh(h @ w) + 0.1 * h for w in ws], ws


def _run(res, x, subs, ws):
    """Output, and gradients of a fixed function of it w.r.t. the embedding, every residual
    parameter (queries, key-norm gains, projections, logits) and the sublayers' weights."""
    out = res(x, subs)
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    params = [p for _, p in sorted(res.named_parameters())]
    grads = torch.autograd.grad(loss, [x] + params + ws)
    return out.detach(), grads


def _triton_against_torch(path, variant, num_layers, seed):
    """For a Triton knob's tests: a run of a residual stream (S = 3) on the Triton path, two-phase;
    the PyTorch path's result (per read), and the Triton result with the knobs at their defaults."""
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    subs, ws = _sublayers(num_layers)
    res = _module(variant, num_layers, block_size=3)
    path("torch", "per_read")
    want = _run(res, x, subs, ws)
    path("triton", "two_phase")
    return (lambda: _run(res, x, subs, ws)), want, _run(res, x, subs, ws)


def _compare(a, b, tol, what):
    torch.testing.assert_close(a[0], b[0], **tol, msg=lambda m: f"{what}, output: {m}")
    for i, (ga, gb) in enumerate(zip(a[1], b[1])):
        torch.testing.assert_close(ga, gb, **tol, msg=lambda m, i=i: f"{what}, gradient {i}: {m}")


@pytest.mark.parametrize("S,num_layers", [(1, 6), (2, 6), (4, 6), (4, 10), (3, 8)])  # 6 = 4 + 2, 10 = 4 + 4 + 2, 8 = 3 + 3 + 2
@pytest.mark.parametrize("variant", ["block", "block_multihead", "block_no_rmsnorm"])
def test_two_phase_equals_one_read_per_sublayer_torch(path, variant, S, num_layers):
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(S), requires_grad=True)
    subs, ws = _sublayers(num_layers)
    res = _module(variant, num_layers, block_size=S)
    path("torch", "per_read")
    ref = _run(res, x, subs, ws)
    path("torch", "two_phase")
    _compare(_run(res, x, subs, ws), ref, dict(rtol=1e-5, atol=1e-5), f"{variant} S={S} L={num_layers}")


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("S,num_layers", [(1, 4), (2, 4), (4, 6)])
def test_two_phase_equals_one_read_per_sublayer_fused(path, backend, S, num_layers):
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(S), requires_grad=True)
    subs, ws = _sublayers(num_layers)
    res = _module("block", num_layers, block_size=S)
    path(backend, "per_read")
    ref = _run(res, x, subs, ws)
    path(backend, "two_phase")
    _compare(_run(res, x, subs, ws), ref, dict(rtol=1e-5, atol=1e-5), f"{backend} block S={S} L={num_layers}")


@pytest.mark.parametrize("num_layers", [FULL_CHUNK - 1, FULL_CHUNK, 2 * FULL_CHUNK + 1])  # a partial chunk, one, a remainder
@pytest.mark.parametrize("variant", ["full", "full_sigmoid", "full_no_rmsnorm"])
def test_full_two_phase_equals_one_read_per_sublayer(path, variant, num_layers):
    """float64, to 1e-10: the same function. (In fp32 a chunk of 8 readers sums the embedding's
    gradient in another order than 8 separate reads; the two differ by rounding, ~2e-5 relative
    with these peaked random queries; the fp32 comparisons of the paths are in the tests below.)"""
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(num_layers), dtype=torch.float64, requires_grad=True)
    subs, ws = _sublayers(num_layers)
    for w in ws:
        w.data = w.data.double()
    res = _module(variant, num_layers).double()
    path("torch", "per_read")
    ref = _run(res, x, subs, ws)
    path("torch", "two_phase")
    _compare(_run(res, x, subs, ws), ref, dict(rtol=1e-10, atol=1e-10), f"{variant} L={num_layers}")


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_path_matches_torch_path_for_every_variant(path, backend, variant):
    """Outputs and gradients (embedding, queries, gains, projections, sublayers) of the whole
    residual stream, fused path (Triton or C) against the PyTorch path, fp32."""
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
    subs, ws = _sublayers(L)
    res = _module(variant)
    path("torch", "per_read")
    ref = _run(res, x, subs, ws)
    path(backend, "two_phase")
    _compare(_run(res, x, subs, ws), ref, TOL, f"{variant}: {backend} vs PyTorch")


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("variant", ["full", "full_sigmoid"])
def test_fused_full_over_several_chunks_matches_torch_path(path, backend, variant):
    """Full AttnRes deep enough for two whole chunks and a remainder (phase-1 reads of many sources
    by FULL_CHUNK + 1 readers), fused two-phase against the PyTorch path read by read, fp32."""
    num_layers = 2 * FULL_CHUNK + 3
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    subs, ws = _sublayers(num_layers)
    res = _module(variant, num_layers)
    path("torch", "per_read")
    ref = _run(res, x, subs, ws)
    path(backend, "two_phase")
    _compare(_run(res, x, subs, ws), ref, TOL, f"{variant} L={num_layers}: {backend} vs PyTorch")


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("variant", ["block", "full"])
def test_fused_path_with_autocast_style_mixed_types(path, backend, variant):
    """fp32 embedding, bf16 sublayer outputs (what autocast produces): the Triton kernels read the
    sources in bf16; the C kernels, which the plan chose from the fp32 embedding, read them widened
    to fp32 (exactly); both agree with the PyTorch path to bf16 precision."""
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(0))
    subs, _ = _sublayers(L)
    subs = [lambda h, f=f: f(h).to(torch.bfloat16) for f in subs]
    res = _module(variant)
    path("torch", "per_read")
    want = res(x, subs)
    path(backend, "two_phase")
    got = res(x, subs)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_torch_path_matches_reference_reads_with_weights(path):
    """Recording the depth weights (which reads one sublayer at a time, on the reference) changes
    the output by rounding at most: 1e-6 on either schedule, fp32; the weights sum to 1."""
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0))
    subs, _ = _sublayers(L)
    for schedule in ("per_read", "two_phase"):
        path("torch", schedule)
        res = _module("block")
        out, w = res(x, subs, return_weights=True)
        torch.testing.assert_close(out, res(x, subs), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("variant", ["block", "full"])
def test_kv_cached_decoding_on_the_fused_paths_equals_the_full_forward(path, backend, variant):
    """Decoding one sequence reads one row per step (the smallest tiles): prefill of 3 tokens, then
    one token at a time, on the fused path, equals that path's full forward and the PyTorch
    path's to 1e-5 (fp32)."""
    torch.manual_seed(0)
    m = DecoderLM(ModelConfig(d_model=D, layers=2, n_heads=2, max_seq_len=8), ResidualConfig(name=variant, block_size=2))
    with torch.no_grad():
        for p in m.residual.parameters():
            p.add_(0.3 * torch.randn_like(p))
    idx = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    path("torch")
    with torch.no_grad():
        want = m(idx)[0]
        path(backend)
        full = m(idx)[0]
        cache = m.kv_cache(1)
        steps = torch.cat([m(idx[:, :3], cache=cache)[0]] + [m(idx[:, t : t + 1], cache=cache)[0] for t in range(3, 6)], 1)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(steps, want, rtol=1e-5, atol=1e-5)


# --- training: the fused path and the reference path are the same model --------------------------

@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("variant", ["block", "full"])
def test_twenty_training_steps_reach_the_same_loss(path, backend, variant):
    cfg = ModelConfig(d_model=16, layers=2, n_heads=2, vocab_size=32, max_seq_len=8)
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = {}
    for name, chosen, schedule in (("reference", "torch", "per_read"), ("fused", backend, "two_phase")):
        path(chosen, schedule)
        torch.manual_seed(0)
        model = DecoderLM(cfg, ResidualConfig(name=variant, block_size=2))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(20):
            _, loss = model(idx[:, :-1], idx[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[name] = loss.item()
    assert abs(losses["fused"] - losses["reference"]) <= 1e-4, losses


# --- compilation, and a core without Triton ---------------------------------------------------------

@pytest.mark.parametrize(
    "backend,variant",
    [("torch", v) for v in ("block", "full")]
    + [pytest.param("torch", v, marks=pytest.mark.slow) for v in ("full_input_query", "sliding_window", "full_scalar", "mhc")]
    + [pytest.param("triton", v, marks=needs_triton) for v in ("block", "full")]
    + [("cpu", v) for v in ("block", "full", "full_input_query")],
)
def test_paths_trace_with_torch_compile(path, backend, variant):
    """One graph, no break (fullgraph=True): AOTAutograd traces the PyTorch path's autograd
    functions and the kernels' custom ops (fake tensors, registered backward). aot_eager keeps
    the test fast; the numbers move by rounding only."""
    path(backend, "two_phase")
    torch._dynamo.reset()
    res = _module(variant, num_layers=4, block_size=2)
    subs, ws = _sublayers(4)
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
    want = _run(res, x, subs, ws)
    compiled = torch.compile(res, backend="aot_eager", fullgraph=True)
    # the same kernels (fp32); the compiled graph may sum a parameter's gradient over its uses in
    # another order, which moves a gradient with cancellation by ~1e-6 absolute
    tol = dict(rtol=1e-6, atol=5e-6)
    _compare(_run(compiled, x, subs, ws), want, tol, f"compiled {backend} path, {variant}")
    # Without grad too (an evaluation of a compiled model): Dynamo then inlines an
    # autograd.Function's forward, and once read its arguments shifted by one (a graph break).
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, subs), want[0], **tol)


def test_the_pointer_table_reads_stay_out_of_cuda_graphs():
    """The read ops copy a host-built pointer table at each call, which a CUDA graph cannot
    capture: they carry the tag that makes torch.compile's CUDA-graph modes leave them out."""
    for op in (torch.ops.attnres.depth_read.default, torch.ops.attnres.depth_read_backward.default):
        assert torch.Tag.cudagraph_unsafe in op.tags, op


def test_a_compiled_residual_recompiles_once_for_new_sequence_lengths(path):
    """torch.compile's default (dynamic=None): the first new token count recompiles the read with
    a symbolic one, and no later count compiles again (README), in training and in generation.
    The PyTorch path's tiling looped range() over the token count, on which Dynamo specialised:
    every new length compiled again, and after 8 of them torch ran the module eagerly."""
    from torch._dynamo.testing import CompileCounterWithBackend

    path("torch", "two_phase")
    torch._dynamo.reset()
    res = _module("block", num_layers=4, block_size=2)
    subs, ws = _sublayers(4)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(res, backend=counter)
    for T in (2, 3, 4):
        x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(T), requires_grad=True)
        _run(compiled, x, subs, ws)
        with torch.no_grad():
            compiled(x, subs)
    # with and without grad (another graph each): the static one, then the dynamic one
    assert counter.frame_count == 4, f"{counter.frame_count} compilations for 3 sequence lengths"


def test_core_imports_and_trains_without_triton():
    code = r"""
import sys, importlib.abc
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")
sys.meta_path.insert(0, NoTriton())
import torch, attnres
from attnres import DecoderLM, ModelConfig, ResidualConfig, kernels
m = DecoderLM(ModelConfig(d_model=16, layers=2, n_heads=2, max_seq_len=8), ResidualConfig(name="block", block_size=2))
_, loss = m(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
loss.backward()
assert "triton" not in sys.modules
kernels.set_backend("triton")
try:
    m(torch.randint(0, 256, (2, 8)))
except RuntimeError as e:
    print("refused:", e)
"""
    env = {k: v for k, v in os.environ.items() if k != "ATTNRES_KERNEL"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "Triton" in out.stdout


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("heads", [5, 0, -4])
def test_heads_that_do_not_divide_d_are_refused_in_one_line(path, backend, heads):
    """d = 12: 5 does not divide it; 0 was a ZeroDivisionError, -4 (which "divides" 12) a reshape
    error deep inside the read."""
    path("torch" if backend == "reference" else backend)
    srcs = _sources(2, (1, 3, 12), seed=0)
    with pytest.raises(ValueError, match="heads"):
        depth_read(torch.zeros(12), srcs, heads=heads)


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="allowed: auto, triton, cpu, torch"):
        kernels.set_backend("cuda")
    with pytest.raises(ValueError, match="allowed: auto, two_phase, per_read"):
        kernels.set_schedule("fast")
