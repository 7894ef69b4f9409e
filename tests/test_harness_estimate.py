"""`python -m harness.estimate`: a sweep's jobs are the multirun's, their FLOPs the model's own.

The expected numbers are computed here without Hydra or harness.config: the model is built from
attnres with the shapes read from conf/ and the sweep's grid read from sweeps/*.yaml. FLOPs are
Python ints, so sums compare exactly.
"""
import json
import math
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from attnres import DecoderLM, ModelConfig, ResidualConfig
from harness.estimate import expand, gpu_hours, main, pflops_days, probe
from harness_testing import ROOT

SHORT = "train.tokens=20000"  # 10 steps of 16 × 128 tokens: the CPU defaults


def expected_flops(variant: str, layers: int = 16, tokens: int = 20000) -> int:
    """steps × tokens per step × DecoderLM.flops_per_token of the CPU ablation's model."""
    model = OmegaConf.load(ROOT / "conf" / "model" / "default.yaml").model
    train = OmegaConf.load(ROOT / "conf" / "train" / "default.yaml")
    residual = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "residual" / f"{variant}.yaml"))
    with torch.device("meta"):
        lm = DecoderLM(
            ModelConfig(vocab_size=256, d_model=model.d_model, layers=layers, n_heads=model.n_heads,
                        d_ff=model.d_ff, max_seq_len=train.seq_len),
            ResidualConfig(**residual),
        )
    tokens_per_step = train.batch_size * train.seq_len
    steps = math.ceil(tokens / tokens_per_step)
    return steps * tokens_per_step * lm.flops_per_token(train.seq_len)["total"]


def test_jobs_are_the_grid_product_and_their_flops_the_models_own():
    jobs = expand(["+sweep=ablation", "residual=baseline,block,full", "train.seed=0,1", SHORT])
    assert len(jobs) == 3 * 2
    assert sorted(j.label for j in jobs) == sorted(
        f"residual={v} train.seed={s}" for v in ("baseline", "block", "full") for s in (0, 1))
    for job in jobs:
        assert job.train_flops == expected_flops(job.variant), job.label
        assert job.steps == 10 and job.tokens_per_step == 16 * 128 and job.trials == 1
    assert sum(j.total_flops for j in jobs) == 2 * sum(expected_flops(v) for v in ("baseline", "block", "full"))
    # the variants differ only in the residual's mixing: Full reads more than Block than none
    by_variant = {j.variant: j.flops_per_token for j in jobs}
    assert by_variant["baseline"] < by_variant["block"] < by_variant["full"]


def test_a_job_that_repeats_an_earlier_run_costs_nothing():
    """`residual=baseline,block residual.block_size=2,4`: the baseline does not read block_size, so
    its second job is its first job's run again (run.py returns the recorded result)."""
    jobs = expand(["+sweep=ablation", "residual=baseline,block", "residual.block_size=2,4", "train.seed=0", SHORT])
    assert [(j.variant, j.trials) for j in jobs] == [("baseline", 1), ("baseline", 0), ("block", 1), ("block", 1)]
    assert jobs[1].label.endswith("(= job 0)") and jobs[1].total_flops == 0
    # the baseline's labels leave out the knob it does not read; block's keep it
    assert [j.label for j in jobs] == ["residual=baseline", "residual=baseline (= job 0)",
                                       "residual=block residual.block_size=2", "residual=block residual.block_size=4"]
    assert jobs[2].train_flops != jobs[3].train_flops  # block reads it: two models


def test_the_whole_sweep_file_is_expanded_as_its_comma_lists_multiply():
    params = OmegaConf.load(ROOT / "sweeps" / "ablation.yaml").hydra.sweeper.params
    product = math.prod(len(str(v).split(",")) for v in params.values())
    jobs = expand(["+sweep=ablation", SHORT])
    assert len(jobs) == product
    seeds = len(str(params["train.seed"]).split(","))
    assert sum(j.total_flops for j in jobs) == seeds * sum(
        expected_flops(v) for v in str(params.residual).split(","))


