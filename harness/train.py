"""The training loop: gradient accumulation to a fixed global batch, schedule, clipping,
validation, instrumentation, checkpoints and metrics.

Steps are optimizer steps. A run is resumable by construction (batches a function of (seed, i),
the learning rate of the step), so a resumed CPU run is bit-identical. The loop reaches the
outside only through the tracker, `harness.pruning`, the run folder and its data-parallel
strategy (`self.parallel`); it never imports MLflow or Hydra.
"""
from __future__ import annotations

import logging
import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from attnres import DecoderLM
from harness import distributed, dynamics, pruning
from harness.config import RunSpec, rank, to_plain
from harness.data import MultiHopProbe, TokenData, val_batches
from harness.data.multihop import answers_only
from harness.optim import build_optimizer, lr_multiplier, set_lr

log = logging.getLogger(__name__)


class NonFiniteLoss(FloatingPointError):
    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step

    def __reduce__(self):
        # a failed job's exception crosses processes pickled, and its args hold the message only
        return (type(self), (str(self), self.step))


class StopRequested(Exception):
    """Training stopped early on request (after a checkpoint), e.g. by a SIGTERM handler."""


RESUME_HINT = "; rerun to resume"  # ends a StopRequested's message (not so in an Optuna trial: job.py)


def _due(step: int, interval: int, total: int) -> bool:
    return step == total or (interval > 0 and step % interval == 0)


