"""Training is bit-identical to the goldens in tests/data/bit_identical.json: every variant, a few
AdamW steps of a small fp32 model at a fixed seed, on the default CPU path (the C kernels), on the
reference (ATTNRES_KERNEL=torch) and with one read per sublayer (ATTNRES_SCHEDULE=per_read).
Losses and a hash of the final parameters must match exactly (tolerance 0): forward and backward
alike, since each step's update depends on the gradients.

    python tests/test_bit_identical.py --record   # rewrite the goldens from the code as it is

The goldens were recorded on this project's CPU machine; the C kernels are built with
-march=native, so another CPU family may round differently: the JSON names the CPU, torch and
kernels it came from, and on any other machine the losses are held to 1e-4 relative instead.
The epsilon is pinned (1e-6, the default when they were recorded): the goldens test the code.
"""
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from attnres import VARIANTS, DecoderLM, ModelConfig, ResidualConfig

GOLDEN = Path(__file__).with_name("data") / "bit_identical.json"
PATHS = {"default": {}, "torch": {"ATTNRES_KERNEL": "torch"}, "per_read": {"ATTNRES_SCHEDULE": "per_read"}}
STEPS = 3


def train(variant: str) -> dict:
    """Losses (float.hex, exact) of STEPS training steps and the sha256 of the final parameters."""
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=64, d_model=32, layers=3, n_heads=2, max_seq_len=32, norm_eps=1e-6),
                      ResidualConfig(name=variant, window=3, heads=4))
    opt = torch.optim.AdamW(model.optimizer_groups(0.1), lr=1e-2)
    data = torch.randint(0, 64, (STEPS, 4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for batch in data:
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()).hex())
    digest = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        digest.update(name.encode() + p.detach().contiguous().numpy().tobytes())
    return {"losses": losses, "params_sha256": digest.hexdigest()}


def run(variant: str, env: dict, monkeypatch=None) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the C kernels and torch's matmuls split work by thread count
    try:
        for key in ("ATTNRES_KERNEL", "ATTNRES_SCHEDULE"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return train(variant)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_training_matches_the_recorded_goldens_exactly(variant, path, monkeypatch):
    """Exact on the machine the goldens name (CPU model, torch, C kernels); elsewhere the vector
    units may round differently, so the losses must agree within 1e-4 relative (fp32, 3 steps)."""
    recorded = json.loads(GOLDEN.read_text())
    golden = recorded["runs"][path][variant]
    got = run(variant, PATHS[path], monkeypatch)
    if _machine() == {k: recorded[k] for k in ("cpu", "torch", "c_kernels")}:
        assert got == golden
    else:
        assert [float.fromhex(x) for x in got["losses"]] == pytest.approx(
            [float.fromhex(x) for x in golden["losses"]], rel=1e-4)


def _machine() -> dict:
    from attnres.kernels import native

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return {"cpu": cpu, "torch": torch.__version__, "c_kernels": native.available()}


def _record() -> None:
    import os

    runs = {}
    for path, env in PATHS.items():
        for key in ("ATTNRES_KERNEL", "ATTNRES_SCHEDULE"):
            os.environ.pop(key, None)
        os.environ.update(env)
        torch.set_num_threads(1)
        runs[path] = {v: train(v) for v in VARIANTS}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({**_machine(), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    _record()
