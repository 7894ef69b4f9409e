"""The C kernels of the CPU path around their math (tested in test_kernels.py): when they are
chosen, how they are built and cached, what happens without a compiler, that splitting tokens
across threads does not change the result, and the read's two inner paths (one reader in lanes,
several readers or heads in tiles) against each other and against float64."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnres import DecoderLM, ModelConfig, ResidualConfig, depth_read, kernels
from attnres.kernels import cpu_read, native

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("ATTNRES_KERNEL", "CC")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=ROOT, timeout=300)


@pytest.fixture
def threads():
    """torch.set_num_threads for one test (the kernels follow it), restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_auto_chooses_the_c_kernels_for_fp32_cpu_only():
    x = torch.zeros(2, 3, 8)
    kernels.set_backend(None)
    assert kernels.path(x) == "c"
    assert kernels.path(x.double()) == "torch"
    assert kernels.path(x, x.double()) == "torch"  # a float64 query for fp32 sources: one type or none
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernels.path(x) == "torch"
    kernels.set_backend("torch")
    try:
        assert kernels.path(x) == "torch"
    finally:
        kernels.set_backend(None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_an_fp32_embedding_read_by_a_module_of_another_type_takes_the_reference(dtype):
    """An fp32 embedding read by a bf16 / float64 module: the kernels take one type, the reference
    reads the mix; auto gives the same result as forcing the reference, bit for bit."""
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
        kernels.set_backend("torch")
        want = res(x, sublayers)
    finally:
        kernels.set_backend(None)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_cpu_backend_refuses_what_it_cannot_read():
    kernels.set_backend("cpu")
    try:
        with pytest.raises(RuntimeError, match="ATTNRES_KERNEL=cpu"):
            kernels.path(torch.zeros(2, 8, dtype=torch.float64))
    finally:
        kernels.set_backend(None)
    with pytest.raises(ValueError, match="contiguous fp32 CPU tensors"):
        cpu_read.forward([torch.zeros(8, 4).t()], torch.zeros(1, 8), None, None, 1, False, False, True, 1e-6)


def test_build_is_cached_per_machine(tmp_path):
    """First use compiles one library into the cache; a second process loads it as it is."""
    code = "from attnres.kernels import native; assert native.available(), native.why_unavailable(); print('ok')"
    first = _python(code, ATTNRES_CACHE_DIR=str(tmp_path))
    assert first.returncode == 0 and "ok" in first.stdout, first.stderr
    built = list(tmp_path.glob("attnres-*.so"))
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
print("path:", kernels.path(x))
m = DecoderLM(ModelConfig(d_model=16, layers=2, n_heads=2, max_seq_len=8), ResidualConfig(name="block", block_size=2))
_, loss = m(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
loss.backward()
kernels.set_backend("cpu")
try:
    kernels.path(x)
except RuntimeError as e:
    print("refused:", e)
"""
    out = _python(code, CC=str(tmp_path / "no-such-cc"), ATTNRES_CACHE_DIR=str(tmp_path / "cache"))
    assert out.returncode == 0, out.stderr
    assert "path: torch" in out.stdout
    assert "refused:" in out.stdout and "ATTNRES_KERNEL=cpu" in out.stdout
    assert "no-such-cc" in out.stdout  # the reason names the compiler that was tried


@pytest.mark.parametrize("d,heads", [(80, 1), (80, 5), (128, 1), (128, 2)])
@pytest.mark.parametrize("per_token", [False, True])
def test_register_blocks_with_a_channel_tail_and_a_token_remainder(d, heads, per_token):
    """d 80 = a 64-channel register block and a 16-channel tail (heads of 80 and 16 channels); d 128
    = two blocks, heads of 128 and 64 channels; 210 tokens = three 64-token tiles and a remainder;
    six sources. Output and gradients of every input against the float64 reference, fp32 kernels,
    to 1e-4 relative to each tensor's largest entry (queries scaled by 1/√d)."""
    g = torch.Generator().manual_seed(heads)
    shape = (3, 70, d)
    srcs = [(torch.randn(*shape, generator=g) * (0.5 + 0.3 * i)).requires_grad_() for i in range(6)]
    q = ((torch.randn(*shape, generator=g) if per_token else torch.randn(d, generator=g)) / d**0.5).requires_grad_()
    gain = (1 + 0.3 * torch.randn(d, generator=g)).requires_grad_()
    grad = torch.randn(shape, generator=g)
    inputs = srcs + [q, gain]
    kernels.set_backend("cpu")
    try:
        got = depth_read(q, srcs, gain, heads=heads)
        got_grads = torch.autograd.grad(got, inputs, grad)
    finally:
        kernels.set_backend(None)
    exact = [x.detach().double().requires_grad_() for x in inputs]
    want = depth_read(exact[6], exact[:6], exact[7], heads=heads)
    want_grads = torch.autograd.grad(want, exact, grad.double())
    for a, b in zip([got, *got_grads], [want, *want_grads]):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4 * b.abs().max().item())


def _read(srcs, q, init=None, grad=None, heads=1, sigmoid=False, key_norm=True, tiles=False, per_token=False):
    """cpu_read forward and backward; tiles: give the kernel the sources' 1/rms, which sends a read
    of one reader and one head to the tiled path instead of the one-reader lanes."""
    rhos = cpu_read.inv_rms(srcs, 1e-6) if key_norm and (tiles or not cpu_read.one_reader(q.shape[0], heads, len(srcs))) else []
    o0, lse0 = init if init is not None else (None, None)
    outs, lse, _ = cpu_read.forward(srcs, q, o0, lse0, heads, sigmoid, per_token, key_norm, 1e-6, rhos=rhos)
    grads = [grad] if grad is not None else [torch.ones_like(o) for o in outs]
    back = cpu_read.read_backward(srcs, rhos, q, outs if init is not None else None, lse0, lse, grads, None, heads,
                                  sigmoid, per_token, key_norm, 1e-6)
    return (outs, lse, *back)


@pytest.mark.parametrize("R", [1, 3])  # one reader: the 16-token lanes; several: the tiles
def test_threads_split_tokens_without_changing_the_result(threads, R):
    """Two token ranges on two threads against one range, fp32: outputs and source gradients to
    1e-6, the static query's gradient (summed per tile in fp32, ranges added in double) to 5e-5."""
    g = torch.Generator().manual_seed(0)
    N, d = 1000, 32
    srcs = [torch.randn(N, d, generator=g) for _ in range(5)]
    q = torch.randn(R, d, generator=g)
    results = {}
    for k in (1, 2):
        threads(k)
        assert cpu_read._ranges(N, native.threads(N))[1] == k
        outs, lse, dsrc, dq, _, _ = _read(srcs, q)
        results[k] = (*outs, lse, *dsrc, dq)
    for a, b in zip(results[1][:-1], results[2][:-1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[1][-1], results[2][-1], rtol=5e-5, atol=5e-5)


def test_the_default_cpu_model_runs_the_c_kernels(monkeypatch):
    """The fused path is the default on CPU: a Block model's reads go through the C kernels."""
    calls = []
    original = cpu_read.forward
    monkeypatch.setattr(cpu_read, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    kernels.set_backend(None)
    m = DecoderLM(ModelConfig(d_model=16, layers=2, n_heads=2, max_seq_len=8), ResidualConfig(name="block", block_size=2))
    m(torch.randint(0, 256, (2, 8)))
    assert calls, "the default CPU path did not call the C kernels"
    assert native.why_unavailable() is None


def test_auto_routes_compiled_cpu_reads_to_the_reference(monkeypatch):
    """Under torch.compile, where Inductor fuses the reference, auto does not run the C kernels;
    in eager mode it does."""
    from attnres import build_residual

    single = build_residual(ResidualConfig(name="block", block_size=2), 16, 4)
    kernels.set_backend(None)
    seen = []
    original = cpu_read.forward
    monkeypatch.setattr(cpu_read, "forward", lambda *a, **k: seen.append(1) or original(*a, **k))
    torch._dynamo.reset()
    compiled = torch.compile(single, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(2, 3, 16), [torch.tanh] * 4)
    assert not seen, "auto ran the C kernels inside a compiled graph"
    single(torch.randn(2, 3, 16), [torch.tanh] * 4)
    assert seen, "auto did not run the C kernels in eager mode"


def test_the_thread_count_follows_torch(threads):
    for k in (1, 3):
        threads(k)
        assert native.threads(4096) == k and cpu_read._ranges(4096, native.threads(4096))[1] == k
    threads(2)
    bounds, k = cpu_read._ranges(1000, native.threads(1000))
    assert list(bounds) == [0, 512, 1000] and k == 2  # whole 64-token tiles
    assert native.threads(300) == 1  # at least 256 tokens a thread


def test_split_reads_run_on_torchs_own_openmp_runtime(threads):
    """Where torch's OpenMP is libgomp from its own folder (the Linux wheels), the kernels are built
    with OpenMP and bind to that copy: after a read split over two threads, the process has one
    libgomp mapped, not a second runtime with threads of its own."""
    if not sys.platform.startswith("linux"):
        return
    assert bool(native.library().attnres_openmp()) == (Path(torch.__file__).parent / "lib" / "libgomp.so.1").exists()
    threads(2)
    _read([torch.randn(1024, 32) for _ in range(3)], torch.randn(2, 32))
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) <= 1, gomp


def test_a_forked_child_reads_with_threads_of_its_own(threads):
    """A fork after the thread pool exists (a DataLoader worker, a forking launcher) must not hand
    the child a pool whose threads stayed in the parent: the child's read finishes."""
    import signal
    import time

    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(1024, 32, generator=g) for _ in range(3)]
    q = torch.randn(2, 32, generator=g)
    threads(2)
    assert native.threads(1024) == 2
    want = _read(srcs, q)[0][0]
    pid = os.fork()
    if pid == 0:
        got = _read(srcs, q)[0][0]
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


def _one_reader_reference(us, q, o0, lse0, key_norm, sigmoid, eps=1e-6):
    """One reader's softmax over (the running read, if any, and the sources), float64; q (d,) or (N, d)."""
    scores = [lse0] if o0 is not None else []
    for u in us:
        s = (u * q).sum(-1, keepdim=True) * (torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps) if key_norm else 1)
        scores.append(torch.nn.functional.logsigmoid(s) if sigmoid else s)
    alpha = torch.softmax(torch.cat(scores, -1), -1)
    values = ([o0] if o0 is not None else []) + list(us)
    return sum(alpha[:, i : i + 1] * v for i, v in enumerate(values))