def rng_state(cuda: bool = True) -> dict[str, Any]:
    """Every generator's state, as tensors and tuples of ints only: the checkpoint then loads with
    torch.load(weights_only=True) (no pickled code runs, here or in attnres.load). cuda=False
    (under torchrun) leaves out the CUDA generators: reading every device's would open a context
    on each GPU of the node from each rank, and training draws nothing from them."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
    }
    if cuda and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], cuda: bool = True) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if cuda and "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class LogWindow:
    """The steps since the last log, which train/loss and train/grad_norm average, and the steps
    timed in this attempt, which tokens/s counts."""

    loss: float
    norm: torch.Tensor  # summed on the device and read at log time only: no extra sync
    steps: int
    seconds: float = 0.0
    timed_steps: int = 0

    @classmethod
    def resumed(cls, kept: tuple[float, float, int], device: torch.device) -> LogWindow:
        loss, norm, steps = kept
        return cls(loss, torch.full((), norm, device=device), steps)

    def add(self, loss: float, norm: torch.Tensor, seconds: float) -> None:
        self.seconds += seconds
        self.timed_steps += 1
        self.loss += loss
        self.norm += norm.detach()
        self.steps += 1

    def clear(self) -> None:
        self.loss, self.steps, self.seconds, self.timed_steps = 0.0, 0, 0.0, 0
        self.norm.zero_()

    def kept(self) -> tuple[float, float, int]:
        """What a checkpoint keeps, so that a run resumed between two logs reports the same mean."""
        return (self.loss, float(self.norm), self.steps)


@dataclass
class StepEnd:
    """An optimizer step just taken, as the callbacks after it see it."""

    lr: float
    loss: float  # the step's training loss (mean over micro-batches and ranks)
    dynamics_due: bool
    grad_norms: list[float] | None  # per block, before clipping, where dynamics_due
    tokens: int  # trained on so far
    window: LogWindow
    bar: Any  # the progress bar
    stop: bool = False  # set by Trainer._agree_on_stop


class Trainer:
    """One run's model, optimizer and loop: fit() takes the steps, after_step's callbacks the rest."""

    def __init__(self, spec: RunSpec, data: TokenData, tracker, folder=None, label: str = "run"):
        self.spec, self.cfg, self.tracker, self.folder, self.label = spec, spec.cfg, tracker, folder, label
        self.plain_config = to_plain(spec.cfg)
        t = self.cfg.train
        self.device = spec.device
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 for what autocast leaves in fp32
        torch.manual_seed(t.seed)  # model init is a function of the seed alone (the same on every rank)
        self.parallel = distributed.strategy(spec)
        self.model = DecoderLM(self.cfg.model, self.cfg.residual).to(self.device)
        wrapped = self.parallel.wrap(self.model)  # FSDP shards self.model in place
        self.forward = torch.compile(wrapped) if spec.compile else wrapped
        self.optimizer = build_optimizer(self.model, self.cfg.optim)  # after wrap: FSDP's parameters
        self.data = data
        # each rank evaluates its share of the single-process held-out set: the all-reduce gives its loss
        held_out = val_batches(data.val, spec.data_micro_batch_size, t.seq_len, t.eval_batches)
        # data.loss_on=answers: train and validate on the probe's answer digits only
        compact = self.cfg.data.format == "compact"
        self.targets = ((lambda x, y: answers_only(x, y, compact)) if self.cfg.data.loss_on == "answers"
                        else (lambda x, y: y))
        held_out = [(x, self.targets(x, y)) for x, y in held_out]
        self.val = [(x.to(self.device), y.to(self.device), n) for x, y, n in self.parallel.val_shard(held_out)]
        self.instrument_x = held_out[0][0][: t.instrument_seqs].to(self.device) if held_out else None
        self.probe = MultiHopProbe.from_config(self.cfg.data) if self.cfg.data.name == "multihop" else None
        # the level to beat beside each accuracy: fixed by the held-out prompts, so computed once
        self.copy_levels = ({f"probe/copy_hop_{k}": v for k, v in self.probe.copy_accuracy().items()}
                            if self.probe is not None else {})
        self.flops_per_token = spec.counts["count.flops_per_token"]
        # progress
        self.step = 0
        self.best_val = math.inf
        self.last_val = math.nan
        self.elapsed = 0.0  # seconds in the loop, summed over attempts (resumes)
        self.history: list[dynamics.Record] = []
        self._stop_requested = False
        self.stop_reason = "on request"  # set by request_stop: what the job reports
        self.checkpoint_failures = 0
        # LogWindow.kept(), checkpointed: a run resumed between two logs reports the same means
        self.log_window = (0.0, 0.0, 0)
        self._started = 0.0  # perf_counter() at step 0 of this run, counting earlier attempts
        self.after_step: list[Callable[[StepEnd], None]] = [
            self._log_training, self._record_dynamics, self._validate_when_due, self._agree_on_stop,
            self._checkpoint_when_due]

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = self.parallel.state(self.model, self.optimizer)  # FSDP: a collective
        return {
            "config": self.plain_config,  # what attnres.load needs to rebuild the model
            "model": model_state,
            "optimizer": optimizer_state,
            "step": self.step,
            # the data position, in single-process micro-batches whatever the world size
            "micro_batches": self.step * (self.cfg.train.batch_size // self.spec.data_micro_batch_size),
            "best_val": self.best_val,
            "last_val": self.last_val,
            "elapsed": self.elapsed,
            "history": self.history,
            "log_window": self.log_window,
            "rng": rng_state(cuda=self.spec.parallel is None),
            "mlflow_run_id": self.tracker.run_id,  # also in run.json, which exists before step 1
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.parallel.load_state(self.model, self.optimizer, state["model"], state["optimizer"])
        self.step, self.best_val, self.last_val = state["step"], state["best_val"], state["last_val"]
        self.elapsed, self.history = state["elapsed"], list(state["history"])
        self.log_window = tuple(state["log_window"])
        set_rng_state(state["rng"], cuda=self.spec.parallel is None)

    def export_model(self) -> torch.nn.Module | None:
        """The model to save or log: the trained module itself, or under FSDP its gathered copy on
        rank 0 (None on the others). Under FSDP every rank must call it."""
        return self.parallel.plain_model(self.model)

    def request_stop(self, reason: str = "on request") -> None:
        """Stop after the current step, with a checkpoint (safe to call from a signal handler);
        reason (the signal's name) is what the job reports."""
        self.stop_reason = reason
        self._stop_requested = True

    # -- pieces -----------------------------------------------------------------------------------
    def _autocast(self):
        dtype = self.spec.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else nullcontext()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = 0.0
        count = 0
        with self._autocast():
            for x, y, n in self.val:  # n: sequences counted (0 for a rank's padding batch)
                _, loss = self.forward(x, y)
                total += float(loss) * n
                count += n
        self.model.train()
        total, count = self.parallel.sums(total, count)
        return total / count

    def _checkpoint(self) -> None:
        """Write last.pt. A write that fails (full disk, quota, a lost network mount) does not stop
        training: the previous checkpoint is intact (atomic write), the failure is logged and
        tagged (attnres.checkpoint_error, attnres.checkpoint_failures), and the next interval tries
        again. Losing an hour of compute to a transient disk problem is worse than training on with
        an older checkpoint; a disk that stays full shows up in the tags of every run it hits."""
        if self.folder is None:
            return
        # a finite loss can still overflow the weights: never over the last good checkpoint (every rank checks)
        if not self.parallel.all_finite(self.model):
            raise NonFiniteLoss(f"non-finite weights after step {self.step} (the update diverged); "
                                "checkpoint not written, the previous one is kept", self.step)
        self.tracker.flush()  # every step up to the checkpoint is in MLflow before it exists
        state = self.state_dict()
        try:
            self.folder.save(state)
        except OSError as error:
            self.checkpoint_failures += 1
            message = f"checkpoint at step {self.step} not written ({error}); the previous one is kept"
            log.warning("%s: %s; retrying at the next interval", self.label, message)
            self.tracker.set_tags({"attnres.checkpoint_error": message[:5000],
                                   "attnres.checkpoint_failures": self.checkpoint_failures})

    def _validate(self, tokens: int) -> None:
        loss = self.evaluate()
        self.last_val = loss
        metrics = {"val/loss": loss}
        if self.probe is not None:
            for k, acc in self.probe.accuracy(self.model, self.device).items():
                metrics[f"probe/acc_hop_{k}"] = acc
            metrics.update(self.copy_levels)
        self.tracker.log_metrics(metrics, self.step)
        self.tracker.log_metrics({"val/loss_by_tokens": loss}, tokens)
        if not math.isfinite(loss):
            raise NonFiniteLoss(f"non-finite validation loss ({loss}) at step {self.step}", self.step)
        self.best_val = min(self.best_val, loss)
        pruning.report(self.step, loss)  # raises pruning.TrialPruned when a sweep says stop

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train from self.step to spec.steps; the final metrics. A stop request ends it after the
        current step, with a checkpoint (StopRequested)."""
        total = self.spec.steps
        self._stop_before_training()
        batches = self.parallel.train_batches(self.data.train, self.step)  # this rank's micro-batches
        bar = tqdm(total=total, initial=self.step, desc=self.label, unit="step", dynamic_ncols=True,
                   disable=not self.cfg.train.progress or rank() != 0, leave=False)
        window = LogWindow.resumed(self.log_window, self.device)
        self._started = time.perf_counter() - self.elapsed
        self.model.train()
        try:
            while self.step < total:
                end = self._train_step(batches, window, bar)
                for callback in self.after_step:  # metrics, dynamics, validation, stop, checkpoint
                    callback(end)
                bar.update(1)
                if end.stop:
                    raise StopRequested(f"stopped at step {self.step} of {total}" + RESUME_HINT)
        finally:
            bar.close()
        return self.final_metrics()

    def _stop_before_training(self) -> None:
        """A stop asked for while the checkpoint loaded or the MLflow run opened: what is on disk
        is this step's state already, and a first step (a compile) could outlast the grace period.
        Every rank takes part, so none enters a step the others skip."""
        if self.parallel.sums(float(self._stop_requested))[0] > 0:
            raise StopRequested(f"stopped at step {self.step} of {self.spec.steps} before training" + RESUME_HINT)

    def _train_step(self, batches, window: LogWindow, bar) -> StepEnd:
        """One optimizer step: the gradients of a global batch, clipped, applied."""
        total = self.spec.steps
        tic = time.perf_counter()
        lr = set_lr(self.optimizer, lr_multiplier(self.cfg.schedule, self.step, total))
        step_loss = self._gradients(batches)
        dynamics_due = _due(self.step + 1, self.cfg.train.instrument_interval, total)
        grad_norms = self.parallel.grad_norm_per_block(self.model) if dynamics_due else None
        clip = self.cfg.optim.grad_clip
        norm = self.parallel.clip_grad_norm(self.model, clip if clip > 0 else math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        window.add(step_loss, norm, time.perf_counter() - tic)
        return StepEnd(lr, step_loss, dynamics_due, grad_norms, self.step * self.spec.tokens_per_step, window, bar)

    def _gradients(self, batches) -> float:
        """Forward and backward over the step's micro-batches; the step's training loss."""
        accum = self.spec.accum_steps
        loss_sum = torch.zeros((), device=self.device)
        for i in range(accum):
            x, y = next(batches)
            y = self.targets(x, y)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self.parallel.gradient_sync(last_micro_batch=i == accum - 1):  # DDP: once per step
                with self._autocast():
                    _, loss = self.forward(x, y)
                (loss / accum).backward()
            loss_sum += loss.detach()
        # the step's one sync: under torchrun the mean over ranks, who agree on a stop request in it
        step_loss = self.parallel.step_loss(loss_sum, accum, self._stop_requested)
        if not math.isfinite(step_loss):
            raise NonFiniteLoss(f"non-finite training loss ({step_loss}) at step {self.step + 1}", self.step + 1)
        return step_loss

    # -- after each step, in order (self.after_step) ----------------------------------------------
    def _log_training(self, end: StepEnd) -> None:
        if not _due(self.step, self.cfg.train.log_interval, self.spec.steps):
            return
        window = end.window
        tok_s = window.timed_steps * self.spec.tokens_per_step / max(window.seconds, 1e-9)
        self.tracker.log_metrics({
            "train/loss": window.loss / window.steps,
            "train/lr": end.lr,
            "train/grad_norm": float(window.norm) / window.steps,
            "train/tokens": end.tokens,
            "train/flops": end.tokens * self.flops_per_token,
            "train/tokens_per_s": tok_s,
        }, self.step)
        end.bar.set_postfix(loss=f"{window.loss / window.steps:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
        window.clear()

    def _record_dynamics(self, end: StepEnd) -> None:
        if not end.dynamics_due:
            return
        rec = dynamics.record(self.model, self.instrument_x, self.step, end.grad_norms)
        self.history.append(rec)
        self.tracker.log_metrics(dynamics.metrics(rec), self.step)
        self.tracker.log_dict(rec, dynamics.artifact_name(self.step))

    def _validate_when_due(self, end: StepEnd) -> None:
        if _due(self.step, self.cfg.train.eval_interval, self.spec.steps):
            self._validate(end.tokens)
            end.bar.set_postfix(loss=f"{end.loss:.4f}", val=f"{self.last_val:.4f}", refresh=False)

    def _agree_on_stop(self, end: StepEnd) -> None:
        self.elapsed = time.perf_counter() - self._started
        end.stop = self.parallel.stop_now(self._stop_requested)  # the same on every rank

    def _checkpoint_when_due(self, end: StepEnd) -> None:
        if _due(self.step, self.cfg.train.checkpoint_interval, self.spec.steps) or end.stop:
            self.log_window = end.window.kept()
            self._checkpoint()

    def final_metrics(self) -> dict[str, float]:
        tokens = self.step * self.spec.tokens_per_step
        return {
            "final/val_loss": self.last_val,
            "final/val_loss_best": self.best_val,
            "final/tokens": tokens,
            "final/flops": tokens * self.flops_per_token,
            "final/train_seconds": self.elapsed,
        }
