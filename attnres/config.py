"""Typed configuration of the model and of its residual variant.

Plain dataclasses (no Hydra or OmegaConf here: the core imports torch only). The harness maps its
YAML onto these same classes as structured configs, so a wrong key fails when a run starts.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def positive_int(name: str, value, meaning: str) -> int:
    """value, or one ValueError naming it when it is not a positive integer (a bool is not one)."""
    if not is_positive_int(value):
        raise ValueError(f"{name}={value!r} must be a positive integer ({meaning})")
    return value


def divisors(n: int, most: Optional[int] = None) -> str:
    """The divisors of n (at most `most`), for an error's list of what is allowed."""
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0 and (most is None or k <= most))


# Thirteen variant names: the twelve rows of the paper's ablation (Table 4) plus Hyper-Connections
# (`hc`), an extra peer the paper's table does not have. They are the values of `residual.name` and
# the file names of conf/residual/ (which also holds block_n8: Block with about 8 blocks).
VARIANTS: tuple[str, ...] = (
    "baseline",
    "denseformer",
    "hc",
    "mhc",
    "full",
    "full_input_query",
    "full_scalar",
    "full_sigmoid",
    "full_no_rmsnorm",
    "sliding_window",
    "block",
    "block_multihead",
    "block_no_rmsnorm",
)


@dataclass
class ModelConfig:
    """A decoder-only LM: RMSNorm PreNorm, RoPE, grouped-query attention, SwiGLU MLP.

    `layers` counts Transformer blocks (L_b); the residual stream sees L = 2·L_b sublayers.
    """

    name: str = "custom"
    vocab_size: int = 256  # byte-level by default
    d_model: int = 128
    layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None: as many as n_heads (plain multi-head attention)
    d_ff: Optional[int] = None  # None: SwiGLU width ≈ 8/3·d_model rounded up to a multiple of 32
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-10  # every RMSNorm's ε unless a family below sets its own; the rule: docs/MATH.md
    prenorm_eps: Optional[float] = None  # the sublayers' PreNorms; None: norm_eps
    residual_norm_eps: Optional[float] = None  # the residual's own norms (depth-read keys, HC streams); None: norm_eps
    final_norm_eps: Optional[float] = None  # the norm before the LM head; None: norm_eps
    tie_embeddings: bool = False
    init_std: float = 0.02
    embed_std: Optional[float] = None  # σ of the token embedding; None: init_std (GPT-2's choice)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2's attention)
    qk_norm: bool = False  # an RMSNorm (ε: the PreNorms') over each head's q and k before RoPE (Qwen3's attention)

    def eps(self, norm: str) -> float:
        """The epsilon of one family of norms: "prenorm", "residual_norm" or "final_norm"."""
        own = getattr(self, f"{norm}_eps")
        return self.norm_eps if own is None else own

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_ff is None:
            self.d_ff = 32 * -(-(8 * self.d_model // 3) // 32)
        for key in ("vocab_size", "d_model", "layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"model.{key} must be a positive integer, got {getattr(self, key)}")
        if not float(self.rope_theta) > 0:  # 0 or less: inf/NaN rotary angles, a NaN loss at step 1
            raise ValueError(f"model.rope_theta={self.rope_theta} must be positive")
        if not 0 <= float(self.init_std) < float("inf"):  # torch.nn.init.normal_ refuses it deep in the build
            raise ValueError(f"model.init_std={self.init_std} must be a finite number >= 0")
        if self.embed_std is not None and not 0 <= float(self.embed_std) < float("inf"):
            raise ValueError(f"model.embed_std={self.embed_std} must be a finite number >= 0 (or null: model.init_std)")
        if not 0 <= float(self.norm_eps) < float("inf"):
            raise ValueError(f"model.norm_eps={self.norm_eps} must be a finite number >= 0")
        for key in ("prenorm_eps", "residual_norm_eps", "final_norm_eps"):
            value = getattr(self, key)
            if value is not None and not 0 <= float(value) < float("inf"):
                raise ValueError(f"model.{key}={value} must be a finite number >= 0 (or null: model.norm_eps)")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"model.d_model={self.d_model} / model.n_heads={self.n_heads} gives head dimension "
                f"{self.d_model // self.n_heads}, which must be even for RoPE"
            )

    @property
    def sublayers(self) -> int:
        return 2 * self.layers


# The variants that read each knob of ResidualConfig; every other variant ignores it.
_BLOCK_VARIANTS = ("block", "block_multihead", "block_no_rmsnorm")
KNOB_READERS: dict[str, tuple[str, ...]] = {
    "block_size": _BLOCK_VARIANTS,
    "num_blocks": _BLOCK_VARIANTS,
    "window": ("sliding_window",),
    "heads": ("block_multihead",),
    "streams": ("hc", "mhc"),
    "sinkhorn_iters": ("mhc",),
    "gate_init": ("mhc",),
}


def reads(variant: str, knob: str) -> bool:
    """Whether `variant` reads ResidualConfig's `knob` (a field outside KNOB_READERS: every variant)."""
    return variant in KNOB_READERS.get(knob, (variant,))


@dataclass
class ResidualConfig:
    """Which residual variant owns the residual stream, and its knobs.

    Only the knobs of the chosen variant are read (KNOB_READERS): `block_size`/`num_blocks` by
    the block variants, `window` by sliding_window, `heads` by block_multihead, `streams` by
    hc/mhc and the Sinkhorn settings by mhc.
    """

    name: str = "baseline"
    block_size: int = 4  # S, sublayers per block; the last block takes any remainder (paper)
    num_blocks: Optional[int] = None  # N; when set it wins over block_size and must divide L
    window: int = 8  # sliding_window: the 8 most recent sublayer outputs + the embedding (W = 1+8)
    heads: int = 16  # block_multihead: channel groups with their own softmax over depth
    streams: int = 4  # hc / mhc: number of residual streams (n = m = 4 in both papers)
    sinkhorn_iters: int = 20  # mhc: Sinkhorn-Knopp iterations
    gate_init: float = 0.01  # mhc: gating factor alpha at init (Megatron-LM's default)

    def __post_init__(self) -> None:
        if self.name not in VARIANTS:
            raise ValueError(
                f"residual.name={self.name!r} is not a known variant; allowed: {', '.join(VARIANTS)}"
            )
        for key in ("window", "streams", "sinkhorn_iters"):  # counts, when the variant reads them
            if reads(self.name, key) and int(getattr(self, key)) < 1:
                raise ValueError(f"residual.{key}={getattr(self, key)} must be a positive integer "
                                 f"for residual={self.name}")

    def unread_settings(self) -> dict[str, object]:
        """The knobs set away from their defaults that this variant does not read: the model is
        the same without them (`residual=baseline residual.block_size=8` is the baseline)."""
        return {key: getattr(self, key) for key in KNOB_READERS
                if not reads(self.name, key) and getattr(self, key) != _defaults()[key]}

    def without_unread(self) -> "ResidualConfig":
        """This config with `unread_settings()` back at their defaults: the same model."""
        return replace(self, **{key: _defaults()[key] for key in self.unread_settings()})


def _defaults() -> dict[str, object]:
    return {f.name: f.default for f in fields(ResidualConfig)}
