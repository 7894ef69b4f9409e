"""Whether a training step fits in memory: a check before a CPU run starts, and the line of a run
that did not fit.

On a CPU the OOM killer ends a run with SIGKILL and no line, so a run that cannot fit is refused
first. The need is measured, not modelled: one forward of the run's own model on a probe under
saved-tensor hooks gives the bytes kept per token, plus 12 bytes per parameter; see
docs/RELIABILITY.md for how close that comes to a real step's peak.
"""
from __future__ import annotations

from pathlib import Path

import torch

from attnres import DecoderLM
from harness.config import ConfigError, RunSpec

PROBE_TOKENS = 128
BYTES_PER_PARAMETER = 12  # fp32 weights, gradients and one optimizer moment (a lower bound)
MARGIN = 0.9  # refused when MARGIN × the estimate exceeds what is available: no run that fits is refused
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")
GIB = 1 << 30


def available_bytes() -> int | None:
    """Memory this process could still take: MemAvailable + SwapFree, capped by the cgroup's
    memory.max − memory.current where a limit is set; None where unknown."""
    try:
        fields = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines() if ":" in line)
        available = sum(int(fields[key].split()[0]) * 1024 for key in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError):
        return None
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit visible: the machine's figure stands
    return available


def saved_bytes_per_token(spec: RunSpec) -> float:
    """Bytes autograd keeps for the backward per token of a forward and loss of the run's model
    on a probe of min(seq_len, PROBE_TOKENS) tokens, under saved-tensor hooks (parameters and
    buffers left out). The RNG states are left as they were."""
    cfg = spec.cfg
    tokens = min(cfg.train.seq_len, PROBE_TOKENS)
    with torch.random.fork_rng(devices=[]):
        model = DecoderLM(cfg.model, cfg.residual).eval()  # no module changes with it; a probe, not a training step
        own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        views: dict[int, set] = {}  # storage -> the distinct views of it that were saved
        sizes: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in own:
                views.setdefault(storage.data_ptr(), set()).add(
                    (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.numel() * t.element_size()))
                sizes[storage.data_ptr()] = storage.nbytes()
            return t

        idx = torch.zeros(1, tokens, dtype=torch.long)
        autocast = (torch.autocast("cpu", dtype=spec.autocast_dtype) if spec.autocast_dtype is not None
                    else torch.autocast("cpu", enabled=False))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            model(idx, idx)
    # Per storage, its saved views (capped by its size): a slice of a table cached for the longest
    # sequence (RoPE's) counts as the slice, q, k and v cut from one projection count whole.
    total = sum(min(sizes[ptr], sum(v[-1] for v in saved)) for ptr, saved in views.items())
    return total / tokens


def check_fits(spec: RunSpec) -> None:
    """Raise ConfigError (one line) if one micro-batch of the run cannot fit in the memory left."""
    if spec.device.type != "cpu" or spec.compile or spec.parallel is not None:
        return
    available = available_bytes()
    if available is None:
        return
    t = spec.cfg.train
    fixed = BYTES_PER_PARAMETER * spec.counts["count.params_total"]  # counted on the meta device: nothing allocated
    if MARGIN * fixed > available:
        # The probe below builds the model for real: one that cannot even hold its weights would
        # crash the check itself (model.d_model=100000), so the arithmetic answers first.
        raise ConfigError(
            f"model.d_model={spec.cfg.model.d_model}, model.layers={spec.cfg.model.layers}: "
            f"{spec.counts['count.params_total']:,.0f} parameters need about {fixed / GIB:,.1f} GiB for weights, "
            f"gradients and optimizer state alone, more than the {available / GIB:.1f} GiB this machine has "
            "available; allowed: a smaller model")
    per_token = saved_bytes_per_token(spec)

    def need(micro: int) -> float:
        return per_token * micro * t.seq_len + fixed

    if MARGIN * need(spec.micro_batch_size) <= available:
        return
    room = MARGIN * available  # what a suggestion may take: the estimate can be below the peak
    fits = [m for m in _divisors(t.batch_size) if need(m) <= room]
    if fits:
        allowed = _micro_batch(max(fits), t.batch_size)
    else:
        longest = int((room - fixed) / per_token) if room > fixed else 0
        allowed = (f"a shorter train.seq_len (one sequence of at most ~{longest:,} tokens fits) or a smaller model"
                   if longest else "a smaller model")
    raise ConfigError(
        f"train.batch_size={t.batch_size}, train.seq_len={t.seq_len}: one micro-batch of {spec.micro_batch_size} × "
        f"{t.seq_len} tokens needs about {need(spec.micro_batch_size) / GIB:.1f} GiB "
        f"({per_token / 1024:.1f} KiB per token kept for the backward, measured on a probe; parameters, gradients "
        f"and optimizer state {fixed / GIB:.2f} GiB), more than the {available / GIB:.1f} GiB this machine has "
        f"available; allowed: {allowed}")


def _divisors(batch: int) -> list[int]:
    """The micro-batch sizes a batch allows (harness.config refuses any other)."""
    return [m for m in range(1, batch + 1) if batch % m == 0]


def _micro_batch(micro: int, batch: int) -> str:
    return (f"train.micro_batch_size={micro} (the batch stays {batch} sequences: gradients accumulate), "
            "or a shorter train.seq_len")


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that did not fit: CUDA's OutOfMemoryError, or the CPU
    allocator's failure (a process memory limit, `ulimit -v`; without one the OOM killer acts)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error))


def after_out_of_memory(spec: RunSpec) -> str:
    """What a run that ran out of memory may try: half its micro-batch (the largest divisor of the
    batch at most that), a new run since the micro-batch is part of a run's identity."""
    t, micro = spec.cfg.train, spec.data_micro_batch_size
    smaller = [m for m in _divisors(t.batch_size) if m <= micro // 2]
    return _micro_batch(max(smaller), t.batch_size) if smaller else "a shorter train.seq_len or a smaller model"
