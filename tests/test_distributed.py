"""Data-parallel training under torchrun (harness/distributed.py, docs/DISTRIBUTED.md).

The end-to-end check is real: `torchrun --standalone --nproc_per_node=2 run.py` with the gloo
backend on the CPU, against `python run.py` with the same global batch. fp32 throughout; the two
differ only in floating-point summation order (gradients and losses summed over ranks), so the
train loss at the last step and the validation loss agree to 1e-5 absolute (measured: ~1e-6).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness_testing import ROOT, TINY, client, compose, kill_at_step, run_cli, runs, pythonpath_with_tests

TORCHRUN = shutil.which("torchrun")
STEPS = 10
# Global batch 8 in micro-batches of 2: one process accumulates 4, each of two ranks 2.
ARGS = [*TINY, f"train.steps={STEPS}", "train.batch_size=8", "train.micro_batch_size=2", "train.eval_interval=5",
        "train.eval_batches=3", "train.checkpoint_interval=5", "train.instrument_interval=5", "train.precision=fp32",
        "tracking.log_code=false", "tracking.log_env=false", "tracking.log_plots=false", "tracking.log_model=false"]
TOLERANCE = 1e-5  # absolute, fp32


def _torchrun(args: list[str], tmp: Path, nproc: int = 2, env: dict | None = None, **popen) -> subprocess.Popen:
    """torchrun in `tmp` (Hydra's outputs/ land there: no hydra.run.dir, the ranks agree on it), its
    temporary folder there too: torchelastic leaves a log folder behind in it every run."""
    (tmp / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, MPLBACKEND="Agg", HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1", TMPDIR=str(tmp / "tmp"), **(env or {}))
    env.pop("MLFLOW_TRACKING_URI", None)
    command = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(ROOT / "run.py"), *args,
               f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}", f"train.checkpoint_dir={tmp / 'ckpt'}"]
    return subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)


def _finish(proc: subprocess.Popen, timeout: int = 240) -> tuple[int, str]:
    _, stderr = proc.communicate(timeout=timeout)
    return proc.returncode, stderr


def _metric(tmp: Path, key: str) -> dict[int, float]:
    (run,) = runs(tmp)
    return {m.step: m.value for m in client(tmp).get_metric_history(run.info.run_id, key)}


def _with_env(monkeypatch, **env: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)


TWO_RANKS = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


# -- unit level ------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch, stream, world, micro", [
    (8, 2, 2, 2),    # whole stream batches per rank
    (8, 8, 2, 4),    # one stream batch split between ranks
    (24, 6, 4, 3),   # a rank's slice inside a stream batch
    (12, 4, 3, 2),   # slices straddling stream batches
    (8, 2, 8, 1),    # one sequence per rank
])
@pytest.mark.parametrize("aligned", [False, True])
def test_the_ranks_micro_batches_make_up_the_single_process_global_batch(batch, stream, world, micro, aligned):
    from harness.data.batches import batch_iterator, rank_batch_iterator

    tokens = torch.arange(5000) % 251
    per_step = batch // stream
    single = batch_iterator(tokens, stream, 16, seed=3, start_batch=2 * per_step, aligned=aligned)  # from step 2 on
    ranks = [rank_batch_iterator(tokens, batch, stream, micro, 16, 3, r, world, start_step=2, aligned=aligned)
             for r in range(world)]
    for _ in range(3):  # steps 2, 3, 4
        xs, ys = zip(*[next(single) for _ in range(per_step)])
        parts = [next(it) for it in ranks for _ in range(batch // world // micro)]
        assert all(x.shape == (micro, 16) for x, _ in parts)
        assert torch.equal(torch.cat([x for x, _ in parts]), torch.cat(xs))
        assert torch.equal(torch.cat([y for _, y in parts]), torch.cat(ys))


def test_gradient_accumulation_divides_the_global_batch_by_the_world_size(monkeypatch):
    from harness.config import ParallelMode, validate

    one = validate(compose([*TINY, "train.batch_size=16", "train.micro_batch_size=4"]))
    assert (one.parallel, one.world_size, one.micro_batch_size, one.accum_steps) == (None, 1, 4, 4)
    _with_env(monkeypatch, **TWO_RANKS)
    two = validate(compose([*TINY, "train.batch_size=16", "train.micro_batch_size=4"]))
    assert (two.parallel, two.world_size, two.micro_batch_size, two.accum_steps) == (ParallelMode.ddp, 2, 4, 2)
    assert two.data_micro_batch_size == 4 and two.tokens_per_step == one.tokens_per_step  # the global batch
    whole = validate(compose([*TINY, "train.batch_size=16"]))  # no micro-batch: each rank takes its 8 at once
    assert (whole.micro_batch_size, whole.accum_steps, whole.data_micro_batch_size) == (8, 1, 16)
    fsdp = validate(compose([*TINY, "train.batch_size=16", "train.distributed=fsdp"]))
    assert fsdp.parallel is ParallelMode.fsdp


@pytest.mark.parametrize("env, overrides, message", [
    (dict(TWO_RANKS, WORLD_SIZE="3"), ["train.batch_size=16"],
     "train.batch_size=16 does not divide over WORLD_SIZE=3 processes"),
    (TWO_RANKS, ["train.batch_size=12", "train.micro_batch_size=4"],
     "train.micro_batch_size=4 must divide the per-process batch train.batch_size/WORLD_SIZE = 12/2 = 6"),
    (TWO_RANKS, ["train.distributed=fsdp", "optim=muon"], "train.distributed=fsdp with optim.name=muon"),
    ({}, ["train.distributed=ddp"], "train.distributed=ddp: the environment lacks RANK, WORLD_SIZE"),
])
def test_a_batch_or_mode_that_cannot_run_distributed_is_one_line(monkeypatch, env, overrides, message):
    from harness.config import ConfigError, validate

    _with_env(monkeypatch, **env)
    with pytest.raises(ConfigError) as error:
        validate(compose([*TINY, *overrides]))
    assert message in str(error.value) and "allowed" in str(error.value) and "\n" not in str(error.value)


def test_an_indivisible_batch_exits_2_with_one_line_before_any_process_group(tmp_path):
    env = dict(TWO_RANKS, WORLD_SIZE="3", MASTER_PORT="1")  # nothing listens on port 1: no group may be joined
    result = run_cli([*TINY, "train.batch_size=8"], tmp_path, env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert "train.batch_size=8 does not divide over WORLD_SIZE=3" in line
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_rank_other_than_0_opens_no_mlflow_run_and_writes_no_file(monkeypatch, tmp_path):
    from harness.checkpoint import RunFolder
    from harness.config import validate
    from harness.data import load_data
    from harness.job import Job, _open_tracker
    from harness.tracking import NullTracker
    from harness.train import Trainer

    _with_env(monkeypatch, RANK="1")
    spec = validate(compose([*TINY, f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]))
    data = load_data(spec.cfg.data, spec.cfg.train.seq_len)
    job = Job(spec, {}, data, RunFolder(tmp_path / "run", read_only=True), multirun=False, output_dir=None, overrides=[])
    tracker = _open_tracker(job, None, None)
    assert isinstance(tracker, NullTracker) and not (tmp_path / "mlflow.db").exists()

    (tmp_path / "run").mkdir()
    folder = RunFolder(tmp_path / "run", read_only=True)
    trainer = Trainer(spec, data, tracker, folder)
    trainer._checkpoint()  # what every rank runs at a checkpoint interval
    folder.write_record(status="running")
    assert list((tmp_path / "run").iterdir()) == []
    with pytest.raises(RuntimeError, match="read-only"):
        folder.acquire(fresh=False)


_GLOO_PEER_LOST = """
import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
from harness.distributed import lost_process
def work(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(9)  # as kill -9 / the OOM killer: no goodbye to the peer
    time.sleep(0.5)
    try:
        dist.all_reduce(t)
    except Exception as error:
        print("lost" if lost_process(error) else f"not recognised: {type(error).__name__}: {error}", flush=True)
    os._exit(0)
if __name__ == "__main__":
    mp.spawn(work, args=(int(sys.argv[1]),), nprocs=2, join=False)
    time.sleep(30)
"""


def test_a_collective_broken_by_a_killed_rank_is_recognised_as_a_lost_process(tmp_path):
    """A real gloo failure (the peer killed mid-launch), not a made-up message: what rank 0 sees
    must read as a lost process, which the job ends KILLED and resumable (next test)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "peer_lost.py"  # a file: spawned processes re-import the main module
    script.write_text(_GLOO_PEER_LOST)
    proc = subprocess.Popen([sys.executable, str(script), str(port)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    try:
        line = proc.stdout.readline().strip()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert line == "lost", line


def test_a_run_whose_peer_rank_died_is_interrupted_not_failed_and_resumes(tmp_path, monkeypatch, capsys):
    """Under torchrun a rank killed (OOM, node loss) breaks rank 0's next collective. That is an
    interruption, as kill -9 of the whole launch is: KILLED, run.json `interrupted`, exit 75, and
    the same command resumes it; not FAILED, which a rerun would refuse to train again."""
    import socket

    from harness import job
    from harness.train import Trainer
    from harness_testing import isolated, process_state_kept

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    # the distributed code path on one process (WORLD_SIZE=1, train.distributed=ddp)
    _with_env(monkeypatch, **dict(TWO_RANKS, WORLD_SIZE="1", MASTER_PORT=port))
    overrides = [*ARGS, "train.distributed=ddp", *(o for o in isolated(tmp_path) if not o.startswith("hydra."))]
    real_fit = Trainer.fit

    def peer_lost(self):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:41887")

    with process_state_kept():
        monkeypatch.setattr(Trainer, "fit", peer_lost)
        with pytest.raises(SystemExit) as stopped:
            job.run(compose(overrides))
        assert stopped.value.code == 75
        assert "a process of the launch was lost" in capsys.readouterr().err
        (run,) = runs(tmp_path)
        assert run.info.status == "KILLED"
        (record,) = (tmp_path / "ckpt").rglob("run.json")
        assert json.loads(record.read_text())["status"] == "interrupted"
        monkeypatch.setattr(Trainer, "fit", real_fit)
        job.run(compose(overrides))  # the rerun trains it (a failed run would be refused)
    (run,) = runs(tmp_path)
    assert run.info.status == "FINISHED"


# -- end to end: torchrun ------------------------------------------------------------------------
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun (installed with torch) is not on PATH")
def test_two_ranks_compute_what_one_process_computes_and_only_rank_0_writes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    two.mkdir()
    started = _torchrun(ARGS, two)
    single = run_cli(ARGS, one)  # meanwhile: the same global batch on one process
    assert single.returncode == 0, single.stderr[-3000:]
    code, stderr = _finish(started)
    assert code == 0, stderr[-5000:]

    for key in ("train/loss", "val/loss"):
        a, b = _metric(one, key), _metric(two, key)
        assert sorted(a) == sorted(b), key
        assert abs(a[STEPS] - b[STEPS]) < TOLERANCE, (key, a[STEPS], b[STEPS])
    (run,) = runs(two)  # rank 1 opened no MLflow run
    assert run.data.params["train.world_size"] == "2" and run.data.params["train.accum_steps"] == "2"
    assert abs(run.data.metrics["final/val_loss"] - runs(one)[0].data.metrics["final/val_loss"]) < TOLERANCE

    (folder,) = [p.parent for p in (two / "ckpt").rglob("run.json")]  # one run folder, rank 0's
    record = json.loads((folder / "run.json").read_text())
    assert record["status"] == "finished" and record["mlflow_run_id"] == run.info.run_id
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "last.pt", "previous.pt", "run.json"]
    assert torch.load(folder / "last.pt", weights_only=True)["step"] == STEPS

    (output,) = [p for p in (two / "outputs").glob("*/*/*")]  # one Hydra folder for both ranks
    assert sorted(p.name for p in output.iterdir()) == [".hydra", "run.log", "run_rank1.log"]
    assert run.data.tags["attnres.hydra_output_dir"] == str(output)


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun (installed with torch) is not on PATH")
def test_multirun_under_torchrun_is_refused_with_one_line(tmp_path):
    code, stderr = _finish(_torchrun(["-m", "model=tiny", "residual=baseline,block"], tmp_path), timeout=120)
    assert code != 0
    lines = [l for l in stderr.splitlines() if l.startswith("error:")]
    assert lines and all("-m/--multirun under torchrun" in l for l in lines)
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun (installed with torch) is not on PATH")
def test_fsdp_computes_what_one_process_computes_and_resumes_under_ddp(tmp_path):
    """FSDP2 killed after its step-5 checkpoint, resumed by DDP: the checkpoint is one format."""
    one, two = tmp_path / "one", tmp_path / "two"
    two.mkdir()
    single = run_cli(ARGS, one)
    assert single.returncode == 0, single.stderr[-3000:]
    killed = _torchrun([*ARGS, "train.distributed=fsdp", *kill_at_step(7)], two, env=pythonpath_with_tests())
    code, stderr = _finish(killed)
    assert code != 0 and "exitcode  : 137" in stderr, stderr[-5000:]
    assert torch.load(next((two / "ckpt").rglob("last.pt")), weights_only=True)["step"] == 5
    code, stderr = _finish(_torchrun([*ARGS, "train.distributed=ddp"], two))
    assert code == 0, stderr[-5000:]
    (run,) = runs(two)
    assert run.data.tags["attnres.resumed_at_step"] == "5"
    a, b = _metric(one, "val/loss"), _metric(two, "val/loss")
    assert abs(a[STEPS] - b[STEPS]) < TOLERANCE and abs(_metric(one, "train/loss")[STEPS] - _metric(
        two, "train/loss")[STEPS]) < TOLERANCE


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun (installed with torch) is not on PATH")
def test_sigterm_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path):
    steps = 400
    args = [*ARGS, f"train.steps={steps}", "train.checkpoint_interval=100", "train.eval_interval=100",
            "train.instrument_interval=100"]
    proc = _torchrun(args, tmp_path, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "ckpt").rglob("run.json")):  # rank 0 opened the run: training starts
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to every rank
    started = time.monotonic()
    code, stderr = _finish(proc, timeout=120)
    assert code != 0  # torchrun's own status on its SIGTERM (the workers exit 75)
    assert time.monotonic() - started < 25, "a rank hung on the way out (torchrun kills it after 30 s)"
    stops = [l for l in stderr.splitlines() if "stopped at step" in l]
    assert len(stops) == 2 and len(set(stops)) == 1, stderr[-5000:]  # both ranks, the same step
    assert "Unable to shutdown" not in stderr
    step = int(stops[0].split("stopped at step ")[1].split()[0])
    assert 0 < step < steps
    folder = next((tmp_path / "ckpt").rglob("run.json")).parent
    assert json.loads((folder / "run.json").read_text())["status"] == "interrupted"
    assert torch.load(folder / "last.pt", weights_only=True)["step"] == step
    (run,) = runs(tmp_path)
    assert run.info.status == "KILLED" and max(_metric(tmp_path, "train/loss")) == step
