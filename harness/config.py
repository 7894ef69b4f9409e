"""The typed configuration of a run: its schemas registered with Hydra, the resolvers the configs
use, which keys make a run what it is, and `validate` (one `ConfigError` line per bad value,
before anything is written). The token budget's four spellings, in priority: train.steps >
train.flops > train.tokens_per_param > train.tokens.
"""
from __future__ import annotations

import math
import os
import re
from datetime import datetime
from pathlib import Path
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from attnres import DecoderLM, ModelConfig, ResidualConfig
from attnres.io import absolute_sqlite, default_tracking_uri  # one rule for run.py, evaluation and load()
from harness.composition_errors import unknown_key
from harness.data import DataConfig


# --- Values computed while Hydra composes: `${attnres.tracking_uri:}`, `${arch:}`, `${cell:}`, `${blocks:}`, `${attnres.now:}`
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def arch_shape(arch: Any) -> dict:
    """d_model, layers, n_heads, d_ff of a dense model with ≈ `params` non-embedding parameters.

    A block of width d holds 4d² attention weights (q, k, v, o with n_kv_heads = n_heads) and
    3·d·d_ff SwiGLU weights, so params ≈ L·d²·(4 + 3k) with k = d_ff/d. With d = r·L (r =
    d_model/L_b) that gives L = (params / (r²(4 + 3k)))^(1/3), rounded to a whole number of blocks
    (at least 1). The parameter budget is the hard constraint (paper Fig. 7 holds it fixed), so d is
    then solved from it for that L, d = √(params / (L(4 + 3k))), rather than taken as r·L: with few
    blocks the rounding of L would otherwise miss the budget by up to 2× (the realised ratio
    d_model/L_b is in the logged params). Heads = round(h·L) (at least 1); d_model is rounded to a
    multiple of 2·heads so the head dimension is whole and even (RoPE).
    """
    from harness.config import check_value  # its ranges; imported here: harness.config imports this module

    for key in ("params", "d_model_per_layer", "heads_per_layer", "ffn_ratio", "multiple"):
        check_value(f"sweep.arch.{key}", arch[key])  # a NaN or an infinity would crash round() below
    r, h, k, p = (float(arch.d_model_per_layer), float(arch.heads_per_layer), float(arch.ffn_ratio),
                  float(arch.params))
    if min(r, h, k, p) <= 0:
        raise ValueError(f"sweep.arch values must be positive, got {OmegaConf.to_container(arch)}")
    layers = max(1, round((p / (r * r * (4 + 3 * k))) ** (1 / 3)))
    heads = max(1, round(h * layers))
    step = 2 * heads
    d_model = max(step, step * round((p / (layers * (4 + 3 * k))) ** 0.5 / step))
    multiple = max(1, int(arch.multiple))
    d_ff = max(multiple, multiple * round(k * d_model / multiple))
    name = f"arch_p{p:.3g}_r{r:g}_h{h:g}".replace("+", "")
    return {"d_model": d_model, "layers": layers, "n_heads": heads, "d_ff": d_ff, "name": name}


def _arch(key: str, *, _root_: DictConfig) -> Any:
    arch = OmegaConf.select(_root_, "sweep.arch")
    if arch is None:
        raise ValueError(f"${{arch:{key}}} needs sweep.arch (set by the arch and scaling sweeps)")
    shape = arch_shape(arch)
    if key not in shape:
        raise ValueError(f"${{arch:{key}}}: unknown key; allowed: {', '.join(shape)}")
    return shape[key]


def _cell(key: str, *, _root_: DictConfig) -> Any:
    cell, cells = OmegaConf.select(_root_, "sweep.cell"), OmegaConf.select(_root_, "sweep.cells")
    if cell is None or cells is None or cell not in cells:
        allowed = ", ".join(cells.keys()) if cells else "(none defined)"
        raise ValueError(f"sweep.cell={cell!r} is not a cell of this sweep; allowed: {allowed}")
    if key not in cells[cell]:
        raise ValueError(f"sweep.cells.{cell} does not set {key}")
    return cells[cell][key]


def block_size_for(blocks: Any, *, _root_: DictConfig) -> int:
    """`${blocks:N}`: the block size S that splits the model's L = 2·model.layers sublayers into
    about N blocks, S = max(1, round(L / N)); the last block takes any remainder (paper). The paper
    fixes N ≈ 8 as it scales depth, where a fixed S would let the block count grow with the model."""
    layers, n = OmegaConf.select(_root_, "model.layers"), int(blocks)
    if layers is None or n < 1:
        raise ValueError(f"${{blocks:{blocks}}} needs model.layers and a positive number of blocks")
    return block_size_of(int(layers), n)


