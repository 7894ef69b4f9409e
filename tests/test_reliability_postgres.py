"""A real shared tracking server: a throwaway PostgreSQL cluster on loopback, `mlflow server` on
it, and against the server a two-job multirun (every run is there, finished) and a two-worker
Optuna study whose trials live in a second database of the same cluster (docs/SWEEPER.md,
"several workers": every trial complete once, none beyond n_trials, each one's run in MLflow).

Skips, saying why, where PostgreSQL's server binaries (Debian package `postgresql`) or psycopg2
are absent. ATTNRES_TEST_PG_URI=postgresql+psycopg2://user@host:port/db uses an existing database instead.
As root the cluster runs as the `postgres` user (PostgreSQL refuses to run as root)."""
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from harness_testing import ROOT, TINY

pytestmark = [pytest.mark.postgres, pytest.mark.slow]  # a database server per test: in the slow set (CI runs it)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin() -> Path | None:
    # Debian's versioned folders first: /usr/bin's pg_ctl there is a wrapper with other arguments.
    found = next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), reverse=True)), None) or shutil.which("pg_ctl")
    return Path(found).parent if found else None


@pytest.fixture(scope="module")
def postgres_uri():
    if os.environ.get("ATTNRES_TEST_PG_URI"):
        yield os.environ["ATTNRES_TEST_PG_URI"]
        return
    pytest.importorskip("psycopg2", reason="psycopg2 is not installed (pip install psycopg2-binary)")
    bin_dir = _pg_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL server binaries not found (apt-get install postgresql)")
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="attnres-pg-", dir="/tmp"))  # /tmp: traversable by the postgres user
    if os.geteuid() == 0:
        import pwd

        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no `postgres` user to run the cluster as")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    data = root / "data"
    run = lambda *cmd: subprocess.run([*as_user, *map(str, cmd)], check=True, capture_output=True, text=True, timeout=120)
    run(bin_dir / "initdb", "-D", data, "-U", "attnres", "--auth=trust", "-E", "UTF8")
    run(bin_dir / "pg_ctl", "-D", data, "-w", "-l", root / "pg.log", "start",
        "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1")
    try:
        # +psycopg2: SQLAlchemy's default PostgreSQL driver is now psycopg 3; name the one we require
        yield f"postgresql+psycopg2://attnres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def mlflow_server(postgres_uri, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    proc = subprocess.Popen(
        [shutil.which("mlflow") or "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", postgres_uri, "--artifacts-destination", str(tmp / "artifacts")],
        cwd=tmp, stdout=subprocess.DEVNULL, stderr=open(tmp / "server.log", "w"), start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    try:
        while True:
            try:
                urllib.request.urlopen(uri + "/health", timeout=1).read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp / "server.log").read_text()[-3000:]
                time.sleep(0.3)
        yield uri
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and its workers (own process group)
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:  # it waits ~10 s for idle keep-alive clients; a throwaway
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "ATTNRES_PARENT_RUN_ID")}


