"""Pieces of the harness in-process: schedules, optimizers, checkpoints, failure and pruning paths."""
import math
import os
from pathlib import Path

import pytest
import torch

from harness import checkpoint, job, pruning
from harness.config import ScheduleConfig, ScheduleName, DecayShape, validate
from harness.optim import build_optimizer, lr_multiplier
from harness_testing import restore_process_state  # noqa: F401  (a fixture, used below)
from harness_testing import TINY, client, compose, isolated, runs

pytestmark = pytest.mark.usefixtures("restore_process_state")


def _overrides(tmp, *extra):
    keep = [o for o in isolated(tmp) if not o.startswith("hydra.")]
    return [*TINY, *keep, *extra]


# --- schedules and optimizers ------------------------------------------------------------------

def test_cosine_warms_up_then_decays_to_the_floor():
    s = ScheduleConfig(name=ScheduleName.cosine, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_multiplier(s, i, 100) for i in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


@pytest.mark.parametrize("shape", list(DecayShape))
def test_wsd_is_flat_then_decays_over_its_last_fraction(shape):
    s = ScheduleConfig(name=ScheduleName.wsd, warmup_steps=5, min_lr_ratio=0.0, decay_fraction=0.2, decay_shape=shape)
    lrs = [lr_multiplier(s, i, 100) for i in range(100)]
    assert lrs[5:80] == [1.0] * 75
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12) and lrs[80] < 1.0


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizers_step_and_round_trip_their_state(name, tmp_path):
    spec = validate(compose(_overrides(tmp_path, f"optim={name}")))
    from attnres import DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(spec.cfg.model, spec.cfg.residual)
    opt = build_optimizer(model, spec.cfg.optim)
    x = torch.randint(0, 256, (2, 16))
    before = [p.detach().clone() for p in model.parameters()]
    model(x, x)[1].backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()) if b.grad is not None)
    state = opt.state_dict()
    opt2 = build_optimizer(model, spec.cfg.optim)
    opt2.load_state_dict(state)
    assert len(opt2.param_groups) == len(opt.param_groups)


# --- checkpoints ---------------------------------------------------------------------------------

def test_a_failed_checkpoint_write_leaves_the_previous_one_intact(tmp_path):
    folder = checkpoint.RunFolder(tmp_path / "run").acquire(fresh=False)
    folder.save({"step": 1, "w": torch.ones(3)})

    class Boom(Exception):
        pass

    def failing_save(obj, path):
        open(path, "wb").write(b"half a checkpoint")
        raise Boom("disk full")

    real = torch.save
    torch.save = failing_save
    try:
        with pytest.raises(Boom):
            folder.save({"step": 2})
    finally:
        torch.save = real
    assert folder.load()["step"] == 1
    assert [p.name for p in folder.path.iterdir() if p.name.endswith(".tmp")] == []
    folder.release()


def test_taking_a_run_folder_removes_the_temp_files_of_a_writer_killed_mid_write(tmp_path):
    folder = checkpoint.RunFolder(tmp_path / "run").acquire(fresh=False)
    folder.save({"step": 1})
    folder.release()
    (tmp_path / "run" / ".last.pt.4242.tmp").write_bytes(b"half a checkpoint")  # kill -9 mid-write
    (tmp_path / "run" / ".run.json.4242.tmp").write_text("{")
    folder = checkpoint.RunFolder(tmp_path / "run").acquire(fresh=False)
    assert sorted(p.name for p in folder.path.iterdir()) == [".lock", "last.pt"]
    assert folder.load()["step"] == 1
    folder.release()


def test_a_second_process_cannot_take_a_busy_run_folder(tmp_path):
    first = checkpoint.RunFolder(tmp_path / "run").acquire(fresh=False)
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, %r); from harness.checkpoint import RunFolder, RunBusy\n"
            "try:\n    RunFolder(__import__('pathlib').Path(%r)).acquire(fresh=False)\n"
            "except RunBusy:\n    sys.exit(3)\n") % (str(checkpoint.PROJECT_ROOT), str(tmp_path / "run"))
    assert subprocess.run([sys.executable, "-c", code]).returncode == 3
    first.release()