def block_size_of(layers: int, blocks: int) -> int:
    """S for about `blocks` blocks over the 2·layers sublayers of `layers` Transformer blocks."""
    return max(1, round(2 * layers / blocks))


def launch_now(pattern: str) -> str:
    agreed = os.environ.get("ATTNRES_LAUNCH_TIME")  # harness.launch.LAUNCH_TIME_ENV
    return (datetime.fromtimestamp(float(agreed)) if agreed else datetime.now()).strftime(pattern)


def register_resolvers() -> None:
    """The OmegaConf resolvers the configs use (idempotent)."""
    if not OmegaConf.has_resolver("attnres.now"):
        OmegaConf.register_new_resolver("attnres.now", launch_now, use_cache=True)  # cached as Hydra's now
    for name, fn in (
        ("attnres.tracking_uri", lambda: default_tracking_uri()),
        ("arch", _arch),
        ("cell", _cell),
        ("blocks", block_size_for),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


# --- Which config keys make a run what it is
# Keys that do not change what a run computes (prefixes of flattened keys): a run's folder
# (harness.checkpoint.run_key) and an Optuna study's fixed overrides ignore them.
# Options added after runs existed, at the value that computes what those runs computed: a run
# at that value keeps the key it had before the option existed (a study resumed after an update
# finds its finished runs instead of training them again).
NEUTRAL = {"data.loss_on": "all", "data.format": "assign", "data.aligned": False, "model.embed_std": None,
           "model.prenorm_eps": None, "model.residual_norm_eps": None, "model.final_norm_eps": None,
           "model.init_from": None, "model.qkv_bias": False, "model.qk_norm": False}
NOT_IDENTITY = (
    "tracking.", "train.progress", "train.checkpoint_dir", "train.resume", "train.checkpoint_interval",
    "train.log_interval", "train.threads", "train.keep_freed_memory", "train.distributed", "train.retry_failed",
    "train.code_change",
)


def override_key(line: str) -> str:
    """The key of a Hydra override line (`key=value`, `+key=value`, `++key=value`, `~key`)."""
    return line.lstrip("+~").split("=", 1)[0]


# A config group whose keys are all outside the identity (`tracking=off`) is outside it too, so it
# neither renames runs nor stops an Optuna study from being continued.
GROUPS_NOT_IDENTITY = tuple(p[:-1] for p in NOT_IDENTITY if p.endswith("."))


def changes_the_run(line: str) -> bool:
    """Whether a command-line override can change what a run computes: neither Hydra's own
    (`hydra.*`, `hydra/...`) nor one of the NOT_IDENTITY keys or groups."""
    key = override_key(line)
    return not (key in ("hydra", *GROUPS_NOT_IDENTITY)
                or key.startswith(("hydra.", "hydra/", *NOT_IDENTITY)))


class ConfigError(ValueError):
    """A configuration that cannot run. The message is one line: key, value, what is allowed."""


class Precision(Enum):
    auto = "auto"  # bf16 autocast on CUDA, fp32 elsewhere
    fp32 = "fp32"
    bf16 = "bf16"  # autocast to bfloat16 for matmuls; weights and optimizer state stay fp32


class OptimName(Enum):
    adamw = "adamw"
    muon = "muon"  # Muon on the sublayers' matrices, AdamW on everything else


class ScheduleName(Enum):
    cosine = "cosine"
    wsd = "wsd"  # warmup-stable-decay
    constant = "constant"  # warmup then flat (for debugging and LR range tests)


class ParallelMode(Enum):
    """How the processes of a torchrun launch share the work (docs/DISTRIBUTED.md)."""

    ddp = "ddp"  # every process holds the whole model; gradients are averaged (DistributedDataParallel)
    fsdp = "fsdp"  # parameters, gradients and optimizer state sharded over the processes (FSDP2)


class CodeChange(Enum):
    """What a rerun does with a finished or resumable run whose code changed since (harness/job.py)."""

    ask = "ask"  # refuse in one line naming the changed files (exit 2)
    keep = "keep"  # accept the recorded result, or resume the run with the code as it is now
    retrain = "retrain"  # train it again from step 0 into a new MLflow run


class DecayShape(Enum):
    linear = "linear"
    cosine = "cosine"
    sqrt = "sqrt"  # 1 - sqrt: the WSD paper's (Hägele et al. 2024) preferred cooldown


@dataclass
class TrainConfig:
    """Defaults are the CPU-sized ones of conf/train/default.yaml (which is what runs)."""

    # --- budget (priority: steps > flops > tokens_per_param > tokens) ---
    tokens: int | None = 250_000  # training tokens; steps = ceil(tokens / (batch_size·seq_len))
    steps: int | None = None  # optimizer steps; wins over every other budget when set
    flops: float | None = None  # compute budget: tokens = flops / count.flops_per_token (arch sweep)
    tokens_per_param: float | None = None  # tokens = ratio × count.params_non_embedding (scaling)
    # --- batch ---
    batch_size: int = 16  # global batch in sequences per optimizer step (fixed whatever the memory)
    micro_batch_size: int | None = None  # sequences per forward/backward; null = batch_size
    seq_len: int = 128
    # --- numerics and speed ---
    precision: Precision = Precision.auto
    compile: bool | None = None  # null = on for CUDA, off on CPU (where it does not pay)
    device: str = "auto"  # auto (CUDA if present, else CPU), cpu, cuda, cuda:N, mps
    threads: int | None = None  # CPU intra-op threads; null = torch's default
    keep_freed_memory: bool = True  # glibc keeps freed tensors for the next step (harness/malloc.py)
    distributed: ParallelMode | None = None  # under torchrun; null = ddp when WORLD_SIZE > 1
    seed: int = 0  # model init and data order
    # --- periodic work (steps; 0 = only at the end) ---
    log_interval: int = 10  # train/* metrics: means over the interval
    eval_interval: int = 25
    eval_batches: int = 8  # batches of micro_batch_size sequences in the fixed held-out set
    instrument_interval: int = 25  # depth weights, output RMS and grad norms per block
    instrument_seqs: int = 4  # sequences of the first held-out batch that model.inspect reads
    checkpoint_interval: int = 25
    # --- files ---
    checkpoint_dir: str | None = None  # null = <project root>/checkpoints
    resume: bool = True  # rerunning the same config resumes it (a finished run is not redone)
    retry_failed: bool = False  # rerunning a failed config resumes it from its last good checkpoint
    code_change: CodeChange = CodeChange.ask  # a finished or resumable run whose code changed since: ask, keep, retrain
    progress: bool = True  # tqdm bar with loss and tokens/s


@dataclass
class OptimConfig:
    name: OptimName = OptimName.adamw
    lr: float = 3e-3  # peak learning rate (Muon: AdamW-equivalent, see harness/optim.py)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1  # matrices only (model.optimizer_groups)
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    momentum: float = 0.95  # muon
    nesterov: bool = True  # muon
    ns_steps: int = 5  # muon: Newton-Schulz iterations


@dataclass
class ScheduleConfig:
    name: ScheduleName = ScheduleName.cosine
    warmup_steps: int | None = None  # wins over warmup_fraction when set
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1  # final lr = min_lr_ratio × optim.lr (cosine and wsd)
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying at the end
    decay_shape: DecayShape = DecayShape.linear  # wsd


@dataclass
class TrackingConfig:
    enabled: bool = True
    # default: $MLFLOW_TRACKING_URI, else sqlite:///<project root>/mlflow.db (harness/config.py)
    uri: str = "${attnres.tracking_uri:}"
    experiment: str | None = None  # null = sweep.name
    run_name: str | None = None  # null = <variant>-<model>-s<seed> and the job's other overrides (job.run_label)
    parent_run_id: str | None = None  # set by the Optuna sweeper: the run becomes its child
    system_metrics: bool = False  # MLflow's CPU/GPU/memory sampler (a thread; off by default)
    log_code: bool = True  # git commit, diff and a source snapshot as artifacts
    log_env: bool = True  # pip freeze
    log_plots: bool = True  # depth-weight heat map and magnitude plots at the end
    log_model: bool = True  # the trained model as artifact model/ (attnres.save_pretrained; attnres.load(run_id))
    log_explorer: bool = True  # the depth-map explorer page explorer/depth.html (variants with depth weights)
    flush_seconds: float = 5.0  # metrics are buffered and written in batches at most this often


@dataclass
class ArchConfig:
    """A model shape generated from a parameter budget and two aspect ratios (paper Fig. 7).

    Read by the `${arch:...}` resolver of harness/config.py; null when a run uses a preset."""

    params: float = 1e6  # non-embedding parameter budget
    d_model_per_layer: float = 45.0  # d_model / L_b
    heads_per_layer: float = 0.5  # n_heads / L_b
    ffn_ratio: float = 4.0  # d_ff / d_model (dense; the paper's MoE expert is ≈0.45)
    multiple: int = 8  # d_ff rounded to a multiple of this


@dataclass
class SweepConfig:
    name: str = "default"  # the MLflow experiment, and a folder level of the checkpoints
    # Named override sets for sweeps that are not a product (block_size: S values + baseline):
    # the sweep dimension is `sweep.cell`, and `${cell:key}` reads cells[cell][key].
    cell: str | None = None
    cells: dict[str, dict[str, Any]] = field(default_factory=dict)
    arch: ArchConfig | None = None


@dataclass
class RunModelConfig(ModelConfig):
    """The model node of a run: attnres' ModelConfig, and where its first weights come from."""

    # A Hugging Face checkpoint folder (Llama/Qwen) whose shape and weights start the run (harness/hf_import.py);
    # validate() hands DecoderLM the plain ModelConfig when it is unset.
    init_from: str | None = None


@dataclass
class RunConfig:
    model: RunModelConfig = field(default_factory=RunModelConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)


def register() -> None:
    """Store the root schema (conf/config.yaml's first default) and the sweeps in the ConfigStore."""
    from harness import sweeps

    register_resolvers()
    ConfigStore.instance().store(name="run_schema", node=RunConfig)
    sweeps.register()


# --------------------------------------------------------------------------------------------
# Validation: DictConfig -> a checked, derived RunSpec
# --------------------------------------------------------------------------------------------
@dataclass
class RunSpec:
    """Everything a run needs, checked: the typed config plus what is derived from it."""

    cfg: RunConfig
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: fp32
    compile: bool
    micro_batch_size: int
    accum_steps: int
    steps: int
    tokens_per_step: int
    counts: dict[str, float]  # count.* params: parameters, FLOPs per token, budget
    # Data parallelism (harness/distributed.py). micro_batch_size and accum_steps above are this
    # process's; the data stream is cut in batches of data_micro_batch_size whatever the world size.
    parallel: ParallelMode | None = None  # None: one process
    world_size: int = 1
    data_micro_batch_size: int = 0  # the single-process micro-batch (train.micro_batch_size or batch_size)
    ignored: dict[str, Any] = field(default_factory=dict)  # residual knobs set but not read by the variant (reset)

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def check_folder_name(key: str, value: Any) -> None:
    """A name that becomes one folder level (Hydra's outputs/<sweep.name>/…): `../../x` or `a/b`
    would put the folder elsewhere, outside the project."""
    text = str(value)
    if text in ("", ".", "..") or "/" in text or "\\" in text or not text.isprintable():
        _fail(f"{key}={text!r} is not one folder name; allowed: a name without / or \\, other than . "
              "and .., on one line (e.g. my-sweep_2)")


def _one_line(error: Exception) -> str:
    """OmegaConf errors span lines (key, type, full_key); keep them on one. A resolver's own error
    (harness/config.py raises one line naming the key and what is allowed) without OmegaConf's
    wrapping around it ("ValueError raised while resolving interpolation: ... full_key: ...")."""
    text = str(error)
    if isinstance(error, InterpolationResolutionError):
        own = re.match(r"ValueError raised while resolving interpolation: (.+)", text)
        if own:
            return " ".join(own.group(1).split())
    return " ".join(text.split())


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        _fail(f"train.device={name!r} is not a device; allowed: auto, cpu, cuda, cuda:N, mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        _fail(f"train.device={name!r}: CUDA is not available on this machine; allowed: auto, cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        _fail(f"train.device={name!r}: unsupported device type; allowed: auto, cpu, cuda, cuda:N, mps")
    return device


def to_objects(cfg: DictConfig) -> RunConfig:
    """The composed config as dataclass objects, each __post_init__ run (one line on error)."""
    _reject_added_keys(cfg)
    try:
        obj = OmegaConf.to_object(cfg)
    except (OmegaConfBaseException, ValueError, TypeError) as error:
        _fail(_named_by_the_user(cfg, _one_line(error)))
    if not isinstance(obj, RunConfig):  # composed without run_schema (a hand-made config)
        _fail(f"the config is not a RunConfig (got {type(obj).__name__}); compose conf/config.yaml")
    return obj


def _named_by_the_user(cfg: DictConfig, message: str) -> str:
    """A schema's check names its own key; when that key's value is an interpolation, also name
    the key it comes from: `train.seq_len=0` was reported as "model.max_seq_len must be a
    positive integer" (model.max_seq_len is ${train.seq_len}), a key the user never typed."""
    head = message.split(" ", 1)[0].split("=", 1)[0]
    section, _, key = head.partition(".")
    node = cfg.get(section) if section in cfg else None
    if not key or not isinstance(node, DictConfig) or key not in node:
        return message
    raw = OmegaConf.to_container(node, resolve=False).get(key)
    if isinstance(raw, str) and raw.startswith("${") and raw.endswith("}") and ":" not in raw:
        return f"{message} ({head} is {raw}: it comes from {raw[2:-1]})"
    return message


def _reject_added_keys(node: DictConfig, path: str = "") -> None:
    """`+model.layerz=3` adds a key the schema does not have (a misspelt key with `+`): Hydra
    accepts it, OmegaConf.to_object keeps it as a stray attribute, and the run would silently
    ignore it. Refuse it with the line a misspelt key without `+` gets."""
    schema = OmegaConf.get_type(node)
    if is_dataclass(schema):
        known = [f.name for f in fields(schema)]
        for key in node.keys():
            if key in known or (not path and key == "hydra"):  # a root composed with Hydra's node
                continue
            value = node._get_node(key)
            shown = OmegaConf.to_container(value, resolve=False) if isinstance(value, DictConfig) else value._value()
            _fail(unknown_key(f"{path}{key}", shown, known))
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not (child._is_none() or child._is_missing() or child._is_interpolation()):
            _reject_added_keys(child, f"{path}{key}.")


# The range of every numeric field of every group, in one place: (low, high, low_open, high_open).
# validate checks each against it before anything reads the field, so a NaN (which compares false
# with everything), an infinity or an integer past what torch, numpy or a sampler take is one line,
# not a traceback, a diverged run or a silently disabled setting (grad_clip=nan clipped nothing).
# A list (optim.betas, data.hops) has each element checked. A numeric field missing here is still
# checked for finiteness and for INT_MAX (tests/test_reliability_numeric_config.py requires an entry).
INT_MAX = 2**63 - 1  # int64: what torch.manual_seed, numpy and every tensor index take
COUNT = (1, 2**31 - 1, False, False)  # sizes and counts: positive, an int32 (tensor shapes, loop ranges)
WIDTH = (1, 2**20, False, False)  # a model dimension: beyond it no model can be built or fit anywhere
INTERVAL = (0, 2**40, False, False)  # steps between periodic work; 0 = only at the end
POSITIVE = (0.0, math.inf, True, True)  # a finite number > 0
NON_NEGATIVE = (0.0, math.inf, False, True)  # a finite number >= 0
FRACTION = (0.0, 1.0, False, True)  # [0, 1)
SEED = (0, INT_MAX, False, False)
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "model.vocab_size": (1, 2**24, False, False),
    "model.d_model": WIDTH,
    "model.layers": (1, 4096, False, False),  # blocks; more cannot even be counted on the meta device quickly
    "model.n_heads": WIDTH,
    "model.n_kv_heads": WIDTH,
    "model.d_ff": (1, 2**22, False, False),
    "model.max_seq_len": (1, 2**24, False, False),
    "model.rope_theta": POSITIVE,
    "model.norm_eps": NON_NEGATIVE,
    "model.prenorm_eps": NON_NEGATIVE,
    "model.residual_norm_eps": NON_NEGATIVE,
    "model.final_norm_eps": NON_NEGATIVE,
    "model.init_std": NON_NEGATIVE,
    "model.embed_std": NON_NEGATIVE,
    "residual.block_size": (1, 8192, False, False),
    "residual.num_blocks": (1, 8192, False, False),
    "residual.window": (1, 8192, False, False),
    "residual.heads": WIDTH,
    "residual.streams": (1, 1024, False, False),
    "residual.sinkhorn_iters": (1, 10_000, False, False),
    "residual.gate_init": (-math.inf, math.inf, True, True),  # any finite number
    "data.val_fraction": FRACTION,
    "data.max_bytes": (1, 2**62, False, False),
    "data.vocab_size": (1, 2**24, False, False),
    "data.hops": COUNT,
    "data.n_vars": COUNT,
    "data.queries": (0, 2**20, False, False),  # extra queries per example; 0 = none
    "data.train_examples": COUNT,
    "data.val_examples": COUNT,
    "data.seed": SEED,
    "optim.lr": POSITIVE,
    "optim.betas": FRACTION,
    "optim.eps": NON_NEGATIVE,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.grad_clip": NON_NEGATIVE,  # 0 disables clipping
    "optim.momentum": FRACTION,
    "optim.ns_steps": (1, 1000, False, False),
    "schedule.warmup_steps": INTERVAL,
    "schedule.warmup_fraction": FRACTION,
    "schedule.min_lr_ratio": (0.0, 1.0, False, False),
    "schedule.decay_fraction": (0.0, 1.0, True, False),
    "train.tokens": (1, 2**62, False, False),
    "train.steps": (1, 2**40, False, False),
    "train.flops": (0.0, 1e30, True, False),
    "train.tokens_per_param": (0.0, 1e9, True, False),
    "train.batch_size": COUNT,
    "train.micro_batch_size": COUNT,
    "train.seq_len": (1, 2**24, False, False),
    "train.threads": (1, 4096, False, False),
    "train.seed": SEED,
    "train.log_interval": INTERVAL,
    "train.eval_interval": INTERVAL,
    "train.eval_batches": COUNT,
    "train.instrument_interval": INTERVAL,
    "train.instrument_seqs": COUNT,
    "train.checkpoint_interval": INTERVAL,
    "tracking.flush_seconds": (0.0, 86_400.0, False, False),
    "sweep.arch.params": (0.0, 1e15, True, False),
    "sweep.arch.d_model_per_layer": (0.0, 2.0**20, True, False),
    "sweep.arch.heads_per_layer": (0.0, 2.0**16, True, False),
    "sweep.arch.ffn_ratio": (0.0, 1024.0, True, False),
    "sweep.arch.multiple": (1, 2**16, False, False),
}


def numeric_fields(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every numeric field (int or float, not bool; a list of them) of a config dataclass tree, by
    dotted key, None where unset; what RANGES must cover."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            out.update(numeric_fields(value, key + "."))
        elif _is_number(value) or (isinstance(value, (list, tuple)) and value and all(map(_is_number, value))):
            out[key] = value
        elif value is None and _numeric_annotation(f.type):
            out[key] = None
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numeric_annotation(annotation: Any) -> bool:
    text = str(annotation)
    return ("int" in text or "float" in text) and "str" not in text and "dict" not in text.lower()


def check_numbers(run: Any) -> None:
    """Each numeric field finite and within RANGES (an unlisted one: finite, |int| <= INT_MAX)."""
    for key, value in numeric_fields(run).items():
        check_value(key, value)


def check_value(key: str, value: Any) -> None:
    """Raise ConfigError (one line) unless `value` (a number, a list of them, or None) lies in
    RANGES[key]. Also what the ${arch:...} resolver calls before it computes a shape."""
    if value is None:
        return
    low, high, low_open, high_open = RANGES.get(key, (-INT_MAX, INT_MAX, False, False))
    shown = f"{key}={list(value) if isinstance(value, (list, tuple)) else value}"
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, float) and not math.isfinite(item):
            _fail(f"{shown} must be a finite number; allowed: {_range_text(low, high, low_open, high_open)}")
        below = item <= low if low_open else item < low
        above = item >= high if high_open else item > high
        if below or above:
            _fail(f"{shown} is out of range; allowed: {_range_text(low, high, low_open, high_open)}")


def _range_text(low: float, high: float, low_open: bool, high_open: bool) -> str:
    def shown(x: float) -> str:
        if isinstance(x, int) and x >= 2**20 and x & (x - 1) == 0:
            return f"2**{x.bit_length() - 1}"
        if isinstance(x, int) and x == INT_MAX:
            return "2**63-1"
        return f"{x:g}" if isinstance(x, float) else str(x)

    if high == math.inf:
        return f"a finite number {'>' if low_open else '>='} {shown(low)}" if low != -math.inf else "a finite number"
    return f"{'(' if low_open else '['}{shown(low)}, {shown(high)}{')' if high_open else ']'}"


def _start_weights(model: RunModelConfig, data_vocab: int) -> ModelConfig:
    """Without model.init_from, the core's own ModelConfig (what the run saves describes the model
    alone); with it, the checkpoint's shape and its absolute path (one line when it cannot be imported)."""
    if model.init_from is None:
        return ModelConfig(**{f.name: getattr(model, f.name) for f in fields(ModelConfig)})
    from harness import hf_import

    if not str(model.init_from).strip():
        _fail("model.init_from is empty; allowed: a Hugging Face checkpoint folder, or null")
    try:
        return hf_import.run_model_config(model, data_vocab)
    except hf_import.ImportRefused as error:
        _fail(_one_line(error))
    except (OSError, KeyError, TypeError, ValueError) as error:  # a key missing or of the wrong type
        _fail(f"model.init_from={model.init_from}: its config.json is not a Llama/Qwen config ({_one_line(error)})")


def _check_unread_knobs(residual: ResidualConfig) -> None:
    for key, value in numeric_fields(residual, "residual.").items():
        if isinstance(value, float) and not math.isfinite(value):
            _fail(f"{key}={value} must be a finite number")
        if isinstance(value, int) and abs(value) > INT_MAX:
            _fail(f"{key}={value} is out of range; allowed: |value| <= 2**63-1")


def validate(cfg: DictConfig) -> RunSpec:
    """Check a composed config and derive the run's plan. Raises ConfigError (one line)."""
    run = to_objects(cfg)
    # Knobs the variant does not read leave the model unchanged, so the run is recorded, keyed and
    # named without them: `-m residual=baseline,block residual.block_size=2,8` trains one baseline.
    # (NaN, an infinity or an integer past int64 is refused even there: it is never meant.)
    _check_unread_knobs(run.residual)
    ignored = run.residual.unread_settings()
    run.residual = run.residual.without_unread()
    run.model = _start_weights(run.model, run.data.vocab_size)
    t, o, s, m = run.train, run.optim, run.schedule, run.model

    check_numbers(run)
    check_folder_name("sweep.name", run.sweep.name)
    name = run.tracking.run_name
    if name is not None and any(not ch.isprintable() for ch in str(name)):  # a newline splits the UI's list and logs
        _fail(f"tracking.run_name={str(name)!r} holds a newline or another control character; allowed: one line of text")
    if len(o.betas) != 2:
        _fail(f"optim.betas={list(o.betas)} must be two numbers in [0, 1)")
    if all(getattr(t, k) is None for k in ("tokens", "steps", "flops", "tokens_per_param")):
        _fail("no training budget: set one of train.steps, train.flops, train.tokens_per_param, train.tokens")

    micro = t.micro_batch_size or t.batch_size
    if t.batch_size % micro:
        divisors = [d for d in range(1, t.batch_size + 1) if t.batch_size % d == 0]
        _fail(f"train.micro_batch_size={micro} must divide train.batch_size={t.batch_size}; "
              f"allowed: {', '.join(map(str, divisors))}")
    if t.seq_len > m.max_seq_len:
        _fail(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise "
              "model.max_seq_len (the presets set it to ${train.seq_len})")
    if m.vocab_size < run.data.vocab_size:
        _fail(f"model.vocab_size={m.vocab_size} is smaller than data.vocab_size={run.data.vocab_size}; "
              "the presets set it to ${data.vocab_size}")

    device = resolve_device(t.device)
    parallel, world = _parallel_mode(t, o, device)
    if parallel is ParallelMode.fsdp and getattr(m, "init_from", None):  # FSDP shards the model before the copy
        _fail(f"model.init_from={m.init_from} with FSDP: not supported; allowed: one process or DDP")
    if parallel is not None and device.type == "cuda":
        device = _rank_device(t.device)
    rank_micro, accum = _rank_batch(t.batch_size, micro, world)
    precision = t.precision
    if precision is Precision.auto:
        precision = Precision.bf16 if device.type == "cuda" else Precision.fp32
    if precision is Precision.bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        _fail(f"train.precision=bf16: {torch.cuda.get_device_name(device)} has no bfloat16; allowed: fp32")
    compile_ = (device.type == "cuda") if t.compile is None else t.compile

    counts = model_counts(run)
    tokens_per_step = t.batch_size * t.seq_len
    steps = t.steps
    if steps is None:
        if t.flops is not None:
            budget = t.flops / counts["count.flops_per_token"]
        elif t.tokens_per_param is not None:
            budget = t.tokens_per_param * counts["count.params_non_embedding"]
        else:
            budget = float(t.tokens)
        steps = max(1, math.ceil(budget / tokens_per_step))
    counts["count.train_steps"] = steps
    counts["count.train_tokens"] = steps * tokens_per_step
    counts["count.train_flops"] = steps * tokens_per_step * counts["count.flops_per_token"]
    return RunSpec(
        cfg=run, device=device, autocast_dtype=torch.bfloat16 if precision is Precision.bf16 else None,
        compile=compile_, micro_batch_size=rank_micro, accum_steps=accum, steps=steps,
        tokens_per_step=tokens_per_step, counts=counts, parallel=parallel, world_size=world,
        data_micro_batch_size=micro, ignored=ignored,
    )


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _parallel_mode(t: TrainConfig, o: OptimConfig, device: torch.device) -> tuple[ParallelMode | None, int]:
    """(mode, world size). One process unless torchrun (or a launcher setting its variables) says
    otherwise; train.distributed picks DDP or FSDP2, and with WORLD_SIZE=1 forces the distributed
    code path on one process (a one-GPU check of a multi-GPU setup)."""
    world = world_size()
    step_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1)
    if step_tasks > 1 and "WORLD_SIZE" not in os.environ:
        # srun started several copies of run.py and nothing made them one launch: each would
        # train the same run alone (and all but one stop as "busy").
        _fail(f"SLURM_STEP_NUM_TASKS={step_tasks}: srun started {step_tasks} copies of run.py, each of which would "
              "train this run alone; run one task per node that starts torchrun (`srun --ntasks-per-node=1 "
              "torchrun --nproc_per_node=G run.py ...`, docs/DISTRIBUTED.md) or use hydra/launcher=slurm with "
              "tasks_per_node; allowed without torchrun: one task (in a shell that srun started with several "
              "tasks, unset SLURM_STEP_NUM_TASKS)")
    mode = t.distributed if t.distributed is not None else (ParallelMode.ddp if world > 1 else None)
    if mode is None:
        return None, 1
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        _fail(f"train.distributed={mode.value}: the environment lacks {', '.join(missing)}; launch with "
              "`torchrun --nproc_per_node=N run.py ...` (docs/DISTRIBUTED.md); allowed without torchrun: null")
    if device.type == "mps":
        _fail(f"train.distributed={mode.value} with train.device={t.device!r}: MPS has no process-group "
              "backend; allowed: cpu (gloo), cuda (nccl)")
    if mode is ParallelMode.fsdp and o.name is OptimName.muon:
        _fail("train.distributed=fsdp with optim.name=muon: Muon orthogonalises whole matrices, which FSDP "
              "shards over the processes; allowed: optim=adamw, or train.distributed=ddp")
    return mode, world


