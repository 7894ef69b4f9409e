"""What a user of `mlflow ui` lands on, in a fresh headless Chromium against a real MLflow server.

MLflow 3's UI opens an experiment on its GenAI overview unless the browser's sidebar switch says
"Model training" (the experiment's `mlflow.experimentKind` tag does not change that), so the
experiments the harness creates carry a description that links to their runs table.
"""
from __future__ import annotations

import html
import re

import pytest

from harness.tracking import client_for, experiment_id, runs_table_link
from test_eval_explorer import CHROMIUM, needs_chromium
from test_reliability_tracking_server import _Server


def page(tmp_path, url: str, profile: str) -> str:
    """The DOM after the app has loaded its data, in a browser profile of its own (nothing stored)."""
    import subprocess

    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / profile}",
            "--window-size=1400,1000", "--virtual-time-budget=20000", "--dump-dom", url]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout


def title(dom: str) -> str:
    return html.unescape(re.search(r"<title>(.*?)</title>", dom, re.S).group(1)).strip()


@pytest.mark.slow  # an MLflow server start and two page loads: 1-2 min on a busy 2-core machine
@needs_chromium
def test_a_fresh_browser_reaches_the_runs_table_from_the_experiment_page(tmp_path):
    server = _Server(tmp_path).start()
    try:
        client = client_for(server.uri)
        exp = experiment_id(client, "ablation", server.uri)
        run = client.create_run(exp, run_name="block-default-s0").info.run_id
        client.set_terminated(run)

        landing = page(tmp_path, f"{server.uri}/#/experiments/{exp}", "first")
        links = [html.unescape(h) for h in re.findall(r'<a [^>]*href="([^"]*)"', landing)]
        assert runs_table_link(exp) in links, f"no link to the runs table on {title(landing)!r}"

        runs = page(tmp_path, f"{server.uri}/{runs_table_link(exp)}", "second")
        assert title(runs).startswith("Runs - ")
        assert "block-default-s0" in runs  # the run is listed in the table
    finally:
        server.kill()


def test_the_description_is_set_once_and_a_users_own_is_kept(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    exp = experiment_id(client, "ablation", uri)
    note = client.get_experiment(exp).tags["mlflow.note.content"]
    assert f"]({runs_table_link(exp)})" in note  # a Markdown link, as the UI renders descriptions
    client.set_experiment_tag(exp, "mlflow.note.content", "my own notes")
    assert experiment_id(client, "ablation", uri) == exp
    assert client.get_experiment(exp).tags["mlflow.note.content"] == "my own notes"
