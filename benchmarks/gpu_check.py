"""Correctness of the Triton kernels on a real GPU (the CPU tests run them under the interpreter).

    python benchmarks/gpu_check.py          # needs CUDA and Triton; exits non-zero on a mismatch
    python benchmarks/gpu_check.py --full   # every combination of the read's knobs (4x the kernels)
    python benchmarks/gpu_check.py --smoke  # the same checks, small, on CPU under Triton's interpreter
    python benchmarks/gpu_check.py --smoke --quick   # one check of each kind (run_gpu.sh --dry-run)

Checks one read and its gradients against `attnres.depth_read` in fp32 and bf16 (by default a
pairwise cover of the knobs, since each case compiles its own kernels), the two-phase schedule
against one read per sublayer, and a bf16 autocast training step against the PyTorch path.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # read by Triton when it is first imported, so set before anything imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnres import DecoderLM, ModelConfig, ResidualConfig, build_residual, depth_read, kernels  # noqa: E402


def close(name, got, want, tol):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() + 1e-6
    ok = err <= tol * max(1.0, scale)
    print(f"{'ok  ' if ok else 'FAIL'} {name:60s} max|Δ| {err:.2e} (scale {scale:.2e})")
    return ok


SHAPES = ((256, 1), (256, 8), (896, 1), (896, 14))  # (d, heads): 896 and 896/14 = 64 not powers of 2


def read_cases(full: bool) -> list[tuple]:
    """(shape, key_norm, normaliser, per_token) cases. Not full: two per shape, with the other knobs
    chosen so that every pair of values of any two knobs occurs at least once (8 of 32)."""
    if full:
        return list(itertools.product(SHAPES, (True, False), ("softmax", "sigmoid"), (False, True)))
    other = (("softmax", False, "sigmoid", True), ("sigmoid", True, "softmax", False),
             ("softmax", True, "sigmoid", False), ("sigmoid", False, "softmax", True))
    return [case for shape, (n1, p1, n2, p2) in zip(SHAPES, other)
            for case in ((shape, True, n1, p1), (shape, False, n2, p2))]


def check_reads(g, dev: str, T: int, full: bool, quick: bool) -> bool:
    """One read and its gradients against depth_read's PyTorch path in float64, fp32 and bf16."""
    ok = True
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for (d, heads), key_norm, normaliser, per_token in read_cases(full)[: 1 if quick else None]:
            shape = (2, T, d)
            srcs = [(torch.randn(*shape, generator=g) * (1 + i)).to(dev, dtype).requires_grad_() for i in range(7)]
            # scores of a few units, as learned queries give (not ±√d, where both fp32
            # implementations only agree to fp32 rounding of a one-hot softmax)
            scale = 3 / d**0.5 / (1 if key_norm else 4)
            q = ((torch.randn(*shape, generator=g) if per_token else torch.randn(d, generator=g)) * scale).to(dev).requires_grad_()
            gain = (1 + 0.2 * torch.randn(d, generator=g)).to(dev).requires_grad_()
            kw = dict(key_norm=key_norm, normaliser=normaliser, heads=heads)
            inputs = srcs + [q] + ([gain] if key_norm else [])
            ref = [x.detach().double().requires_grad_() for x in inputs]  # float64 reference
            chosen = kernels.backend()
            kernels.set_backend("torch")  # the reference, in float64
            want = depth_read(ref[len(srcs)], ref[: len(srcs)], ref[-1] if key_norm else None, **kw)
            kernels.set_backend(chosen)
            got = depth_read(q, srcs, gain, **kw)
            go = torch.randn(shape, generator=g).to(dev)
            gw = torch.autograd.grad(want, ref, go.double())
            gg = torch.autograd.grad(got.float(), inputs, go)
            tag = f"{str(dtype)[6:]} d={d} H={heads} kn={key_norm} {normaliser} per_token={per_token}"
            ok &= close(f"read {tag}", got, want, tol)
            ok &= close(f"grads {tag}", torch.cat([a.flatten() for a in gg]), torch.cat([b.flatten() for b in gw]), tol * 5)
    return ok