def test_an_optuna_study_counts_its_trials_at_the_costliest_corner_of_the_space():
    jobs = expand(["+sweep=lr", "residual=block,full", "hydra.sweeper.n_trials=3",
                   "model.layers=choice(2,4)", SHORT])
    assert [j.label for j in jobs] == ["residual=block", "residual=full"]
    for job in jobs:
        assert job.trials == 3 and job.upper_bound
        # the searched depth changes the FLOPs: the bound is the deeper model's
        assert job.train_flops == expected_flops(job.variant, layers=4) > expected_flops(job.variant, layers=2)
        assert job.total_flops == 3 * job.train_flops


def test_gpu_hours_and_pflops_days_on_hand_computed_numbers():
    # one hour of 40% of 989 TFLOP/s: 989e12 × 0.4 × 3600 = 1.42416e18 FLOPs
    assert gpu_hours(1.42416e18) == pytest.approx(1.0, rel=1e-12)
    # 1e21 FLOPs at 50% of 1000 TFLOP/s: 1e21 / 5e14 = 2e6 s = 555.5 h
    assert gpu_hours(1e21, peak_tflops=1000, mfu=0.5) == pytest.approx(2e6 / 3600, rel=1e-12)
    assert pflops_days(8.64e19) == pytest.approx(1.0, rel=1e-12)  # 1e15 FLOP/s × 86400 s


