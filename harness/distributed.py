"""Data-parallel training over the processes of a torchrun launch: the process group, the
wrapped model, and the few collectives the training loop needs.

    torchrun --standalone --nproc_per_node=8 run.py model=194m train=gpu

N processes compute what one computes (same batches, averaged gradients, one checkpoint format),
and whatever ends or branches the loop is decided collectively; docs/DISTRIBUTED.md says how.
"""
from __future__ import annotations

import gc
import math
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from harness.config import ParallelMode, RunSpec


class ResumeMismatch(RuntimeError):
    """The ranks found different checkpoints (a checkpoint_dir that is not shared by all nodes)."""


# -- the process group -----------------------------------------------------------------------------
@contextmanager
def process_group(spec: RunSpec):
    """The default process group for the run's lifetime (env://: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT from torchrun): nccl on cuda:LOCAL_RANK, gloo on the CPU. Nothing when the run is
    one process. destroy_process_group always runs, also on errors and SystemExit."""
    if spec.parallel is None:
        yield
        return
    cuda = spec.device.type == "cuda"
    if cuda:
        torch.cuda.set_device(spec.device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=spec.device if cuda else None)
    try:
        yield
    except BaseException as error:
        _drop_frames(error)
        raise
    finally:
        # The model's DDP wrapper holds the group too. Left for the interpreter's last garbage
        # collection, it would destroy the group at exit, where the gloo worker threads can no
        # longer take the GIL: a deadlock after a SIGTERM stop. Freed here, the wrapper goes
        # while the group is still alive.
        gc.collect()
        dist.destroy_process_group()


def _drop_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames an in-flight exception (and its chain) keeps
    alive — the trainer among them — so that they can be freed before the process group."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        stack += [e.__context__, e.__cause__]