ONE_READER_CASES = [  # (running read, per-token query, key norm, sigmoid)
    (True, False, True, False), (True, False, False, False), (True, False, True, True),
    (False, False, True, False), (False, True, True, False), (True, True, False, True),
]


def _one_reader_matches_the_reference(us, q, init, grad, key_norm, sigmoid):
    """The fused read of one reader (fp32, the C kernel's lanes) against float64: the output and the
    gradient of every input (sources, query, a merge's running read) to 1e-5 relative to each
    tensor's largest entry."""
    from attnres.depth_attention import read

    n, merge, per_token = len(us), bool(init), q.dim() == 2
    inputs = [x.clone().requires_grad_() for x in (*us, q, *init)]
    assert cpu_read.one_reader(1, 1, n)
    qk = inputs[n] if per_token else inputs[n][None]
    outs, _, _ = read(qk, inputs[:n], (inputs[n + 1], inputs[n + 2].view(1, -1, 1)) if merge else None, kernel="c",
                      key_norm=key_norm, normaliser="sigmoid" if sigmoid else "softmax", per_token=per_token)
    got_grads = torch.autograd.grad(outs[0], inputs, grad)
    exact = [x.detach().double().requires_grad_() for x in inputs]
    want = _one_reader_reference(exact[:n], exact[n], *(exact[n + 1 :] if merge else [None, None]), key_norm, sigmoid)
    want_grads = torch.autograd.grad(want, exact, grad.double())
    for a, b in zip([outs[0], *got_grads], [want, *want_grads]):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("d", [64, 80])  # a width the kernel fixes at compile time, and one it does not
