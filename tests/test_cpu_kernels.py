"""The C kernels of the CPU path around their math (tested in test_kernels.py): when they are
chosen, how they are built and cached, what happens without a compiler, and that splitting tokens
across threads does not change the result."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnres import DecoderLM, ModelConfig, ResidualConfig, kernels
from attnres.kernels import cpu_kernels, native

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("ATTNRES_KERNEL", "CC")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=ROOT, timeout=300)


def test_auto_chooses_the_c_kernels_for_fp32_cpu_only():
    x = torch.zeros(2, 3, 8)
    kernels.set_backend(None)
    assert kernels.use_fused(x)
    assert not kernels.use_fused(x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not kernels.use_fused(x)
    kernels.set_backend("torch")
    try:
        assert not kernels.use_fused(x)
    finally:
        kernels.set_backend(None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_an_fp32_embedding_read_by_a_module_of_another_type_takes_the_pytorch_path(dtype):
    """auto chose the C kernels from the embedding's type alone, which then refused the module's
    bf16 / float64 queries ("the C kernels take contiguous fp32 CPU tensors"), although the PyTorch
    path reads such a mix (and did with ATTNRES_KERNEL=torch, or a bf16 embedding and an fp32
    module). auto now leaves it to the PyTorch path: the same result as forcing it, bit for bit."""
    from attnres import BlockAttentionResidual

    torch.manual_seed(0)
    res = BlockAttentionResidual(16, 4, num_blocks=2).to(dtype)
    with torch.no_grad():
        for p in res.parameters():
            p.add_(0.3 * torch.randn_like(p))
    sublayers = [torch.nn.Linear(16, 16) for _ in range(4)]
    x = torch.randn(2, 3, 16)
    kernels.set_backend(None)
    try:
        got = res(x, sublayers)
        assert kernels.use_fused(x, res.output_query.float())  # matching types: the C kernels
        assert not kernels.use_fused(x, res.output_query)
        kernels.set_backend("torch")
        want = res(x, sublayers)
    finally:
        kernels.set_backend(None)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_cpu_backend_refuses_what_it_cannot_read():
    kernels.set_backend("cpu")
    try:
        with pytest.raises(RuntimeError, match="fp32 CPU tensors"):
            kernels.use_fused(torch.zeros(2, 8, dtype=torch.float64))
    finally:
        kernels.set_backend(None)
    with pytest.raises(ValueError, match="contiguous fp32 CPU tensors"):
        cpu_kernels.inv_rms_forward(torch.zeros(8, 4).t(), 1e-6)


def test_build_is_cached_per_machine(tmp_path):
    """First use compiles one library into the cache; a second process loads it as it is."""
    code = "from attnres.kernels import cpu_kernels; assert cpu_kernels.available(); print('ok')"
    first = _python(code, ATTNRES_CACHE_DIR=str(tmp_path))
    assert first.returncode == 0 and "ok" in first.stdout, first.stderr
    built = list(tmp_path.glob("depth_read-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    second = _python(code, ATTNRES_CACHE_DIR=str(tmp_path))
    assert second.returncode == 0, second.stderr
    assert [p.name for p in tmp_path.iterdir()] == [built[0].name]  # no temporary left, no rebuild
    assert built[0].stat().st_mtime_ns == stamp


def test_without_a_compiler_auto_falls_back_and_cpu_says_why(tmp_path):
    code = r"""
