"""A tracking server that is down. At start: the run stops in seconds, before any training, with
the URI in one line. Mid-run (a real `mlflow server` on loopback, killed after step 2): training
goes on, what it logs meanwhile waits in <run folder>/metrics_pending.jsonl (artifacts in
artifacts_pending/), and once the server is back the same command sends all of it, once."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from harness import job
from harness.tracking import PENDING_METRICS, PENDING_TAGS, MlflowTracker
from harness_testing import restore_process_state  # noqa: F401  (a fixture, used below)
from harness_testing import ROOT, TINY, compose, file_size_limit

FAST = ["tracking.log_code=false", "tracking.log_env=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_at_start_stops_the_run_within_15_s_before_training(tmp_path):
    uri = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    started = time.monotonic()
    result = subprocess.run(  # not run_cli: its own sqlite tracking.uri would come last and win
        [sys.executable, "run.py", *TINY, *FAST, f"train.checkpoint_dir={tmp_path / 'ckpt'}",
         f"hydra.run.dir={tmp_path / 'out'}", f"tracking.uri={uri}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
    )
    assert time.monotonic() - started < 15  # process start and imports included
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: tracking.uri={uri}: no MLflow server answers")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "out").exists()  # nothing trained


@pytest.mark.parametrize("scheme", ["postgresql+psycopg2", "mysql+nosuchdriver"])
def test_a_database_store_that_cannot_be_used_is_one_line_within_seconds(scheme):
    """tracking.uri naming a database directly: MLflow's store would retry for ~100 s and end in a
    traceback. Nothing listens on the port (or the driver is unknown): one line, the password not
    in it (the same check runs for run.py, a multirun's callback and the evaluation commands)."""
    from harness.tracking import TrackingUnreachable, check_tracking_uri

    uri = f"{scheme}://attnres:s3cret@127.0.0.1:{_free_port()}/runs"
    started = time.monotonic()
    with pytest.raises(TrackingUnreachable) as refused:
        check_tracking_uri(uri)
    assert time.monotonic() - started < 15
    line = str(refused.value)
    assert line.startswith(f"tracking.uri={scheme}://attnres:***@127.0.0.1:") and "allowed:" in line
    assert "\n" not in line and "s3cret" not in line


def test_a_pending_file_cut_short_by_a_kill_is_replayed_without_its_torn_line(tmp_path):
    """kill -9 (or a full disk) in the middle of an append to metrics_pending.jsonl leaves half a
    line. The replay sends the rest and drops that line, instead of raising on it at every start
    of the run (the rerun crashed before training, every time)."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("pending")).info.run_id
    (tmp_path / PENDING_METRICS).write_text(
        '{"key": "train/loss", "value": 2.5, "timestamp": 1, "step": 1}\n{"key": "train/loss", "valu')
    MlflowTracker(client, run_id, 5.0, resumed=True, pending_dir=tmp_path)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(1, 2.5)]
    assert not (tmp_path / PENDING_METRICS).exists()


class _Server:
    """`mlflow server` on a loopback port, its store and artifacts in `root`."""

    def __init__(self, root):
        self.root, self.port = root, _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(
            [shutil.which("mlflow") or "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}",
             "--artifacts-destination", str(self.root / "artifacts")],
            cwd=self.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: uvicorn's worker dies with it
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.uri + "/health", timeout=1).read()
                return self
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.2)

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # server and worker die; the port refuses from now on
            self.proc.wait()


@pytest.fixture
def server(tmp_path):
    s = _Server(tmp_path)
    yield s.start()
    s.kill()


@pytest.mark.usefixtures("restore_process_state")
def test_metrics_logged_while_the_server_is_down_reach_it_later(tmp_path, server, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused at once: a fast test
    real_log = MlflowTracker.log_metrics

    def lose_the_server_after_step_2(self, metrics, step):
        if step == 3 and "train/loss" in metrics:
            server.kill()
        return real_log(self, metrics, step)

    monkeypatch.setattr(MlflowTracker, "log_metrics", lose_the_server_after_step_2)
    overrides = [*TINY, *FAST, f"tracking.uri={server.uri}", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
                 "tracking.flush_seconds=0"]
    value = job.run(compose(overrides))  # trains to the end with the server gone from step 3
    folder = next((tmp_path / "ckpt").rglob("run.json")).parent
    pending = (folder / PENDING_METRICS).read_text()
    assert '"key": "train/loss"' in pending and '"step": 6' in pending

    server.start()  # back (same store); the same command sends what waited, and ends the run
    assert job.run(compose(overrides)) == value
    from mlflow import MlflowClient

    client = MlflowClient(server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["attnres.status"] == "FINISHED"
    for key in ("train/loss", "train/lr"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2, 3, 4, 5, 6]
    assert run.data.metrics["final/val_loss"] == value
    names = {a.path for a in client.list_artifacts(run.info.run_id, "instrumentation")}
    assert names == {"instrumentation/step_0000003.json", "instrumentation/step_0000006.json"}
    assert {a.path for a in client.list_artifacts(run.info.run_id, "model")} >= {"model/model.safetensors"}
    assert not [p for p in folder.iterdir() if "pending" in p.name]  # nothing waits any more


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="no file-size limit on this system")
def test_tags_kept_while_the_server_is_down_survive_a_write_the_disk_refuses(tmp_path):
    """The tags a tracker keeps while its server is down are rewritten whole at every change; a
    write the disk refuses (full, here a file-size limit) keeps the previous file and leaves no
    temporary file in the run folder (one was left behind, .tags_pending.json.<pid>.tmp)."""
    class DeadServer:
        def log_batch(self, *args, **kwargs):
            raise ConnectionError("the tracking server is down")

    tracker = MlflowTracker(DeadServer(), "run", 5.0, resumed=False, pending_dir=tmp_path)
    tracker.set_tags({"a": "1"})
    before = (tmp_path / PENDING_TAGS).read_text()
    with file_size_limit(len(before) + 100), pytest.raises(OSError):
        tracker.set_tags({"b": "x" * 1000})
    assert (tmp_path / PENDING_TAGS).read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [PENDING_TAGS]