def check_schedules(g, dev: str, smoke: bool, quick: bool, triton_kernels) -> bool:
    """Schedules on the module, fp32: Triton per read against PyTorch, two-phase against per read,
    and two-phase with each Triton knob changed against two-phase."""
    ok = True
    schedules = (("block", 4, 10), ("block", 1, 6), ("block_multihead", 3, 8), ("full", 4, 10), ("full_sigmoid", 4, 7))
    for variant, S, L in schedules[: 1 if quick else None]:
        res = build_residual(ResidualConfig(name=variant, block_size=S, heads=4), 64, L).to(dev)
        with torch.no_grad():
            for p in res.parameters():
                p.normal_(1.0 if p.dim() == 1 and p.shape[0] == 64 else 0.0, 0.3)
        ws = [torch.randn(64, 64, generator=g).to(dev) / 8 for _ in range(L)]
        subs = [lambda h, w=w: torch.tanh(h @ w) for w in ws]
        x = torch.randn(2, 3 if smoke else 50, 64, generator=g).to(dev).requires_grad_()
        outs = {}
        # The Triton knobs must not change the result either: the two-phase reads in launches of at
        # most 2 readers, and each switch of the kernels toggled.
        runs = {"torch per read": ("torch", "per_read", {}), "per read": ("triton", "per_read", {}),
                "two-phase": ("triton", "two_phase", {}),
                "two-phase, reader groups of 2": ("triton", "two_phase", {"READER_GROUP": 2})}
        for knob in triton_kernels.SWITCHES:
            runs[f"two-phase, {knob} toggled"] = ("triton", "two_phase", {knob: not getattr(triton_kernels, knob)})
        for name, (backend, schedule, knobs) in runs.items():
            kernels.set_backend(backend)
            kernels.set_schedule(schedule)
            with triton_kernels.knobs(**knobs):
                out = res(x, subs)
                grads = torch.autograd.grad(out.square().sum(), [x] + list(res.parameters()))
            outs[name] = torch.cat([out.flatten()] + [t.flatten() for t in grads])
        tag = f"{variant} S={S} L={L} triton"
        ok &= close(f"{tag} per-read vs torch", outs["per read"], outs["torch per read"], 1e-4)
        # fp32 rounding through L layers and a squared loss: 1e-4 of the scale (the CPU tests hold
        # the two schedules to 1e-5 at small sizes)
        ok &= close(f"{tag} two-phase vs per-read", outs["two-phase"], outs["per read"], 1e-4)
        for name in list(runs)[3:]:  # the knobs' runs
            ok &= close(f"{tag} {name} vs two-phase", outs[name], outs["two-phase"], 1e-5)
    return ok


def check_training(g, dev: str, smoke: bool, quick: bool) -> bool:
    """A bf16 autocast training step through the kernels vs the PyTorch path."""
    ok = True
    cfg = ModelConfig(d_model=64 if smoke else 256, layers=2 if smoke else 4, n_heads=4, max_seq_len=256)
    idx = torch.randint(0, 256, (2, 9) if smoke else (4, 256), generator=g).to(dev)
    for variant in ("block",) if quick else ("block", "full"):
        losses = {}
        for backend in ("torch", "triton"):
            kernels.set_backend(backend)
            kernels.set_schedule("two_phase")
            torch.manual_seed(0)
            m = DecoderLM(cfg, ResidualConfig(name=variant)).to(dev)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            for _ in range(5):
                with torch.autocast(dev, dtype=torch.bfloat16):
                    _, loss = m(idx[:, :-1], idx[:, 1:])
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses[backend] = loss.item()
        ok &= close(f"{variant} bf16 autocast, loss after 5 steps, triton vs torch", torch.tensor(losses["triton"]),
                    torch.tensor(losses["torch"]), 1e-2)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="small, on CPU under Triton's interpreter (tests the script)")
    ap.add_argument("--full", action="store_true", help="every combination of the read's knobs (32 cases per dtype, not 8)")
    ap.add_argument("--quick", action="store_true", help="one case of each kind of check (what run_gpu.sh --dry-run runs)")
    args = ap.parse_args(argv)
    # --smoke: the same checks on CPU tensors under TRITON_INTERPRET=1, small (tests the script).
    smoke = args.smoke
    if not kernels.triton_available():
        ap.error("Triton is not installed (pip install triton)")
    if not (smoke or torch.cuda.is_available()):
        ap.error("no CUDA device here (torch.cuda.is_available() is False); allowed without one: --smoke")
    dev, ok = ("cpu" if smoke else "cuda"), True
    T = 5 if smoke else 333
    kernels.set_backend("triton" if smoke else None)
    from attnres.kernels import triton_kernels  # after the interpreter's switch (--smoke)

    # One generator through the three checks, in this order: each check's inputs follow the last's.
    g = torch.Generator(device="cpu").manual_seed(0)
    ok &= check_reads(g, dev, T, args.full, args.quick)
    ok &= check_schedules(g, dev, smoke, args.quick, triton_kernels)
    ok &= check_training(g, dev, smoke, args.quick)
    kernels.set_backend(None)
    kernels.set_schedule(None)
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