def lost_process(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another process of the launch is gone
    (killed by the OOM killer, its node lost): torch's DistError (NCCL, the store), or gloo's
    plain RuntimeError, which names its source ("[.../gloo/transport/tcp/pair.cc:553] Connection
    closed by peer"). Such a run did not fail: it was interrupted, and resumes from its last
    checkpoint like a run killed whole."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and "/gloo/" in str(error).replace("\\", "/")


def from_main(value: Any) -> Any:
    """Rank 0's `value` on every rank (picklable objects); the value itself with one process."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_everywhere(folder) -> dict[str, Any] | None:
    """The run folder's checkpoint, read by every rank from disk, with a check that all ranks
    resume from the same step (on several nodes, train.checkpoint_dir must be shared). A
    checkpoint that one rank cannot read stops every rank with that rank's line."""
    from harness.checkpoint import CheckpointUnreadable

    try:
        state, unreadable = folder.load(), None
    except CheckpointUnreadable as error:  # the others must learn it, or they wait in a collective
        state, unreadable = None, str(error)
    if dist.is_initialized():
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (unreadable, None if state is None else state["step"]))
        unreadable = next((u for u, _ in seen if u), None)
        steps = [step for _, step in seen]
        if not unreadable and len(set(steps)) > 1:
            raise ResumeMismatch(
                f"{folder.path}: the ranks see different checkpoints (steps by rank: {steps}); on several "
                "nodes train.checkpoint_dir must be one shared folder")
    if unreadable:
        raise CheckpointUnreadable(unreadable)
    return state


def strategy(spec: RunSpec) -> Local:
    return {None: Local, ParallelMode.ddp: DDP, ParallelMode.fsdp: FSDP}[spec.parallel](spec)


# -- the strategies ----------------------------------------------------------------------------------
class Local:
    """One process: each method is exactly what the training loop did before it had strategies."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.world, self.rank = 1, 0

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """What the loop calls for the forward pass (build the optimizer after this)."""
        return model

    def train_batches(self, tokens: torch.Tensor, start_step: int) -> Iterator:
        from harness.data import batch_iterator

        s, t = self.spec, self.spec.cfg.train
        return batch_iterator(tokens, s.micro_batch_size, t.seq_len, t.seed, start_batch=start_step * s.accum_steps,
                              aligned=s.cfg.data.aligned)

    def val_shard(self, batches: list) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(x, y, weight) of the held-out batches this rank evaluates; weight = sequences counted."""
        return [(x, y, x.shape[0]) for x, y in batches]

    def gradient_sync(self, last_micro_batch: bool):
        return nullcontext()

    def step_loss(self, loss_sum: torch.Tensor, accum: int, stop: bool) -> float:
        return float(loss_sum) / accum  # the one host sync of the step

    def stop_now(self, stop: bool) -> bool:
        """Whether to checkpoint and stop after this step (a SIGTERM seen so far)."""
        return stop

    def sums(self, *values: float) -> tuple[float, ...]:
        """Each value summed over ranks."""
        return values

    def all_finite(self, model: torch.nn.Module) -> bool:
        return bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all())

    def grad_norm_per_block(self, model) -> list[float]:
        return model.grad_norm_per_block()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def state(self, model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
        """(model state, optimizer state) as a single process writes them (rank 0 saves them)."""
        return model.state_dict(), optimizer.state_dict()

    def load_state(self, model: torch.nn.Module, optimizer, model_state: dict, optimizer_state: dict) -> None:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    def plain_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The trained model as one unwrapped module on rank 0 (None elsewhere), for export."""
        return model


class DDP(Local):
    def __init__(self, spec: RunSpec):
        super().__init__(spec)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.wrapped: torch.nn.parallel.DistributedDataParallel | None = None
        self._stop = False

    def wrap(self, model):
        cuda = self.spec.device.type == "cuda"
        self.wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[self.spec.device.index] if cuda else None)
        return self.wrapped

    def train_batches(self, tokens, start_step):
        from harness.data.batches import rank_batch_iterator

        s, t = self.spec, self.spec.cfg.train
        return rank_batch_iterator(tokens, t.batch_size, s.data_micro_batch_size, s.micro_batch_size, t.seq_len,
                                   t.seed, self.rank, self.world, start_step=start_step, aligned=s.cfg.data.aligned)

    def val_shard(self, batches):
        """This rank's contiguous share of the held-out sequences in micro-batches, padded with
        weight-0 batches to the count of the largest share."""
        if not batches:
            return []
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        micro = self.spec.micro_batch_size
        share = torch.tensor_split(torch.arange(x.shape[0]), self.world)[self.rank]
        mine = [(x[i], y[i], len(i)) for i in share.split(micro)] if len(share) else []
        most = math.ceil(math.ceil(x.shape[0] / self.world) / micro)
        return mine + [(x[:micro], y[:micro], 0)] * (most - len(mine))

    def gradient_sync(self, last_micro_batch):
        return nullcontext() if last_micro_batch else self.wrapped.no_sync()

    def step_loss(self, loss_sum, accum, stop):
        packed = torch.stack([loss_sum.float() / accum, torch.tensor(float(stop), device=loss_sum.device)])
        dist.all_reduce(packed)  # sum over ranks
        mean, stops = packed.tolist()  # the one host sync of the step
        self._stop = stops > 0
        return mean / self.world

    def stop_now(self, stop):
        return self._stop  # agreed in step_loss: a signal arriving later counts at the next step

    def sums(self, *values):
        device = self.spec.device if self.spec.device.type == "cuda" else "cpu"
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return tuple(t.tolist())

    def all_finite(self, model):
        finite = torch.stack([torch.isfinite(_local(p)).all() for p in model.parameters()]).all()
        flag = finite.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag)


class FSDP(DDP):
    def wrap(self, model):
        from torch.distributed.fsdp import fully_shard

        for sublayer in model.sublayers:
            fully_shard(sublayer)
        fully_shard(model)
        return model

    def gradient_sync(self, last_micro_batch):
        return nullcontext()  # reduce-scatter every micro-batch: sharded gradients, least memory

    def grad_norm_per_block(self, model):
        """model.grad_norm_per_block over sharded gradients: squares summed per shard, then over ranks."""
        layers = model.config.layers
        sq = torch.zeros(layers, dtype=torch.float64, device=self.spec.device)
        for b in range(layers):
            for sub in model.sublayers[2 * b : 2 * b + 2]:
                for p in sub.parameters():
                    if p.grad is not None:
                        sq[b] += _local(p.grad).detach().double().pow(2).sum()
        dist.all_reduce(sq)
        return sq.sqrt().tolist()

    def clip_grad_norm(self, model, max_norm):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def state(self, model, optimizer):
        """Full (unsharded) CPU states on rank 0, empty dicts elsewhere (a collective: all ranks call),
        the optimizer's in torch's per-index layout: one checkpoint file whatever the mode and world."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
        return model_state, _by_index(optimizer_state, _parameter_names(model, optimizer))

    def load_state(self, model, optimizer, model_state, optimizer_state):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=options)
        named = _by_name(optimizer_state, _parameter_names(model, optimizer))
        set_optimizer_state_dict(model, optimizer, named, options=options)

    def plain_model(self, model):
        """A plain DecoderLM on rank 0's CPU with the gathered weights (a collective: all ranks call)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        from attnres import DecoderLM

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        plain = DecoderLM(model.config, model.residual_config)
        plain.load_state_dict(state)
        return plain


# -- helpers ---------------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _parameter_names(model: torch.nn.Module, optimizer) -> list[str]:
    """The optimizer's parameters in its own order (group by group), by fully qualified name."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _by_index(named: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (torch.distributed.checkpoint) -> keyed by index,
    as optimizer.state_dict() writes it. Empty stays empty (ranks other than 0)."""
    if not named:
        return {}
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in named["state"].items()},
        "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in named["param_groups"]],
    }


def _by_name(indexed: dict[str, Any], order: list[str]) -> dict[str, Any]:
    return {
        "state": {order[int(i)]: value for i, value in indexed["state"].items()},
        "param_groups": [dict(g, params=[order[int(i)] for i in g["params"]]) for g in indexed["param_groups"]],
    }