@pytest.mark.parametrize("merge,per_token,key_norm,sigmoid", ONE_READER_CASES)
def test_the_one_reader_lanes_against_the_float64_reference(n, d, merge, per_token, key_norm, sigmoid):
    """One reader, one head, 1/rms in the kernel: a merge or a plain read, static or per-token query,
    fp32, 210 tokens (13 groups of 16 and a remainder)."""
    g = torch.Generator().manual_seed(n * d)
    N = 210
    us = [torch.randn(N, d, generator=g) * (0.5 + 0.4 * i) for i in range(n)]
    q = torch.randn(*((N, d) if per_token else (d,)), generator=g) / d**0.5
    init = [torch.randn(N, d, generator=g), torch.randn(N, 1, generator=g)] if merge else []
    grad = torch.randn(N, d, generator=g)
    _one_reader_matches_the_reference(us, q, init, grad, key_norm, sigmoid)


@pytest.mark.parametrize("merge", [False, True])
def test_the_one_reader_lanes_keep_eps_inside_the_root_for_small_sources(merge):
    """1/rms = (mean u² + eps)^(−1/2). Sources of rms near sqrt(eps) = 1e-3 (sublayer outputs early in
    training are small) are where eps matters: 1/(rms + eps) would move the scores by ~40%."""
    g = torch.Generator().manual_seed(11)
    N, d, n = 40, 64, 3
    us = [torch.randn(N, d, generator=g) * 1e-3 * (1 + i) for i in range(n)]
    q = torch.randn(d, generator=g) / d**0.5
    init = [torch.randn(N, d, generator=g) * 1e-3, torch.randn(N, 1, generator=g)] if merge else []
    grad = torch.randn(N, d, generator=g)
    _one_reader_matches_the_reference(us, q, init, grad, key_norm=True, sigmoid=False)


