"""Memory (harness/memory_budget.py): the check before a CPU run (its estimate against the
allocator's measured peak, the refusal line and its suggestion, what it reads of the machine), and
the one line of a run that runs out of memory mid-run (CUDA's error; the CPU allocator's, for
real, under a process memory limit)."""
import math

import pytest
import torch

from attnres import DecoderLM
from benchmarks.model_bench import cpu_peak_bytes
from harness import job, memory_budget
from harness.config import validate
from harness_testing import TINY, compose, isolated, restore_process_state, runs  # noqa: F401  (a fixture)


@pytest.mark.parametrize("variant", ["baseline", "block", "full", "mhc"])
def test_the_estimate_refuses_no_step_that_fits_and_is_close_to_its_peak(variant):
    """Saved bytes per token from the 128-token probe, times a micro-batch of 4 × 256 tokens (the
    default model, fp32, CPU), against the allocator's peak of a real training step above the
    model and its optimizer state (the estimate's fixed part): never so high that MARGIN × it
    exceeds the peak (a refused run would have fitted), and at least 80% of it (measured: 87-94%;
    0.92-0.99 at 16 layers and 128-4096 tokens per sequence, benchmarks/RESULTS_HARNESS.md)."""
    spec = validate(compose([f"residual={variant}", "train.seq_len=256", "train.batch_size=4"]))
    estimate = memory_budget.saved_bytes_per_token(spec) * 4 * 256
    torch.manual_seed(0)
    model = DecoderLM(spec.cfg.model, spec.cfg.residual)
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, spec.cfg.model.vocab_size, (4, 256))

    def step():
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists before the measured step
    peak = cpu_peak_bytes(step)
    assert memory_budget.MARGIN * estimate <= peak and estimate >= 0.8 * peak, (estimate, peak)


def test_a_table_cached_for_the_longest_sequence_counts_as_the_slice_a_step_uses():
    """RoPE's tables are cached for model.max_seq_len (= train.seq_len) and a step saves its slice:
    counted whole, the table made one sequence of 100k tokens cost twice what it does."""
    per_token = [memory_budget.saved_bytes_per_token(validate(compose([f"train.seq_len={T}"]))) for T in (128, 100_000)]
    assert per_token[1] == per_token[0], per_token


def test_the_probe_leaves_the_random_state_as_it_was():
    spec = validate(compose(["model=tiny", "residual=block"]))
    before = torch.get_rng_state()
    memory_budget.saved_bytes_per_token(spec)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_run_that_cannot_fit_is_refused_with_the_micro_batch_that_fits(tmp_path, monkeypatch, capsys,
                                                                         restore_process_state):
    """With the memory available set between what a micro-batch of 2 and one of 4 sequences need,
    a batch of 8 is refused before anything is created, naming micro_batch_size=2; that run then
    trains, on the same machine."""
    overrides = [*TINY, "train.batch_size=8", *isolated(tmp_path)]
    spec = validate(compose(overrides))
    per_sequence = memory_budget.saved_bytes_per_token(spec) * spec.cfg.train.seq_len
    fixed = memory_budget.BYTES_PER_PARAMETER * spec.counts["count.params_total"]
    monkeypatch.setattr(memory_budget, "available_bytes", lambda: int(fixed + 3 * per_sequence))
    with pytest.raises(SystemExit) as exit_:
        job.run(compose(overrides))
    assert exit_.value.code == 2
    (line,) = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert line.startswith("error: train.batch_size=8, train.seq_len=32: one micro-batch of 8 × 32 tokens needs about")
    assert "allowed: train.micro_batch_size=2 (the batch stays 8 sequences" in line
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ckpt").exists()

    value = job.run(compose([*overrides, "train.micro_batch_size=2"]))
    assert math.isfinite(value) and runs(tmp_path)[0].data.params["train.micro_batch_size"] == "2"


def test_when_not_even_one_sequence_fits_a_shorter_sequence_is_named(monkeypatch):
    spec = validate(compose([*TINY, "train.batch_size=8"]))
    monkeypatch.setattr(memory_budget, "available_bytes", lambda: 1 << 20)
    monkeypatch.setattr(memory_budget, "saved_bytes_per_token", lambda spec: 64 * 1024.0)
    with pytest.raises(memory_budget.ConfigError, match=r"allowed: a shorter train.seq_len \(one sequence of at most ~\d+ tokens"):
        memory_budget.check_fits(spec)


