"""The core's house rules: a variant's math is a few frames from DecoderLM.forward, one function
decides the backend (the 80-line rule for every module: tests/test_house.py)."""
import ast
import sys
from pathlib import Path

import pytest
import torch

from attnres import VARIANTS, DecoderLM, ModelConfig, ResidualConfig, kernels

CORE = Path(__file__).resolve().parents[1] / "attnres"
SUBLAYERS = CORE / "layers.py"  # the sublayers and norms: the model's, not the variant's
NATIVE = CORE / "kernels" / "native.py"  # the ctypes call of a C kernel: part of its caller's frame


def _is_math(fn) -> bool:
    """A torch operator: a function of torch's C module or a method of a tensor."""
    return torch.is_tensor(getattr(fn, "__self__", None)) or (getattr(fn, "__module__", None) or "").startswith("torch")


def _frames_to_math(model, idx) -> int:
    """The deepest point, counted in frames of attnres/ functions below DecoderLM.forward, at
    which a torch operator is called during one training-mode forward (a C kernel's caller calls
    torch.empty for its outputs), outside the sublayers and norms."""
    deepest = 0

    def profile(frame, event, arg):
        nonlocal deepest
        if event != "c_call" or not _is_math(arg):
            return
        depth, f = 0, frame
        while f is not None and not (f.f_code.co_name == "forward" and f.f_code.co_filename == str(CORE / "model.py")):
            path = Path(f.f_code.co_filename)
            if path == SUBLAYERS:
                return
            # comprehensions are frames of their own before Python 3.12, part of their function's after
            depth += path.is_relative_to(CORE) and path != NATIVE and not f.f_code.co_name.startswith("<")
            f = f.f_back
        if f is not None:
            deepest = max(deepest, depth)

    sys.setprofile(profile)
    try:
        model(idx, idx)
    finally:
        sys.setprofile(None)
    return deepest


FUSED = {"block", "block_multihead", "block_no_rmsnorm", "full", "full_input_query", "full_sigmoid", "full_no_rmsnorm",
         "sliding_window", "mhc"}  # the variants whose default CPU path calls a fused kernel


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variants_math_is_at_most_five_frames_below_the_model(variant):
    """Training mode, the default CPU path: 5 frames where a fused kernel is called (the residual's
    forward, its stream, the op, the autograd function, the kernel call), 4 elsewhere."""
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=64, d_model=32, layers=2, n_heads=2, max_seq_len=16),
                      ResidualConfig(name=variant, window=2, heads=4, block_size=2))
    depth = _frames_to_math(model.train(), torch.randint(0, 64, (2, 16)))
    assert 2 <= depth <= (5 if variant in FUSED else 4)


def _calls(name: str) -> list[str]:
    """Every function of attnres/ that calls `name` (as `name(...)` or `x.name(...)`), file:function."""
    found = []
    for path in sorted(CORE.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Call):
                        callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                        if callee == name:
                            found.append(f"{path.relative_to(CORE)}:{fn.name}")
    return sorted(set(found))


def test_one_function_decides_the_backend():
    """Only kernels.path reads the forced backend and asks whether the C kernels exist; every other
    caller takes its answer (plan, the public depth_read, the RMSNorm) and passes it down."""
    assert _calls("backend") == ["kernels/__init__.py:path"]
    assert _calls("available") == ["kernels/__init__.py:path"]
    assert _calls("path") == ["depth_attention.py:depth_read", "kernels/__init__.py:plan", "layers.py:forward"]
    assert _calls("plan") == ["residuals/attention_residual.py:stream", "residuals/hyper_connections.py:stream"]
    assert kernels.plan("block", torch.zeros(2, 8), torch.zeros(8)).kernel in ("c", "torch")