def _rank_device(name: str) -> torch.device:
    """Each process of a node drives the GPU of its LOCAL_RANK (torchrun's convention)."""
    local, count = local_rank(), torch.cuda.device_count()
    if name not in ("auto", "cuda"):
        _fail(f"train.device={name!r} under torchrun: each process takes cuda:LOCAL_RANK; allowed: auto, cuda, cpu "
              "(choose GPUs with CUDA_VISIBLE_DEVICES)")
    if local >= count:
        _fail(f"LOCAL_RANK={local} but this machine has {count} visible CUDA device(s); allowed: "
              f"--nproc_per_node <= {count}")
    return torch.device("cuda", local)


def _rank_batch(batch_size: int, micro: int, world: int) -> tuple[int, int]:
    """(this process's micro-batch, its accumulation steps). The global batch stays batch_size
    whatever the world size: each process takes batch_size / world sequences per optimizer step,
    in micro-batches no larger than train.micro_batch_size. With one process: (micro, batch/micro)."""
    if batch_size % world:
        _fail(f"train.batch_size={batch_size} does not divide over WORLD_SIZE={world} processes (the global batch "
              f"is fixed; each process takes batch_size/WORLD_SIZE sequences); allowed: a batch_size that is a "
              f"multiple of {world}, or a process count among {', '.join(map(str, _divisors(batch_size)))}")
    per_rank = batch_size // world
    rank_micro = min(micro, per_rank)
    if per_rank % rank_micro:
        _fail(f"train.micro_batch_size={micro} must divide the per-process batch train.batch_size/WORLD_SIZE = "
              f"{batch_size}/{world} = {per_rank}; allowed: {', '.join(map(str, _divisors(per_rank)))}")
    return rank_micro, per_rank // rank_micro


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_counts(run: RunConfig) -> dict[str, float]:
    """count.* from the model's own accounting, built on the meta device (instant, no memory).
    Building it also runs the residual's shape checks (block sizes, heads), hence ConfigError."""
    try:
        with torch.device("meta"):
            model = DecoderLM(run.model, run.residual)
    except ValueError as error:
        _fail(_one_line(error))
    params = model.param_counts()
    return {
        "count.params_total": params["total"],
        "count.params_embedding": params["embedding"],
        "count.params_non_embedding": params["non_embedding"],
        "count.params_residual": params["residual"],
        "count.flops_per_token": model.flops_per_token(run.train.seq_len)["total"],
    }


def to_plain(run: RunConfig) -> dict[str, Any]:
    """The effective config as plain Python (Enums as their names): what is logged and hashed."""

    def clean(value: Any) -> Any:
        if isinstance(value, Enum):
            return value.value
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return clean(asdict(run))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists and empty dicts stay leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def rank() -> int:
    """This process's rank under torchrun (0 when not distributed): only rank 0 logs and saves."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """Processes of the torchrun launch (1 when not distributed)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's index on its node under torchrun: its GPU."""
    return int(os.environ.get("LOCAL_RANK", "0"))