def test_compiled_runs_are_not_probed(monkeypatch):
    """A compiled graph may keep fewer tensors than the eager probe counts: no check there."""
    spec = validate(compose([*TINY, "train.compile=true"]))
    monkeypatch.setattr(memory_budget, "available_bytes", lambda: 1)
    monkeypatch.setattr(memory_budget, "saved_bytes_per_token", lambda spec: pytest.fail("probed"))
    memory_budget.check_fits(spec)


def test_available_memory_is_the_machines_capped_by_its_cgroup(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\nSwapFree:        1000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    monkeypatch.setattr(memory_budget, "MEMINFO", meminfo)
    monkeypatch.setattr(memory_budget, "CGROUP", cgroup)
    assert memory_budget.available_bytes() == 21000000 * 1024  # no limit file: the machine's
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("5000\n")
    assert memory_budget.available_bytes() == 21000000 * 1024
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    assert memory_budget.available_bytes() == (8 << 30) - 5000
    meminfo.write_text("MemTotal: 1 kB\n")  # no MemAvailable (kernels before 3.14): unknown, no check
    assert memory_budget.available_bytes() is None


@pytest.mark.parametrize("raised", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.11 GiB total capacity)"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)"),
])
def test_running_out_of_memory_mid_run_is_one_line_with_a_smaller_micro_batch(raised, tmp_path, monkeypatch, capsys,
                                                                              restore_process_state):
    """An allocation that fails in a step (CUDA's OutOfMemoryError; the CPU allocator's under a
    process memory limit) ends the run FAILED with the error, and the command says so in one line
    naming half the micro-batch (a new run: the micro-batch is part of a run's identity)."""
    from harness.train import Trainer

    calls = []

    def fit(self):
        calls.append(1)
        self.step = 2
        raise raised

    monkeypatch.setattr(Trainer, "fit", fit)
    with pytest.raises(SystemExit) as exit_:
        job.run(compose([*TINY, "train.batch_size=8", *isolated(tmp_path)]))
    assert exit_.value.code == 1 and calls == [1]
    err = capsys.readouterr().err  # (with MLflow's own INFO lines on creating the store)
    (line,) = [l for l in err.splitlines() if "out of memory" in l]
    assert "Traceback" not in err and " out of memory at step 3 (" in line and str(raised).splitlines()[0][:60] in line
    assert "FAILED; allowed: train.micro_batch_size=4 (the batch stays 8 sequences" in line
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED" and type(raised).__name__ in run.data.tags["attnres.failure"]


def test_other_runtime_errors_are_not_taken_for_memory():
    assert not memory_budget.out_of_memory(RuntimeError("shape mismatch"))
    assert not memory_budget.out_of_memory(MemoryError())  # Python's own: not an allocation of a tensor


@pytest.mark.slow  # ~15-30 s: a process that fills 4 GB of address space
def test_a_real_allocation_failure_under_a_process_memory_limit_is_one_line(tmp_path):
    """End to end: `run.py` under a 4 GB address-space limit (`ulimit -v`), a micro-batch of
    16384 × 32 tokens (~3 GB kept for the backward: the memory check passes, the machine has it,
    the process may not take it). The CPU allocator fails in the first step: exit 1, one line with
    half the micro-batch, the MLflow run FAILED."""
    import os
    import resource
    import subprocess
    import sys

    from harness_testing import ROOT

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))

    args = [*TINY, "train.steps=2", "train.batch_size=16384", *isolated(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=180, preexec_fn=limit)
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = [l for l in result.stderr.splitlines() if "out of memory" in l]
    assert "DefaultCPUAllocator: can't allocate memory" in line and "Traceback" not in result.stderr
    assert "allowed: train.micro_batch_size=8192 (the batch stays 16384 sequences" in line
    (run,) = runs(tmp_path)
    assert run.info.status == "FAILED"


def test_a_model_too_large_for_its_weights_is_refused_without_being_built(tmp_path, monkeypatch, capsys):
    """model.d_model=100000: the parameters alone exceed any CPU's memory. The check answers from
    the meta device's count, not by building the model (which crashed the check itself)."""
    monkeypatch.setattr(memory_budget, "saved_bytes_per_token", lambda spec: pytest.fail("the model was built"))
    monkeypatch.setattr(memory_budget, "available_bytes", lambda: 64 << 30)
    with pytest.raises(SystemExit) as exit_:
        job.run(compose([*TINY, "model.d_model=100000", *isolated(tmp_path)]))
    assert exit_.value.code == 2
    (line,) = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert "model.d_model=100000" in line and "allowed: a smaller model" in line
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ckpt").exists()
