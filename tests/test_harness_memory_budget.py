"""The memory check before a CPU run (harness/memory_budget.py): its estimate against the
allocator's measured peak, the refusal line and its suggestion, what it reads of the machine."""
import math

import pytest
import torch

from benchmarks.model_bench import cpu_peak_bytes
from harness import job, memory_budget
from harness.config import validate
from harness_testing import TINY, compose, isolated, restore_process_state, runs  # noqa: F401  (a fixture)

from attnres import DecoderLM


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