@pytest.mark.parametrize("merge,per_token,key_norm,sigmoid", ONE_READER_CASES)
def test_the_one_reader_lanes_equal_the_tiles(merge, per_token, key_norm, sigmoid):
    """The kernel's two inner paths compute one read: the lanes (1/rms in the kernel) and the tiles
    (1/rms given), outputs, lse and every gradient to 1e-5, fp32."""
    g = torch.Generator().manual_seed(3)
    N, d = 150, 64
    srcs = [torch.randn(N, d, generator=g) for _ in range(4)]
    q = torch.randn(N, d, generator=g) if per_token else torch.randn(1, d, generator=g)
    init = (torch.randn(N, d, generator=g), torch.randn(1, N, 1, generator=g)) if merge else None
    grad = torch.randn(N, d, generator=g)
    lanes = _read(srcs, q, init, grad, sigmoid=sigmoid, key_norm=key_norm, per_token=per_token)
    tiles = _read(srcs, q, init, grad, sigmoid=sigmoid, key_norm=key_norm, per_token=per_token, tiles=True)
    flat = lambda r: [t for x in r if x is not None for t in (x if isinstance(x, list) else [x])]  # noqa: E731
    # the static query's gradient is summed over tokens in another order on each path: 1e-4
    for a, b in zip(flat(lanes), flat(tiles)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4 if a.shape == (1, d) else 1e-5)


def test_second_derivatives_raise_on_the_kernels_and_exist_on_the_reference():
    """create_graph=True through a Block model: the C kernels' backward is not differentiable, so
    differentiating the gradient again raises rather than dropping every term through the reads;
    the reference is plain PyTorch, and its second derivative matches float64 finite differences."""
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(d_model=16, layers=2, n_heads=2, max_seq_len=8), ResidualConfig(name="block", block_size=2))
    idx = torch.randint(0, 256, (2, 8))
    kernels.set_backend("cpu")
    try:
        _, loss = model(idx[:, :-1], idx[:, 1:])
        (g,) = torch.autograd.grad(loss, model.embed.weight, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            g.pow(2).sum().backward()
    finally:
        kernels.set_backend(None)
    srcs = [torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    q = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda q, *s: depth_read(q, s), (q, *srcs))


def test_the_schedule_is_two_phase_on_the_c_path_and_can_be_forced():
    """Static-query Block and Full read in two phases where the C kernels serve; a window never
    does; the reference reads one sublayer at a time; set_schedule forces either."""
    x, q = torch.zeros(2, 3, 8), torch.zeros(8)
    two_phase = lambda sources, *t, **k: kernels.plan(sources, *t, **k).two_phase  # noqa: E731
    try:
        assert kernels.plan("block", x, q) == ("c", True) and two_phase("full", x, q)
        assert not two_phase(None, x, q) and not two_phase("full", x, q, weights=True)
        assert kernels.plan("block", x.double(), q.double()) == ("torch", False)
        kernels.set_schedule("per_read")
        assert not two_phase("full", x, q)
        kernels.set_schedule("two_phase")
        assert two_phase("full", x.double(), q.double()) and not two_phase(None, x, q)
    finally:
        kernels.set_schedule(None)