@pytest.fixture
def optuna_storage(postgres_uri):
    """A fresh database for Optuna's RDB storage, beside MLflow's on the same server."""
    import psycopg2
    from sqlalchemy.engine import make_url

    url = make_url(postgres_uri)
    name = f"attnres_optuna_{os.getpid()}_{int(time.time() * 1000)}"
    admin = psycopg2.connect(host=url.host, port=url.port, user=url.username, password=url.password,
                             dbname=url.database)
    admin.autocommit = True  # CREATE DATABASE cannot run inside a transaction
    try:
        with admin.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
    except psycopg2.errors.InsufficientPrivilege:
        admin.close()
        pytest.skip(f"the user of ATTNRES_TEST_PG_URI may not CREATE DATABASE (needed for {name})")
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def test_a_two_job_multirun_on_an_mlflow_server_backed_by_postgresql(mlflow_server, tmp_path):
    env = _env()
    result = subprocess.run(
        [sys.executable, "run.py", "-m", "residual=baseline,block", *TINY, "tracking.log_code=false",
         "tracking.log_env=false", "sweep.name=pg", f"tracking.uri={mlflow_server}",
         f"train.checkpoint_dir={tmp_path / 'ckpt'}", f"hydra.sweep.dir={tmp_path / 'multirun'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("pg").experiment_id])
    jobs = [r for r in runs if r.data.tags.get("attnres.role") == "job"]
    (parent,) = [r for r in runs if r.data.tags.get("attnres.role") == "parent"]
    assert sorted(r.data.params["residual.name"] for r in jobs) == ["baseline", "block"]
    assert all(r.info.status == "FINISHED" and "final/val_loss" in r.data.metrics for r in jobs)
    assert parent.info.status == "FINISHED"
    for r in jobs:
        steps = [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")]
        assert steps == [1, 2, 3, 4, 5, 6]
        assert {a.path for a in client.list_artifacts(r.info.run_id, "model")} >= {"model/model.safetensors"}


def test_workers_opening_a_fresh_optuna_storage_at_once_all_succeed(optuna_storage):
    """Four sweeper workers open a fresh PostgreSQL database at the same instant: all get a usable
    storage. Without the retry in _storage.open_storage three of the four failed on every try
    (a unique-key violation on Optuna's schema version row, the loser of the creation race)."""
    import optuna

    from hydra_plugins.attnres_optuna_sweeper._storage import open_storage

    barrier, opened, errors = threading.Barrier(4), [], []

    def worker() -> None:
        barrier.wait()
        try:
            opened.append(open_storage(optuna_storage, heartbeat_interval=60, grace_period=None))
        except Exception as error:
            errors.append(repr(error)[:300])

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [] and len(opened) == 4
    optuna.create_study(study_name="race", storage=opened[0])
    assert optuna.get_all_study_names(storage=opened[3]) == ["race"]
    for storage in opened:
        storage.engine.dispose()  # the fixture drops the database afterwards


def test_two_optuna_workers_share_one_study_in_postgresql(mlflow_server, optuna_storage, tmp_path):
    """Two `run.py -m hydra/sweeper=attnres_optuna` processes started together on one study:
    4 trials between them, each COMPLETE exactly once, each one's MLflow run nested under the
    study's single parent run, with the trial's learning rate and its objective as final/val_loss."""
    import optuna
    from mlflow import MlflowClient
    from optuna.trial import TrialState

    from hydra_plugins.attnres_optuna_sweeper._ledger import VOID_ATTR

    n_trials = 4  # two per worker, if they split the study evenly
    command = [
        sys.executable, "run.py", "-m", "hydra/sweeper=attnres_optuna", "optim.lr=tag(log,interval(1e-3,1e-2))",
        f"hydra.sweeper.n_trials={n_trials}", f"hydra.sweeper.storage={optuna_storage}",
        "hydra.sweeper.pruner.name=none",  # a 4-trial study may prune after 2; here each trial completes
        "hydra.sweeper.mlflow.plots=false", *TINY, "tracking.log_code=false", "tracking.log_env=false",
        "tracking.log_model=false", "tracking.log_plots=false", "sweep.name=pg_optuna",
        f"tracking.uri={mlflow_server}", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
        f"hydra.sweep.dir={tmp_path / 'multirun'}",
    ]
    logs = [tmp_path / f"worker{i}.log" for i in (1, 2)]
    workers = []
    for i, log in enumerate(logs, start=1):
        with open(log, "w") as out:  # files, not pipes: a full pipe would stall a worker
            workers.append(subprocess.Popen([*command, f"hydra.sweeper.sampler.seed={i}"], cwd=ROOT, env=_env(),
                                            stdout=out, stderr=subprocess.STDOUT))
    try:
        for worker in workers:
            worker.wait(timeout=240)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    assert [w.returncode for w in workers] == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)

    everything = optuna.load_study(study_name="pg_optuna", storage=optuna_storage).trials
    trials = [t for t in everything if t.state == TrialState.COMPLETE]
    assert sorted(t.number for t in trials) == list(range(n_trials))  # none failed, none beyond n_trials
    # When both workers ask for the last slot at the same instant, the later trial is void (see
    # _ledger): FAIL with the reason, no job run for it. Two workers can collide at most once.
    surplus = [t for t in everything if t.state != TrialState.COMPLETE]
    assert len(surplus) <= 1 and all(
        t.state == TrialState.FAIL and t.user_attrs == {VOID_ATTR: "surplus"} and t.number >= n_trials
        for t in surplus
    ), [(t.number, t.state, t.user_attrs) for t in surplus]
    assert len({t.user_attrs["mlflow.run_id"] for t in trials}) == n_trials  # no run shared, none lost
    # Each worker logs the trials it ran ("pg_optuna trial 2: optim.lr=... -> 10.4"): both took part.
    ran = [set(re.findall(r"pg_optuna trial (\d+): optim\.lr=\S+ -> ", log.read_text())) for log in logs]
    assert ran[0].isdisjoint(ran[1]) and sorted(map(int, ran[0] | ran[1])) == list(range(n_trials)), ran

    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("pg_optuna").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("attnres.role") == "study"]  # one, shared by both workers
    assert parent.info.status == "FINISHED" and parent.data.metrics["trials/complete"] == n_trials
    by_id = {r.info.run_id: r for r in runs}
    for trial in trials:
        run = by_id[trial.user_attrs["mlflow.run_id"]]
        assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags["optuna.trial_number"] == str(trial.number)
        # float64 all the way (job return value, Optuna, MLflow): equal up to text round trips
        assert run.data.metrics["final/val_loss"] == pytest.approx(trial.value, rel=1e-9)
        assert float(run.data.params["optim.lr"]) == pytest.approx(trial.params["optim.lr"], rel=1e-9)
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
        assert steps == [1, 2, 3, 4, 5, 6]
