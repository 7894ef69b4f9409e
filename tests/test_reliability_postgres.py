"""A real shared tracking server: a throwaway PostgreSQL cluster on loopback, `mlflow server` on
it, and a two-job multirun against the server: every run is there, finished.

Skips, saying why, where PostgreSQL's server binaries (Debian package `postgresql`) or psycopg2
are absent. ATTNRES_TEST_PG_URI=postgresql+psycopg2://user@host:port/db uses an existing database instead.
As root the cluster runs as the `postgres` user (PostgreSQL refuses to run as root)."""
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from harness_testing import ROOT, TINY

pytestmark = pytest.mark.postgres


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
            proc.wait(timeout=30)


def test_a_two_job_multirun_on_an_mlflow_server_backed_by_postgresql(mlflow_server, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
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