def test_the_command_prints_the_jobs_and_writes_consistent_json(tmp_path):
    out = tmp_path / "cost.json"
    result = subprocess.run(
        [sys.executable, "-m", "harness.estimate", "-m", "+sweep=ablation", "residual=block,full",
         "train.seed=0", SHORT, "--peak-tflops", "100", "--mfu", "0.5", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "| residual=block " in result.stdout and "2 jobs," in result.stdout
    doc = json.loads(out.read_text())
    totals = doc["totals"]
    assert totals["jobs"] == 2 and not totals["upper_bound"]
    assert totals["train_flops"] == expected_flops("block") + expected_flops("full")
    assert totals["train_flops"] == sum(j["total_flops"] for j in doc["jobs"])
    assert totals["gpu_hours"] == pytest.approx(totals["train_flops"] / (100e12 * 0.5) / 3600, rel=1e-12)


@pytest.mark.parametrize("argv,message", [
    (["--mfu", "1.5"], "--mfu=1.5 must lie in (0, 1]"),
    (["--mfu", "x"], "argument --mfu: invalid float value: 'x'"),
    (["--peak-tflops", "0"], "--peak-tflops=0.0 must be a positive number"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["train.seq_len=abc"], "train.seq_len=abc"),
    (["+sweep=ablation", "residual=baseline,nope"], "residual=nope"),
    (["+sweep=ablation", "residual=baseline,block", "model.n_heads=3", SHORT], "job 0 (residual=baseline"),
    (["+sweep=ablation", "optim.lr=interval(1e-4,1e-2)"], "does not support sweep type"),  # needs Optuna
    (["hydra/sweeper=nope"], "nope"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        sys.exit(main(argv))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err


# -- wall time on this machine: --probe and --recorded -----------------------------------------
TINY = ["model.layers=2", "train.batch_size=4", "train.seq_len=32", "train.tokens=1280", "train.threads=1"]


def test_the_probe_times_real_steps_of_each_distinct_model_once():
    jobs = expand(["+sweep=ablation", "residual=baseline,block", "train.seed=0,1", *TINY])
    lines = []
    probe(jobs, steps=1, log=lines.append)
    assert len(jobs) == 4 and len(lines) == 2  # the seeds share a model: one probe per variant
    assert {j.variant for j in jobs} == {"baseline", "block"}
    for job in jobs:
        assert math.isfinite(job.tokens_per_s) and job.tokens_per_s > 0
        assert job.wall_hours == pytest.approx(job.trials * job.steps * 4 * 32 / job.tokens_per_s / 3600, rel=1e-12)
    same = {j.variant: j.tokens_per_s for j in jobs if j.label.endswith("train.seed=0")}
    assert all(j.tokens_per_s == same[j.variant] for j in jobs)


def test_the_probes_tokens_per_s_is_timed_steps_over_their_time(monkeypatch):
    """steps × micro-batch × accumulation × seq_len tokens over the timed span, the untimed first step left out."""
    import harness.estimate as estimate

    (job,) = expand([*TINY, "train.micro_batch_size=2"])  # 2 micro-batches per step
    steps_run = []
    real_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: (steps_run.append(1), real_step(self, *a, **k))[1])
    clock = iter([100.0, 102.5])  # tic, toc
    monkeypatch.setattr(estimate.time, "perf_counter", lambda: next(clock))
    tokens_per_s = estimate.probe_tokens_per_s(job.spec, steps=5)
    assert len(steps_run) == 6  # one untimed, five timed optimizer steps
    assert tokens_per_s == 5 * 4 * 32 / 2.5


def recorded_run(uri, tokens_per_s, flops_per_token="1000"):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("speed")).info.run_id
    if flops_per_token is not None:
        client.log_param(run, "count.flops_per_token", flops_per_token)
    for step, value in enumerate(tokens_per_s, 1):
        client.log_metric(run, "train/tokens_per_s", value, step=step)
    client.set_terminated(run)
    return run


def test_recorded_speed_gives_each_job_its_wall_time(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = recorded_run(uri, [90.0, 100.0, 130.0])  # median 100 tokens/s × 1000 FLOPs/token = 1e5 FLOP/s
    out = tmp_path / "cost.json"
    argv = ["+sweep=ablation", "residual=block,full", "train.seed=0", SHORT, "--recorded", run, "--tracking-uri", uri,
            "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "wall-h" in printed and "hours of training steps on this machine" in printed
    doc = json.loads(out.read_text())
    for job in doc["jobs"]:
        assert job["tokens_per_s"] == pytest.approx(1e5 / job["flops_per_token"], rel=1e-12)
        assert job["wall_hours"] == pytest.approx(job["total_flops"] / 1e5 / 3600, rel=1e-12)
    assert doc["totals"]["wall_hours"] == pytest.approx(doc["totals"]["train_flops"] / 1e5 / 3600, rel=1e-12)


def test_without_a_measured_speed_there_is_no_wall_time(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert main(["+sweep=ablation", "residual=block", "train.seed=0", SHORT, "--json", str(out)]) == 0
    assert "wall-h" not in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["totals"]["wall_hours"] is None and doc["jobs"][0]["wall_hours"] is None


@pytest.mark.parametrize("case", ["no store", "no run", "no speed", "no flops", "both"])
def test_a_speed_that_cannot_be_had_is_one_line_and_exit_2(case, tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = ["+sweep=ablation", "residual=block", "train.seed=0", SHORT, "--tracking-uri", uri]
    if case == "no store":
        argv += ["--recorded", "0" * 32, "--tracking-uri", f"sqlite:///{tmp_path / 'nothing.db'}"]
    elif case == "no run":
        recorded_run(uri, [100.0])
        argv += ["--recorded", "0" * 32]
    elif case == "no speed":
        argv += ["--recorded", recorded_run(uri, [])]
    elif case == "no flops":
        argv += ["--recorded", recorded_run(uri, [100.0], flops_per_token=None)]
    else:
        argv += ["--recorded", "0" * 32, "--probe"]
    capsys.readouterr()  # MLflow's own lines while the test made its store
    with pytest.raises(SystemExit) as stop:
        sys.exit(main(argv))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert ("--probe" in err) if case == "both" else ("--recorded" in err)
    assert not (tmp_path / "nothing.db").exists()  # nothing created where nothing was
