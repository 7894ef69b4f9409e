"""The ways into lm-eval with the model `attnres`: the installed `attnres-lm-eval` script,
`python -m evaluation.lm_eval_cli`, and lm-eval's Python API in this process.

These use the install this environment has (README: `pip install -e ".[dev]"`, as CI does) and
offline tasks; nothing of the project runs at Python start-up.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import attnres
from attnres import DecoderLM, ModelConfig, ResidualConfig

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'lm-eval==0.4.13')")

from test_eval_cli import write_tasks  # noqa: E402  (the offline task fixtures: JSONL + YAML)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny checkpoint written by attnres.save_pretrained, and the offline tasks."""
    tmp = tmp_path_factory.mktemp("doors")
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(d_model=32, layers=2, n_heads=2, max_seq_len=64), ResidualConfig(name="block", block_size=2))
    attnres.save_pretrained(model, tmp / "ck")
    (tmp / "tasks").mkdir()
    write_tasks(tmp / "tasks")
    return tmp


def offline_env(tmp: Path) -> dict:
    """Offline, and nothing from the checkout on the path: the project must come from its install."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf"),
           "ATTNRES_CACHE": "off", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    return env


def lm_eval_args(files: Path, out: Path) -> list[str]:
    return ["--model", "attnres", "--model_args", f"pretrained={files / 'ck'}", "--tasks", "tiny_mc",
            "--include_path", str(files / "tasks"), "--limit", "2", "--device", "cpu", "--output_path", str(out)]


def results_of(out: Path) -> dict:
    (results_file,) = out.rglob("results_*.json")
    return json.loads(results_file.read_text())


def test_the_installed_script_runs_lm_eval_with_attnres(files, tmp_path):
    scripts = {ep.name: ep.value for ep in importlib.metadata.distribution("attnres").entry_points.select(group="console_scripts")}
    assert scripts["attnres-lm-eval"] == "evaluation.lm_eval_cli:main"
    script = Path(sysconfig.get_path("scripts")) / "attnres-lm-eval"
    assert script.is_file(), f"not installed: {script} (pip install -e '.[dev]')"
    out = subprocess.run([str(script), *lm_eval_args(files, tmp_path / "out")], cwd=tmp_path, env=offline_env(tmp_path),
                         check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "|tiny_mc" in out.stdout and "acc" in out.stdout, out.stdout  # lm-eval's own table
    results = results_of(tmp_path / "out")
    assert results["config"]["model"] == "attnres"
    assert 0.0 <= results["results"]["tiny_mc"]["acc,none"] <= 1.0
    assert results["n-samples"]["tiny_mc"]["effective"] == 2


@pytest.mark.slow  # ~40 s: lm-eval indexes its task catalogue before it builds the model
def test_the_module_door_refuses_a_missing_checkpoint_in_one_line(files, tmp_path):
    args = lm_eval_args(files, tmp_path / "out")
    args[args.index("--model_args") + 1] = f"pretrained={tmp_path / 'nowhere'}"
    out = subprocess.run([sys.executable, "-m", "evaluation.lm_eval_cli", *args], cwd=ROOT, env=offline_env(tmp_path),
                         check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert str(tmp_path / "nowhere") in out.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_lm_evals_python_api_by_name_and_by_object(files):
    import lm_eval
    from lm_eval.api.registry import get_model, model_registry
    from lm_eval.tasks import TaskManager

    from evaluation.lm_eval_adapter import AttnResLM

    assert get_model("attnres") is AttnResLM
    assert "hf" in model_registry and get_model("dummy").__name__ == "DummyLM"  # lm-eval's own models stay
    tasks = TaskManager(include_path=str(files / "tasks"))
    run = dict(tasks=["tiny_mc"], limit=2, task_manager=tasks, bootstrap_iters=0, log_samples=True)
    by_name = lm_eval.simple_evaluate(model="attnres", model_args=f"pretrained={files / 'ck'},device=cpu,batch_size=4", **run)
    by_object = lm_eval.simple_evaluate(model=AttnResLM(pretrained=str(files / "ck"), device="cpu", batch_size=4), **run)
    scores = []
    for result in (by_name, by_object):
        assert result["n-samples"]["tiny_mc"]["effective"] == 2
        assert 0.0 <= result["results"]["tiny_mc"]["acc,none"] <= 1.0
        # each document's log-likelihood of each choice (float32 sums)
        scores.append([[ll for ll, _ in s["filtered_resps"]] for s in result["samples"]["tiny_mc"]])
    # The same weights and documents: the same log-likelihoods either way (float32; 1e-5 absolute).
    assert len(scores[0]) == 2 and all(len(doc) == 2 for doc in scores[0])
    assert all(ll < 0 for doc in scores[0] for ll in doc)
    assert torch.allclose(torch.tensor(scores[0]), torch.tensor(scores[1]), rtol=0, atol=1e-5), scores


def test_python_start_up_runs_nothing_of_the_project(tmp_path):
    """No start-up hook: a fresh interpreter has imported neither the project, lm-eval nor torch, and
    the install holds no .pth file of its own (setuptools' editable finder is setuptools')."""
    out = subprocess.run([sys.executable, "-c", "import sys; print([m for m in ('attnres', 'evaluation', 'lm_eval', 'torch') "
                          "if m in sys.modules])"], cwd=tmp_path, env=offline_env(tmp_path), check=True,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"
    own = [str(f) for f in importlib.metadata.files("attnres") or [] if f.suffix == ".pth" and not f.name.startswith("__editable__")]
    assert own == []