import torch
from attnres import DecoderLM, ModelConfig, ResidualConfig, kernels
x = torch.zeros(2, 8)
print("fused:", kernels.use_fused(x))
m = DecoderLM(ModelConfig(d_model=16, layers=2, n_heads=2, max_seq_len=8), ResidualConfig(name="block", block_size=2))
_, loss = m(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
loss.backward()
kernels.set_backend("cpu")
try:
    kernels.use_fused(x)
except RuntimeError as e:
    print("refused:", e)
"""
    out = _python(code, CC=str(tmp_path / "no-such-cc"), ATTNRES_CACHE_DIR=str(tmp_path / "cache"))
    assert out.returncode == 0, out.stderr
    assert "fused: False" in out.stdout
    assert "refused: the C kernels (ATTNRES_KERNEL=cpu) could not be built" in out.stdout
    assert "no-such-cc" in out.stdout  # the reason names the compiler that was tried


@pytest.mark.parametrize("d,heads", [(80, 1), (80, 5), (128, 1), (128, 2)])
@pytest.mark.parametrize("per_token", [False, True])
def test_register_blocks_with_a_channel_tail_and_a_token_remainder(d, heads, per_token):
    """d 80 = a 64-channel register block and a 16-channel tail (heads of 80 and 16 channels: a
    weight per 16-channel chunk); d 128 = two blocks, heads of 128 and 64 channels (one weight per
    block row, mix_block's wide path); 210 tokens = three 64-token tiles and a remainder; six
    sources (a block of 4 rows and a tail of 2 in the gradients' mixing). Output and gradients of
    every input against the float64 reference, fp32 kernels, to 1e-4 relative to each tensor's
    largest entry (queries scaled by 1/√d, as a trained model's logits)."""
    from attnres import depth_read

    kernels.set_backend("cpu")
    try:
        g = torch.Generator().manual_seed(heads)
        shape = (3, 70, d)
        srcs = [(torch.randn(*shape, generator=g) * (0.5 + 0.3 * i)).requires_grad_() for i in range(6)]
        q = ((torch.randn(*shape, generator=g) if per_token else torch.randn(d, generator=g)) / d**0.5).requires_grad_()
        gain = (1 + 0.3 * torch.randn(d, generator=g)).requires_grad_()
        grad = torch.randn(shape, generator=g)
        inputs = srcs + [q, gain]
        got = kernels.fused_depth_read(q, srcs, gain, heads=heads)
        got_grads = torch.autograd.grad(got, inputs, grad)
        exact = [x.detach().double().requires_grad_() for x in inputs]
        want = depth_read(exact[6], exact[:6], exact[7], heads=heads)
        want_grads = torch.autograd.grad(want, exact, grad.double())
        for a, b in zip([got, *got_grads], [want, *want_grads]):
            torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4 * b.abs().max().item())
    finally:
        kernels.set_backend(None)


@pytest.mark.parametrize("R", [1, 3])  # one reader: the 16-token-lane path; several: the tiles
def test_threads_split_tokens_without_changing_the_result(monkeypatch, R):
    """Two token ranges on two threads against one range, fp32: outputs and source gradients to
    1e-6 (a token at a range's end may fall in a vector loop's tail instead of its body, which
    contracts multiply-adds differently), the static-query gradient, summed in fp32 over tiles of
    64 tokens (groups of 16 for one reader) that the split groups differently, to 5e-5 relative."""
    g = torch.Generator().manual_seed(0)
    N, d = 1000, 32
    srcs = [torch.randn(N, d, generator=g) for _ in range(5)]
    rms = [cpu_kernels.inv_rms_forward(s, 1e-6) for s in srcs]
    q = torch.randn(R, d, generator=g)
    grad = torch.randn(R, N, d, generator=g)
    results = {}
    for threads in (1, 2):
        monkeypatch.setenv("ATTNRES_CPU_THREADS", str(threads))
        assert len(cpu_kernels._ranges(N)) == threads
        out, lse = cpu_kernels.read_forward(srcs, rms, q, None, None, 1, False, False, torch.float32)
        results[threads] = (out, lse, *cpu_kernels.read_backward(srcs, rms, q, None, None, lse, grad, None, 1, False, False)[:3])
    for a, b in zip(results[1][:4], results[2][:4]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[1][4], results[2][4], rtol=5e-5, atol=5e-5)


def test_the_default_cpu_model_runs_the_c_kernels():
    """The fused path is the default on CPU: a Block model's reads go through the C kernels."""
    calls = []
    original = cpu_kernels.read_forward

    def counting(*args, **kw):
        calls.append(1)
        return original(*args, **kw)

    kernels.set_backend(None)
    cpu_kernels.read_forward = counting
    try:
        m = DecoderLM(ModelConfig(d_model=16, layers=2, n_heads=2, max_seq_len=8), ResidualConfig(name="block", block_size=2))
        m(torch.randint(0, 256, (2, 8)))
    finally:
        cpu_kernels.read_forward = original
    assert calls, "the default CPU path did not call the C kernels"
    assert native.why_unavailable("depth_read") is None


def test_auto_routes_compiled_cpu_reads_to_the_pytorch_path():
    """Under torch.compile, where Inductor fuses the PyTorch path (measured faster than the C
    kernels behind a custom op), auto does not choose the C kernels; in eager mode it does."""
    from attnres import build_residual
    from attnres.kernels.readers import FusedReader

    single = build_residual(ResidualConfig(name="block", block_size=2), 16, 4)
    kernels.set_backend(None)
    seen = []
    original = cpu_kernels.read_forward
    cpu_kernels.read_forward = lambda *a, **k: seen.append(1) or original(*a, **k)
    try:
        assert isinstance(kernels.make_reader(single, torch.zeros(2, 3, 16), False), FusedReader)
        torch._dynamo.reset()
        compiled = torch.compile(single, backend="aot_eager", fullgraph=True)
        compiled(torch.randn(2, 3, 16), [torch.tanh] * 4)
        assert not seen, "auto ran the C kernels inside a compiled graph"
        single(torch.randn(2, 3, 16), [torch.tanh] * 4)
        assert seen, "auto did not run the C kernels in eager mode"
    finally:
        cpu_kernels.read_forward = original
        kernels.set_backend(None)


def test_the_thread_setting_follows_torch_by_default_and_is_checked(monkeypatch):
    monkeypatch.delenv("ATTNRES_CPU_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        for k in (1, 3):
            torch.set_num_threads(k)
            assert cpu_kernels.threads() == k and len(cpu_kernels._ranges(4096)) == k
        monkeypatch.setenv("ATTNRES_CPU_THREADS", "auto")
        assert cpu_kernels.threads() == 3
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("ATTNRES_CPU_THREADS", "2")
    assert [r for r in cpu_kernels._ranges(1000)] == [(0, 512), (512, 1000)]  # whole 64-token tiles
    assert cpu_kernels._ranges(300) == [(0, 300)]  # at least 256 tokens a thread
    monkeypatch.setenv("ATTNRES_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="ATTNRES_CPU_THREADS='0' is not allowed; allowed: a positive integer or 'auto'"):
        cpu_kernels.threads()


def test_split_reads_run_on_torchs_own_openmp_runtime(monkeypatch):
    """Where torch's OpenMP is libgomp from its own folder (the Linux wheels), the reads are built
    with OpenMP and bind to that copy: after a read split over two threads, the process has one
    libgomp mapped, not a second runtime with threads of its own."""

    assert cpu_kernels.uses_openmp() == native.torch_uses_libgomp()
    if not sys.platform.startswith("linux"):
        return
    monkeypatch.setenv("ATTNRES_CPU_THREADS", "2")
    srcs = [torch.randn(1024, 32) for _ in range(3)]
    cpu_kernels.read_forward(srcs, [], torch.randn(2, 32), None, None, 1, False, False, torch.float32)
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) <= 1, gomp


def test_a_forked_child_reads_with_threads_of_its_own(monkeypatch):
    """A fork after the thread pool exists (a DataLoader worker, a forking launcher) must not
    hand the child a pool whose threads stayed in the parent: the child's read finishes."""
    import signal
    import time

    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(1024, 32, generator=g) for _ in range(3)]
    q = torch.randn(2, 32, generator=g)
    monkeypatch.setenv("ATTNRES_CPU_THREADS", "2")
    assert len(cpu_kernels._ranges(1024)) == 2
    want, _ = cpu_kernels.read_forward(srcs, [], q, None, None, 1, False, False, torch.float32)
    pid = os.fork()
    if pid == 0:
        got, _ = cpu_kernels.read_forward(srcs, [], q, None, None, 1, False, False, torch.float32)
        # compared in numpy: torch's own OpenMP pool is not usable after a fork
        os._exit(0 if (got.numpy() == want.numpy()).all() else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's read hung (inherited a dead thread pool)")
    assert os.waitstatus_to_exitcode(done[1]) == 0, "the child's read differs from the parent's"


def _read_one_reference(us, q, o0, lse0, key_norm, sigmoid, eps=1e-6):
    """One reader's read as PAPER.md's softmax over (the running read, if any, and the sources),
    in float64; q (d,) or per token (N, d)."""
    scores = [lse0] if o0 is not None else []
    for u in us:
        s = (u * q).sum(-1, keepdim=True) * (torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps) if key_norm else 1)
        scores.append(torch.nn.functional.logsigmoid(s) if sigmoid else s)
    alpha = torch.softmax(torch.cat(scores, -1), -1)
    values = ([o0] if o0 is not None else []) + list(us)
    return sum(alpha[:, i : i + 1] * v for i, v in enumerate(values))


READ_ONE_CASES = [  # (running read, per-token query, key norm, sigmoid)
    (True, False, True, False), (True, False, False, False), (True, False, True, True),
    (False, False, True, False), (False, True, True, False), (True, True, False, True),
]


def _read_one_matches_the_reference(us, q, init, grad, key_norm, sigmoid):
    """ops.read_one (fp32, the C kernel) against _read_one_reference in float64: the output and the
    gradient of every input (sources, query, a merge's o0 and lse0 when `init` has them) to 1e-5
    relative to each tensor's largest entry."""
    from attnres.kernels import ops

    n, merge = len(us), bool(init)
    inputs = [x.clone().requires_grad_() for x in (*us, q, *init)]
    assert ops.c_read_one_sources(inputs[0], 1) >= n
    running = inputs[n + 1 :] if merge else [None, None]
    got = ops.read_one(inputs[:n], inputs[n], *running, 1e-6, key_norm, sigmoid)
    got_grads = torch.autograd.grad(got, inputs, grad)
    exact = [x.detach().double().requires_grad_() for x in inputs]
    want = _read_one_reference(exact[:n], exact[n], *(exact[n + 1 :] if merge else [None, None]), key_norm, sigmoid)
    want_grads = torch.autograd.grad(want, exact, grad.double())
    for a, b in zip([got, *got_grads], [want, *want_grads]):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("d", [64, 80])  # a width the kernel fixes at compile time, and one it does not
@pytest.mark.parametrize("merge,per_token,key_norm,sigmoid", READ_ONE_CASES)
def test_the_one_reader_kernel_against_the_float64_reference(n, d, merge, per_token, key_norm, sigmoid):
    """csrc/depth_read_one.c (one reader, one head, 1/rms in the kernel): a phase-2 merge or a
    plain read, static or per-token query, fp32, 210 tokens (13 groups of 16 and a remainder):
    output and the gradients of every input (sources, query, and a merge's running read o0 and
    lse0) to 1e-5 relative to each tensor's largest entry."""
    g = torch.Generator().manual_seed(n * d)
    N = 210
    us = [torch.randn(N, d, generator=g) * (0.5 + 0.4 * i) for i in range(n)]
    q = torch.randn(*((N, d) if per_token else (d,)), generator=g) / d**0.5
    init = [torch.randn(N, d, generator=g), torch.randn(N, 1, generator=g)] if merge else []
    grad = torch.randn(N, d, generator=g)
    _read_one_matches_the_reference(us, q, init, grad, key_norm, sigmoid)


@pytest.mark.parametrize("merge", [False, True])
def test_the_one_reader_kernel_keeps_eps_inside_the_root_for_small_sources(merge):
    """1/rms = (mean u² + eps)^(−1/2). Sources of rms near sqrt(eps) = 1e-3 (sublayer outputs early
    in training are small) are where eps matters: 1/(rms + eps) would move the scores by ~40%,
    while at rms ≈ 1 (the test above) it changes them by ~1e-6, below fp32 tolerances. Output and
    gradients of a plain read and a merge against the float64 reference, fp32, to 1e-5 relative to
    each tensor's largest entry."""
    g = torch.Generator().manual_seed(11)
    N, d, n = 40, 64, 3
    us = [torch.randn(N, d, generator=g) * 1e-3 * (1 + i) for i in range(n)]
    q = torch.randn(d, generator=g) / d**0.5
    init = [torch.randn(N, d, generator=g) * 1e-3, torch.randn(N, 1, generator=g)] if merge else []
    grad = torch.randn(N, d, generator=g)
    _read_one_matches_the_reference(us, q, init, grad, key_norm=True, sigmoid=False)


def test_the_one_reader_kernel_refuses_more_sources_than_its_tables_hold():
    """The kernel keeps per-source tables on the stack: a call past their bound is refused with a
    clear error, before anything is written (the readers never make one: c_read_one_sources)."""
    cap = cpu_kernels.read_one_max_sources()
    us = [torch.randn(20, 16) for _ in range(cap + 1)]
    with pytest.raises(ValueError, match=f"depth read \\(one reader\\): {cap + 1} sources; allowed: 1 to {cap}"):
        cpu_kernels.read_one_forward(us, torch.randn(16), None, None, 1e-6, True, False)
    out, lse = cpu_kernels.read_one_forward(us[:cap], torch.randn(16), None, None, 1e-6, True, False)
    with pytest.raises(ValueError, match=f"backward: {cap + 1} sources; allowed: 1 to {cap}"):
        cpu_kernels.read_one_backward(us, torch.randn(16), out, None, lse, torch.randn(20, 16), 1e-6, True, False)


def test_the_one_reader_kernel_splits_tokens_over_threads_without_changing_the_result(monkeypatch):
    """Two token ranges against one, fp32: output, lse and the per-token gradients to 1e-6; the
    query gradient (summed per group of 16 tokens in float, the two ranges' sums added in double)
    to 5e-5 relative."""
    g = torch.Generator().manual_seed(1)
    N, d = 1000, 64
    us = [torch.randn(N, d, generator=g) for _ in range(2)]
    q, o0, lse0 = torch.randn(d, generator=g), torch.randn(N, d, generator=g), torch.randn(N, 1, generator=g)
    grad = torch.randn(N, d, generator=g)
    results = {}
    for threads in (1, 2):
        monkeypatch.setenv("ATTNRES_CPU_THREADS", str(threads))
        assert len(cpu_kernels._ranges(N)) == threads
        out, lse = cpu_kernels.read_one_forward(us, q, o0, lse0, 1e-6, True, False)
        dsrc, dq, do0, dlse0 = cpu_kernels.read_one_backward(us, q, out, lse0, lse, grad, 1e-6, True, False)
        results[threads] = (out, lse, *dsrc, do0, dlse0, dq)
    for a, b in zip(results[1][:-1], results[2][:-1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[1][-1], results[2][-1], rtol=5e-5, atol=5e-5)


# 8 sublayers and the output read. Two-phase Block in blocks of 2: 4 merges of b and the output
# read's of the last block; Full: merges of up to 7 sources; per-sublayer reads: 9 plain reads.
ONE_READER_CALLS = {
    "block": ([1] * 5, [False] * 5),
    "block_no_rmsnorm": ([1] * 5, [False] * 5),
    "full": (None, None),
    "full_sigmoid": (None, None),
    "sliding_window": (None, [True] * 9),
    "full_input_query": (list(range(1, 10)), [True] * 9),
    "block/per_read": ([1, 2, 2, 3, 3, 4, 4, 5, 5], [True] * 9),
}


@pytest.mark.parametrize("case", sorted(ONE_READER_CALLS))
def test_models_read_with_the_one_reader_kernel_and_match_the_general_read(monkeypatch, case):
    """On the C path every read of one reader and one head runs csrc/depth_read_one.c — phase-2
    merges and per-sublayer reads (sliding window, per-token queries, the per-read schedule) — and
    the model is the one the general read kernel gives: loss and every parameter gradient to 1e-5
    (fp32)."""
    from attnres.kernels import ops

    variant, _, schedule = case.partition("/")
    kernels.set_schedule(schedule or None)
    cfg = ModelConfig(d_model=32, layers=4, n_heads=2, max_seq_len=24)
    res = ResidualConfig(name=variant, **({"block_size": 2} if variant.startswith("block") else {}))
    idx, tgt = torch.randint(0, 256, (2, 24)), torch.randint(0, 256, (2, 24))
    kernels.set_backend(None)
    calls, original = [], cpu_kernels.read_one_forward
    monkeypatch.setattr(cpu_kernels, "read_one_forward", lambda *a: calls.append((len(a[0]), a[2] is None)) or original(*a))
    results = []
    try:
        for one_reader in (True, False):
            if not one_reader:
                monkeypatch.setattr(ops, "c_read_one_sources", lambda *a: 0)
            torch.manual_seed(0)
            model = DecoderLM(cfg, res)
            _, loss = model(idx, tgt)
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            if one_reader:
                sizes, plain = ONE_READER_CALLS[case]
                assert calls, "no read ran the one-reader kernel"
                if sizes is not None:
                    assert [n for n, _ in calls] == sizes, calls
                assert [p for _, p in calls] == (plain or [False] * len(calls)), calls
                calls.clear()
    finally:
        kernels.set_schedule(None)
    assert not calls  # the comparison run took the general read
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))


def test_a_second_derivative_through_the_reads_raises_on_every_path():
    """create_graph=True through a Block model: the reads' backwards (C kernels and PyTorch path)
    are not differentiable, so differentiating the gradient again raises, naming why; the C path
    silently dropped every term through the reads, the PyTorch path failed on an out= argument."""
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(d_model=16, layers=2, n_heads=2, max_seq_len=8), ResidualConfig(name="block", block_size=2))
    idx = torch.randint(0, 256, (2, 8))
    for backend in ("cpu", "torch"):
        kernels.set_backend(backend)
        try:
            _, loss = model(idx[:, :-1], idx[:, 1:])
            (g,) = torch.autograd.grad(loss, model.embed.weight, create_graph=True)
            with pytest.raises(RuntimeError, match="once_differentiable"):
                g.pow(2).sum().backward()
        finally:
            kernels.set_backend(None)
