"""attnres.load / attnres.save_pretrained: every way in gives back the same model."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnres
from attnres import DecoderLM, ModelConfig, ResidualConfig
from attnres.io import CheckpointError

ROOT = Path(__file__).resolve().parents[1]


def tiny(name="block", **model_kw):
    torch.manual_seed(0)
    cfg = dict(d_model=32, layers=2, n_heads=2, max_seq_len=64)
    cfg.update(model_kw)
    model = DecoderLM(ModelConfig(**cfg), ResidualConfig(name=name, block_size=2))
    # Move the zero-initialised queries off zero so that a lost parameter would change the logits.
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def same_logits(a, b):
    idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return torch.equal(a(idx)[0], b(idx)[0])


@pytest.mark.parametrize("name", ["baseline", "block", "full_input_query", "mhc"])
def test_folder_round_trip_gives_identical_logits(tmp_path, name):
    model = tiny(name)
    attnres.save_pretrained(model, tmp_path / "ck", extra={"data": {"name": "stdlib"}, "train": {"seq_len": 32}})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert config["residual"]["name"] == name and config["model"]["d_model"] == 32 and config["train"]["seq_len"] == 32
    loaded, got = attnres.load(tmp_path / "ck", device="cpu")
    assert got == config and not loaded.training
    assert same_logits(model, loaded)


def test_tied_embeddings_and_lone_safetensors_file(tmp_path):
    model = tiny("full", tie_embeddings=True)
    attnres.save_pretrained(model, tmp_path / "ck")
    lone = tmp_path / "elsewhere" / "weights.safetensors"
    lone.parent.mkdir()
    lone.write_bytes((tmp_path / "ck" / "model.safetensors").read_bytes())  # the config rides in its header
    for where in (tmp_path / "ck" / "model.safetensors", tmp_path / "ck" / "config.json", lone):
        loaded, config = attnres.load(where, device="cpu")
        assert config["model"]["tie_embeddings"] is True
        assert loaded.lm_head.weight.data_ptr() == loaded.embed.weight.data_ptr()
        assert same_logits(model, loaded)


def test_torch_training_checkpoint_of_a_compiled_model(tmp_path):
    """A run.py-style .pt checkpoint: weights under 'model' (with torch.compile's prefix) and the
    resolved config (with keys that are not model shape) under 'config'."""
    model = tiny("block")
    state = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    config = {"model": {**vars(model.config), "lr": 3e-3}, "residual": vars(model.residual_config), "train": {"seq_len": 32}}
    torch.save({"model": state, "config": config, "step": 7, "optimizer": {}}, tmp_path / "last.pt")
    with pytest.warns(UserWarning, match="lr"):
        loaded, got = attnres.load(tmp_path / "last.pt", device="cpu")
    assert got["train"]["seq_len"] == 32
    assert same_logits(model, loaded)
    # The run folder itself (checkpoints/<sweep>/<run>/, what `python -m evaluation <folder>`
    # is given): it was "no model.safetensors in this folder".
    with pytest.warns(UserWarning, match="lr"):
        loaded, _ = attnres.load(tmp_path, device="cpu")
    assert same_logits(model, loaded)
    from harness.checkpoint import CHECKPOINT

    assert attnres.io.TRAINING_CHECKPOINT == CHECKPOINT


def test_mlflow_run_artifacts(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    model = tiny("block")
    attnres.save_pretrained(model, tmp_path / "ck")
    client = mlflow.tracking.MlflowClient(uri)
    # Artifacts under tmp_path: the default artifact root is ./mlruns in the working directory.
    run = client.create_run(client.create_experiment("io", artifact_location=(tmp_path / "artifacts").as_uri()))
    run_id = run.info.run_id
    client.log_artifacts(run_id, str(tmp_path / "ck"), "model")
    loaded, config = attnres.load(run_id, device="cpu", tracking_uri=uri)
    assert config["residual"]["name"] == "block" and same_logits(model, loaded)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the environment is enough
    loaded, _ = attnres.load(f"runs:/{run_id}/model")
    assert same_logits(model, loaded)
    with pytest.raises(CheckpointError, match="0123456789abcdef0123456789abcdef"):
        attnres.load("0123456789abcdef0123456789abcdef", tracking_uri=uri)


def test_a_run_id_is_read_from_the_store_run_py_writes_to_from_any_folder(tmp_path, monkeypatch):
    """README: `model, cfg = attnres.load(run_id)`. Outside the project root it read MLflow's own
    default, mlflow.db in the working folder: 'Run ... not found', and an empty mlflow.db left
    there. It reads <project root>/mlflow.db as the evaluation commands do, and a store that does
    not exist is one line."""
    mlflow = pytest.importorskip("mlflow")
    import attnres.io

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    monkeypatch.setattr(attnres.io, "PROJECT_ROOT", project)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(elsewhere)
    run_id = "0123456789abcdef0123456789abcdef"
    with pytest.raises(CheckpointError) as e:
        attnres.load(run_id)
    assert str(e.value).startswith(f"run {run_id}: no MLflow store at sqlite:///{project}/mlflow.db (no such file)")
    assert list(elsewhere.iterdir()) == [] and not (project / "mlflow.db").exists()

    model = tiny("block")
    attnres.save_pretrained(model, tmp_path / "ck")
    client = mlflow.tracking.MlflowClient(f"sqlite:///{project}/mlflow.db")
    run = client.create_run(client.create_experiment("io", artifact_location=(tmp_path / "art").as_uri()))
    client.log_artifacts(run.info.run_id, str(tmp_path / "ck"), "model")
    loaded, _ = attnres.load(run.info.run_id, device="cpu")
    assert same_logits(model, loaded) and list(elsewhere.iterdir()) == []


def test_bad_checkpoints_fail_with_one_line(tmp_path):
    cases = []
    with pytest.raises(CheckpointError) as e:
        attnres.load(tmp_path / "missing")
    cases.append(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors or last.pt") as e:
        attnres.load(tmp_path / "empty")
    cases.append(e)
    attnres.save_pretrained(tiny("block"), tmp_path / "ck")
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    config["model"]["d_model"] = 64
    (tmp_path / "ck" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model.d_model=64≠32") as e:  # the weights' own config says 32
        attnres.load(tmp_path / "ck")
    cases.append(e)
    (tmp_path / "ck" / "config.json").unlink()
    lone = tmp_path / "ck" / "model.safetensors"
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(lone)), str(lone))  # without the config in its header
    (tmp_path / "ck" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="shape|missing") as e:
        attnres.load(tmp_path / "ck")
    cases.append(e)
    config["model"]["d_model"], config["residual"]["name"] = 32, "nope"
    (tmp_path / "ck" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="nope") as e:
        attnres.load(tmp_path / "ck")
    cases.append(e)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt") as e:
        attnres.load(tmp_path / "junk.pt")
    cases.append(e)
    assert all("\n" not in str(c.value) for c in cases)
    with pytest.raises(TypeError, match="DecoderLM"):
        attnres.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "x")


def test_weights_beside_another_models_config_are_refused(tmp_path, capsys):
    """Block and Full have the same tensors: Full weights with a Block config.json loaded strictly
    and were evaluated as Block (exit 0). The weights' own config (in their header) must agree."""
    from evaluation.cli import main

    attnres.save_pretrained(tiny("full"), tmp_path / "full")
    attnres.save_pretrained(tiny("block"), tmp_path / "block")
    assert tiny("full").state_dict().keys() == tiny("block").state_dict().keys()
    (tmp_path / "full" / "config.json").write_bytes((tmp_path / "block" / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match="residual.name=block≠full"):
        attnres.load(tmp_path / "full")
    assert main([str(tmp_path / "full"), "--skip-heldout", "--probe"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json" in err and "residual.name=block≠full" in err, err
    (tmp_path / "full" / "config.json").unlink()  # without it, the header's config is the one read
    assert attnres.load(tmp_path / "full", device="cpu")[1]["residual"]["name"] == "full"


def test_core_import_stays_torch_only():
    code = (
        "import sys, attnres; "
        "heavy = [m for m in ('mlflow', 'safetensors', 'lm_eval', 'harness') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    assert attnres.load is attnres.io.load and attnres.save_pretrained is attnres.io.save_pretrained