@pytest.mark.parametrize("damage", [b"", b"PK\x03\x04 cut short"], ids=["empty", "cut_short"])
def test_an_unreadable_checkpoint_stops_the_run_in_one_line_and_is_kept(tmp_path, capsys, damage):
    """A last.pt damaged from outside (a copy cut short, a disk error): not a traceback, not a
    silent fresh start, but one line naming the file and the way out, exit 2, before any MLflow
    run, the file left as it was."""
    from harness.config import to_plain

    cfg = compose(_overrides(tmp_path))
    folder = checkpoint.run_folder(to_plain(validate(cfg).cfg))
    folder.mkdir(parents=True)
    (folder / checkpoint.CHECKPOINT).write_bytes(damage)
    with pytest.raises(SystemExit) as stopped:
        job.run(cfg)
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: train.resume=true: ") and "train.resume=false" in lines[0]
    assert str(folder / checkpoint.CHECKPOINT) in lines[0]
    assert (folder / checkpoint.CHECKPOINT).read_bytes() == damage and runs(tmp_path) == []


def test_a_lost_run_record_resumes_into_the_checkpoints_mlflow_run(tmp_path):
    """run.json gone or damaged, last.pt intact: the checkpoint names the MLflow run too, so the
    rerun continues that run (one run, every step once) instead of opening a second one."""
    overrides = _overrides(tmp_path, "tracking.log_code=false", "tracking.log_env=false",
                           "tracking.log_model=false", "tracking.log_plots=false")
    job.run(compose(overrides))
    (record,) = (tmp_path / "ckpt").rglob(checkpoint.RECORD)
    record.write_text("{not json")  # what a disk error leaves; the checkpoint is at the last step
    job.run(compose(overrides))
    (run,) = runs(tmp_path)
    assert run.info.status == "FINISHED" and run.data.tags["attnres.resumed_at_step"] == "6"
    steps = [m.step for m in client(tmp_path).get_metric_history(run.info.run_id, "train/loss")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_run_killed_while_ending_its_mlflow_run_is_ended_by_the_rerun(tmp_path, monkeypatch):
    """The process dies (SIGTERM after training, kill -9) as it ends a finished run's MLflow run:
    the rerun must not answer "already finished" with the MLflow run left RUNNING and its final
    metrics never sent, but end it, with them."""
    import mlflow

    from harness.tracking import MlflowTracker

    class Killed(BaseException):
        pass

    real_end = MlflowTracker.end

    def killed_on_finish(self, status, tags=None):
        if status == "FINISHED":
            raise Killed
        return real_end(self, status, tags)

    overrides = _overrides(tmp_path, "tracking.log_code=false", "tracking.log_env=false",
                           "tracking.log_model=false", "tracking.log_plots=false")
    monkeypatch.setattr(MlflowTracker, "end", killed_on_finish)
    with pytest.raises(Killed):
        job.run(compose(overrides))
    monkeypatch.setattr(MlflowTracker, "end", real_end)
    mlflow.tracking.fluent._active_run_stack.get().clear()  # the dead process's active run went with it
    job.run(compose(overrides))
    (run,) = runs(tmp_path)
    assert run.info.status == "FINISHED" and "final/val_loss" in run.data.metrics


def test_the_run_key_ignores_where_a_run_logs_but_not_what_it_computes(tmp_path):
    from harness.config import to_plain

    base = to_plain(validate(compose(_overrides(tmp_path))).cfg)
    other_uri = to_plain(validate(compose(_overrides(tmp_path, "tracking.uri=sqlite:////elsewhere.db"))).cfg)
    other_lr = to_plain(validate(compose(_overrides(tmp_path, "optim.lr=0.01"))).cfg)
    allocator = to_plain(validate(compose(_overrides(tmp_path, "train.keep_freed_memory=false"))).cfg)
    assert checkpoint.run_key(base) == checkpoint.run_key(other_uri) == checkpoint.run_key(allocator)
    assert checkpoint.run_key(base) != checkpoint.run_key(other_lr)


# A cycle like a training step's: 4 MiB of heap blocks written, then all freed. glibc first sees one
# 256 KiB block freed from mmap, as a model's first step gives it, and adapts its thresholds to it.
_MALLOC_CYCLES = """
import ctypes, resource, sys
from harness import malloc
libc = malloc._glibc()
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[1] == "keep":
    assert malloc.keep_freed_memory()
libc.free(libc.malloc(256 << 10))
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(64 << 10) for _ in range(64)]
    for b in blocks:
        libc.memset(b, 1, 64 << 10)
    for b in reversed(blocks):
        libc.free(b)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.skipif(__import__("harness.malloc").malloc._glibc() is None, reason="glibc's mallopt only")
def test_kept_freed_memory_is_not_faulted_in_again_each_cycle():
    """glibc by default gives a freed heap top back to the kernel (its trim threshold follows the
    largest block freed, 2 × 256 KiB here), so every cycle faults its 1,024 pages in again; with
    keep_freed_memory only the first cycle does (page faults counted by getrusage)."""
    import subprocess
    import sys

    faults = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _MALLOC_CYCLES, mode], capture_output=True, text=True,
                             cwd=checkpoint.PROJECT_ROOT, check=True).stdout
        faults[mode] = [int(f) for f in out.split()]
    assert min(faults["default"][1:]) > 768, faults  # most of 4 MiB = 1,024 pages, every cycle
    assert faults["keep"][0] > 768 and max(faults["keep"][1:]) < 50, faults


# --- outcomes in MLflow ----------------------------------------------------------------------------

def test_nan_loss_fails_the_run_with_step_and_reason(tmp_path, monkeypatch, capsys):
    """A single run that diverges: one line (not a traceback) and exit 1; the MLflow run FAILED with
    the step and reason, and the last good checkpoint kept."""
    from attnres import DecoderLM

    real_forward = DecoderLM.forward
    calls = {"n": 0}

    def nan_at_third_step(self, idx, targets=None):
        logits, loss = real_forward(self, idx, targets)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] == 3:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(DecoderLM, "forward", nan_at_third_step)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        job.run(compose(_overrides(tmp_path)))
    lines = [line for line in capsys.readouterr().err.splitlines() if "diverged" in line or "Traceback" in line]
    assert stopped.value.code == 1 and len(lines) == 1, lines
    assert "diverged: non-finite training loss (nan) at step 3" in lines[0]
    (run,) = runs(tmp_path)
    assert f"MLflow run {run.info.run_id} FAILED" in lines[0]
    assert run.info.status == "FAILED"
    assert run.data.tags["attnres.status"] == "FAILED"
    assert run.data.tags["attnres.failure_step"] == "3"
    assert "non-finite training loss" in run.data.tags["attnres.failure"]
    record = checkpoint.RunFolder(next((tmp_path / "ckpt").rglob("run.json")).parent)
    assert record.load()["step"] == 2  # the last good checkpoint is kept


class _PruneAtFirstReport:
    number = 7

    def __init__(self):
        self.attrs, self.attrs_at_first_report = {}, None

    def set_user_attr(self, key, value):
        self.attrs[key] = value

    def report(self, value, step):
        self.step = step
        self.attrs_at_first_report = dict(self.attrs)

    def should_prune(self):
        return True


def test_a_pruned_trial_ends_killed_with_the_pruned_tags(tmp_path):
    trial = _PruneAtFirstReport()
    with pruning.bind(trial):
        with pytest.raises(pruning.TrialPruned):
            job.run(compose(_overrides(tmp_path)))
    (run,) = runs(tmp_path)
    # the trial knew its MLflow run from the start (a sweeper that finds it dead ends that run)
    assert trial.attrs_at_first_report == {"mlflow.run_id": run.info.run_id}
    assert run.info.status == "KILLED"
    assert run.data.tags["attnres.status"] == "PRUNED" and run.data.tags["pruned"] == "true"
    assert run.data.tags["attnres.role"] == "trial" and run.data.tags["optuna.trial_number"] == "7"


def test_parent_run_id_makes_the_run_a_child_of_that_parent(tmp_path):
    c = client(tmp_path)
    from harness.tracking import client_for, experiment_id

    exp = experiment_id(client_for(f"sqlite:///{tmp_path / 'mlflow.db'}"), "default", f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = c.create_run(exp, tags={"attnres.role": "study"}).info.run_id
    value = job.run(compose(_overrides(tmp_path, f"tracking.parent_run_id={parent}")))
    child = [r for r in runs(tmp_path) if r.info.run_id != parent][0]
    assert child.data.tags["mlflow.parentRunId"] == parent
    assert child.data.metrics["final/val_loss"] == value and math.isfinite(value)


def test_sqlite_stores_are_created_under_the_lock_of_their_folder(tmp_path, monkeypatch):
    """Creating a SQLite store is serialised by flock on the database's folder: no lock file is
    left anywhere (it was one per store in the temporary folder, never removed), the same store
    named another way (a relative path through a symbolic link) takes the same lock, and so does
    the Optuna sweeper for its own database beside it."""
    import fcntl
    import tempfile

    from harness.tracking import client_for, store_lock
    from hydra_plugins.attnres_optuna_sweeper._storage import sqlite_init_lock

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    client_for(f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    assert [p.name for p in (tmp_path / "store").iterdir()] == ["mlflow.db"]
    assert list(temp.iterdir()) == []

    def held() -> bool:
        handle = os.open(tmp_path / "store", os.O_RDONLY)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(handle)

    (tmp_path / "link").symlink_to(tmp_path / "store")
    monkeypatch.chdir(tmp_path)
    for lock in (store_lock("sqlite:///link/mlflow.db"), sqlite_init_lock(f"sqlite:///{tmp_path / 'store' / 'optuna.db'}")):
        with lock:
            assert held()
        assert not held()  # released on leaving
    assert not held() and list(temp.iterdir()) == []


def test_a_model_training_tag_set_by_another_process_in_between_is_not_an_error(tmp_path, monkeypatch):
    """Two sweep workers starting together both found the tag missing; the second insert failed on
    the tag's unique key (an MLflow server over PostgreSQL, under load). Here the other process's
    insert lands between our look and our set, which then fails as the server's did: the tag is
    there, so nothing is raised. A set that fails with the tag absent still raises."""
    from mlflow.exceptions import MlflowException

    from harness.tracking import EXPERIMENT_KIND, client_for, mark_model_training

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ours, other = client_for(uri), client_for(uri)
    exp = ours.create_experiment("race")
    real_set = ours.set_experiment_tag

    def raced(exp_id, key, value):
        real_set(exp_id, key, value)  # the other worker's insert, first
        raise MlflowException("duplicate key value violates unique constraint \"experiment_tag_pk\"")

    monkeypatch.setattr(ours, "set_experiment_tag", raced)
    mark_model_training(ours, exp)
    assert other.get_experiment(exp).tags[EXPERIMENT_KIND[0]] == EXPERIMENT_KIND[1]

    lost = ours.create_experiment("lost")
    monkeypatch.setattr(ours, "set_experiment_tag", lambda *a: (_ for _ in ()).throw(MlflowException("server down")))
    with pytest.raises(MlflowException, match="server down"):
        mark_model_training(ours, lost)


def test_tracking_off_still_trains_and_returns_the_loss(tmp_path):
    value = job.run(compose(_overrides(tmp_path, "tracking=off")))
    assert math.isfinite(value) and not (tmp_path / "mlflow.db").exists()
    assert os.path.exists(next((tmp_path / "ckpt").rglob("last.pt")))


def test_loss_on_answers_trains_and_validates_on_the_answers_only(tmp_path):
    """The same run with the loss on every token and on the answers only: both train to a finite
    validation loss, and they differ (the same weights at step 0, other targets after)."""
    common = ["data=multihop", "train.seq_len=64", "data.train_examples=400", "data.val_examples=40",
              "data.max_bytes=null"]
    losses = {}
    for on in ("all", "answers"):
        folder = tmp_path / on
        losses[on] = job.run(compose(_overrides(folder, *common, f"data.loss_on={on}")))
    assert all(math.isfinite(v) for v in losses.values()) and losses["answers"] != losses["all"]


def test_multihop_data_logs_probe_accuracy_per_hop(tmp_path):
    overrides = _overrides(tmp_path, "data=multihop", "train.seq_len=64", "data.train_examples=400",
                           "data.val_examples=40", "data.max_bytes=null")
    job.run(compose(overrides))
    (run,) = runs(tmp_path)
    for k in (1, 2, 3, 4):
        history = client(tmp_path).get_metric_history(run.info.run_id, f"probe/acc_hop_{k}")
        assert [m.step for m in history] == [3, 6] and all(0 <= m.value <= 1 for m in history)
        copy = client(tmp_path).get_metric_history(run.info.run_id, f"probe/copy_hop_{k}")
        assert [m.step for m in copy] == [3, 6] and 0.1 < copy[-1].value <= 1


# --- OpenMP's waiting ------------------------------------------------------------------------------

def test_openmp_gets_a_short_spin_unless_the_user_chose_how_it_waits():
    from harness import openmp

    env = {}
    openmp.set_wait_policy(env)
    assert env == {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}
    for chosen in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "50"}):
        env = dict(chosen)
        openmp.set_wait_policy(env)
        assert env == chosen


def test_run_py_sets_the_wait_policy_before_torch_is_imported():
    """What a process that starts run.py sees: the short spin in its environment (when the user set
    neither variable) and torch not yet loaded when it was set, since libgomp reads it on loading."""
    import subprocess
    import sys

    code = ("import sys; sys.argv = ['run.py']; import run, os; "
            "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], cwd=checkpoint.PROJECT_ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["1000", "None"]
    # Nothing before the call may load torch: only harness.openmp is imported there, and it does not.
    source = (checkpoint.PROJECT_ROOT / "run.py").read_text()
    before = source[: source.index("openmp.set_wait_policy()")]
    assert [line for line in before.splitlines() if line.startswith(("import ", "from "))] == ["from harness import openmp"]
    probe = "import sys, harness.openmp; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], cwd=checkpoint.PROJECT_ROOT, env=env, capture_output=True,
                          text=True, check=True).stdout.split() == ["False"]
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run([sys.executable, "-c", code], cwd=checkpoint.PROJECT_ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["None", "PASSIVE"]


def test_default_run_names_carry_the_overrides_that_change_the_run():
    """Runs of a sweep over shapes must tell themselves apart in `mlflow ui`: the default name is
    <variant>-<model>-s<seed> and the job's other overrides that change what it computes; the
    sweep, what the name already says, and keys outside a run's identity (threads, progress,
    folders, tracking) stay out."""
    from types import SimpleNamespace

    from harness.job import run_label

    c = SimpleNamespace(residual=SimpleNamespace(name="block"), model=SimpleNamespace(name="default"),
                        train=SimpleNamespace(seed=1))
    overrides = ["+sweep=block_size", "residual=block", "model.layers=16", "train.seed=1", "residual.block_size=2",
                 "train.threads=1", "train.progress=false", "train.checkpoint_dir=/tmp/c", "tracking.uri=sqlite:///m.db",
                 "+optim.lr=0.01", "train=gpu"]
    assert run_label(c, overrides) == "block-default-s1 model.layers=16 residual.block_size=2 optim.lr=0.01 train=gpu"
    assert run_label(c, []) == "block-default-s1"
    c.residual.name = "baseline"  # a knob the variant does not read changes nothing
    assert run_label(c, overrides) == "baseline-default-s1 model.layers=16 optim.lr=0.01 train=gpu"


def test_the_tracking_group_is_outside_a_runs_identity_as_its_keys_are():
    """`tracking=off` (HARNESS.md) named runs `baseline-default-s0 tracking=off`, and an Optuna
    study continued with it was refused as if its trials computed something else; the run folder
    (config hash) already ignored it."""
    from types import SimpleNamespace

    from harness.config import changes_the_run
    from harness.job import run_label

    assert not changes_the_run("tracking=off") and not changes_the_run("tracking.uri=sqlite:///m.db")
    assert changes_the_run("train=gpu") and changes_the_run("trackingx=1")
    c = SimpleNamespace(residual=SimpleNamespace(name="baseline"), model=SimpleNamespace(name="default"),
                        train=SimpleNamespace(seed=0))
    assert run_label(c, ["tracking=off", "train.steps=3"]) == "baseline-default-s0 train.steps=3"


def test_the_code_snapshot_holds_the_c_kernels():
    """Each run logs the source it ran (code/source.tar.gz): the CPU kernels are C, compiled at
    run time, so they are part of it."""
    from harness import provenance

    names = provenance._source_files()
    assert "attnres/kernels/csrc/depth_read.c" in names and "attnres/model.py" in names
    assert any(n.endswith(".h") for n in names if n.startswith("attnres/kernels/csrc/"))


def test_a_run_resumed_on_another_number_of_processes_says_so_in_tags(tmp_path):
    """MLflow params are written once: a resume with another world size (which the run's identity
    leaves out) adds tags named by the step the new layout starts at; the same layout adds none."""
    from types import SimpleNamespace

    from harness.tracking import MlflowTracker

    tracker = MlflowTracker.start(f"sqlite:///{tmp_path / 'mlflow.db'}", "default", "r", {})
    try:
        tracker.log_params({"train.world_size": 2, "train.accum_steps": 1})
        job._note_layout_change(tracker, SimpleNamespace(world_size=2, accum_steps=1), step=40)
        job._note_layout_change(tracker, SimpleNamespace(world_size=1, accum_steps=2), step=50)
        tags = tracker.client.get_run(tracker.run_id).data.tags
    finally:
        tracker.end("FINISHED")
    assert {k: v for k, v in tags.items() if "_from_step_" in k} == {
        "attnres.world_size_from_step_50": "1", "attnres.accum_steps_from_step_50": "2"}


def test_creatable_tries_the_folder_for_real_and_leaves_nothing(tmp_path):
    """A multirun checks its checkpoint folder before any job (root passes every permission bit,
    /proc refuses anyway): the folders made for the try are removed, those that existed stay."""
    folder = tmp_path / "a" / "b" / "c"
    assert checkpoint.creatable(folder) is None and not (tmp_path / "a").exists()
    (tmp_path / "a").mkdir()
    assert checkpoint.creatable(folder) is None and (tmp_path / "a").is_dir()
    assert not (tmp_path / "a" / "b").exists()
    assert isinstance(checkpoint.creatable(Path("/proc/no-such-dir/x")), OSError)


def test_untracked_files_leave_out_run_folders_in_the_tree(tmp_path, monkeypatch):
    """A checkpoint_dir inside the project (not the ignored checkpoints/) holds run folders: their
    .lock and run.json are not code and stay out of code/untracked.txt; a real new file stays in."""
    from harness import provenance

    run = tmp_path / "ck" / "default" / "baseline-tiny-s0-0123456789ab"
    run.mkdir(parents=True)
    (run / ".lock").touch()
    (run / "run.json").write_text("{}")
    (tmp_path / "notes.py").write_text("x = 1\n")
    listing = "ck/default/baseline-tiny-s0-0123456789ab/.lock\nck/default/baseline-tiny-s0-0123456789ab/run.json\nnotes.py\n"
    monkeypatch.setattr(provenance, "PROJECT_ROOT", tmp_path)
    monkeypatch.setattr(provenance, "_git", lambda *args: listing)
    assert provenance._untracked() == ("notes.py",)


def test_the_sqlite_side_files_of_the_default_stores_are_not_untracked_code():
    """The Optuna sweeper's default storage is optuna.db in the project root; while a sweep ran,
    its optuna.db-wal and optuna.db-shm were untracked files: in `git status` and in every
    trial's code/untracked.txt (only mlflow.db-* was ignored)."""
    import subprocess

    from harness.config import PROJECT_ROOT

    names = ["mlflow.db-wal", "optuna.db-wal", "optuna.db-shm", "optuna.db-journal"]
    try:
        result = subprocess.run(["git", "check-ignore", *names], cwd=PROJECT_ROOT, capture_output=True, text=True)
    except OSError:
        pytest.skip("git is not installed")
    if result.returncode == 128:
        pytest.skip("not a git checkout")
    assert result.stdout.split() == names


def test_a_finished_run_asked_for_with_the_same_store_spelt_relatively_is_not_said_to_be_elsewhere(
        tmp_path, monkeypatch, capsys):
    """`tracking.uri=sqlite:///mlflow.db` from the folder that holds it is the store the run was
    recorded in as sqlite:////<that folder>/mlflow.db: the "already finished" line must not say it
    is in another store and offer to train it again "into this store"."""
    overrides = _overrides(tmp_path, "tracking.log_code=false", "tracking.log_env=false",
                           "tracking.log_model=false", "tracking.log_plots=false", "tracking.log_explorer=false")
    job.run(compose(overrides))
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    job.run(compose([o for o in overrides if not o.startswith("tracking.uri=")] + ["tracking.uri=sqlite:///mlflow.db"]))
    (line,) = [l for l in capsys.readouterr().err.splitlines() if "already finished" in l]
    assert "not in tracking.uri" not in line and line.endswith("; train.resume=false trains it again"), line
