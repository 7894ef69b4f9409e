"""A multirun of three tiny variants: one parent, three finished children, RUN_SCHEMA.md's records."""
import json
import math
from pathlib import Path

import pytest

from harness import dynamics
from harness_testing import TINY, artifacts, client, metric_steps, run_cli, runs

VARIANTS = ("baseline", "block", "full")

PARAMS = [
    "residual.name", "residual.block_size", "residual.num_blocks", "residual.window", "residual.heads",
    "model.name", "model.d_model", "model.layers", "model.n_heads", "model.n_kv_heads", "model.d_ff",
    "train.seed", "train.tokens", "train.batch_size", "train.seq_len", "optim.lr", "data.name", "sweep.name",
    "count.params_total", "count.params_embedding", "count.params_non_embedding", "count.params_residual",
    "count.flops_per_token",
]
METRICS = [
    "train/loss", "train/lr", "train/tokens", "train/flops", "train/tokens_per_s", "val/loss",
    "val/loss_by_tokens", "final/val_loss", "final/val_loss_best", "final/tokens", "final/flops",
    "final/train_seconds", "depth/output_rms/block_00", "depth/output_rms/block_01",
    "depth/grad_norm/block_00", "depth/grad_norm/block_01",
]
ARTIFACTS = [
    "config/resolved.yaml", "code/git_commit.txt", "code/git_diff.patch", "env/pip_freeze.txt",
    "data/fingerprint.json", "plots/depth_weights.png", "plots/magnitudes.png",
    "instrumentation/step_0000003.json", "instrumentation/step_0000006.json",
    "model/model.safetensors", "model/config.json",
]
TAGS = ["attnres.variant", "attnres.model", "attnres.seed", "attnres.sweep", "attnres.status",
        "attnres.data_fingerprint"]


@pytest.fixture(scope="module")
def multirun(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multirun")
    result = run_cli(["-m", f"residual={','.join(VARIANTS)}", *TINY], tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp


def test_one_parent_three_finished_children(multirun):
    all_runs = runs(multirun)
    parents = [r for r in all_runs if r.data.tags.get("attnres.role") == "parent"]
    children = [r for r in all_runs if r.data.tags.get("attnres.role") == "job"]
    assert len(parents) == 1 and len(children) == 3 and len(all_runs) == 4
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["attnres.status"] == "FINISHED"
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    assert sorted(c.data.params["residual.name"] for c in children) == sorted(VARIANTS)
    for c in children:
        assert c.info.status == "FINISHED"
        assert c.data.tags["attnres.status"] == "FINISHED"
    exp = client(multirun).get_experiment_by_name("default")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


def test_children_carry_params_metrics_tags_and_artifacts(multirun):
    for run in (r for r in runs(multirun) if r.data.tags.get("attnres.role") == "job"):
        missing = [p for p in PARAMS if p not in run.data.params]
        assert not missing, missing
        assert not [m for m in METRICS if m not in run.data.metrics]
        assert not [t for t in TAGS if t not in run.data.tags]
        assert run.data.tags["attnres.variant"] == run.data.params["residual.name"]
        assert run.data.params["model.layers"] == "2"
        assert not [a for a in ARTIFACTS if a not in artifacts(multirun, run.info.run_id)]
        rid = run.info.run_id
        assert metric_steps(multirun, rid, "train/loss") == [1, 2, 3, 4, 5, 6]
        assert metric_steps(multirun, rid, "val/loss") == [3, 6]
        tokens_per_step = 4 * 32
        assert metric_steps(multirun, rid, "val/loss_by_tokens") == [3 * tokens_per_step, 6 * tokens_per_step]
        flops = client(multirun).get_metric_history(rid, "train/flops")[-1].value
        assert flops == pytest.approx(6 * tokens_per_step * float(run.data.params["count.flops_per_token"]))
        assert run.data.metrics["final/val_loss"] == client(multirun).get_metric_history(rid, "val/loss")[-1].value


def test_instrumentation_json_follows_the_schema(multirun):
    c = client(multirun)
    for run in (r for r in runs(multirun) if r.data.tags.get("attnres.role") == "job"):
        dst = multirun / "downloads" / run.info.run_id
        dst.mkdir(parents=True)
        local = c.download_artifacts(run.info.run_id, "instrumentation/step_0000006.json", str(dst))
        rec = json.loads(Path(local).read_text())
        assert rec["step"] == 6
        assert rec["sublayer_kind"] == ["attn", "mlp", "attn", "mlp", "out"]
        assert len(rec["output_rms_sublayer"]) == 4
        assert len(rec["output_rms_block"]) == 2 and len(rec["grad_norm_block"]) == 2
        entropy = c.get_metric_history(run.info.run_id, "depth/entropy")
        if run.data.params["residual.name"] == "baseline":
            assert rec["depth_weights"] is None and rec["depth_entropy"] is None and not entropy
        else:  # readers: 4 sublayers + the output read
            assert len(rec["depth_weights"]) == 5 and len(rec["depth_entropy"]) == 5
            assert [m.step for m in entropy] == [3, 6] and all(0.0 <= m.value <= 1.0 + 1e-9 for m in entropy)
            assert entropy[-1].value == pytest.approx(dynamics.relative_entropy(rec), rel=1e-12)


def test_relative_entropy_of_a_record():
    """Readers that see one source are left out; each other reader's entropy is divided by the log
    of the sources it sees (NaN = not visible): uniform is 1, one source 0."""
    nan, ln2, ln3 = float("nan"), math.log(2), math.log(3)
    rec = {"depth_weights": [[1, nan, nan], [0.5, 0.5, nan], [0.2, 0.3, 0.5]], "depth_entropy": [0.0, ln2, 0.0]}
    assert dynamics.relative_entropy(rec) == pytest.approx(0.5, abs=1e-15)
    rec["depth_entropy"] = [0.0, ln2 / 2, ln3]
    assert dynamics.relative_entropy(rec) == pytest.approx(0.75, abs=1e-15)
    assert dynamics.relative_entropy({"depth_weights": None, "depth_entropy": None}) is None
    assert dynamics.relative_entropy({"depth_weights": [[1.0]], "depth_entropy": [0.0]}) is None


def test_runs_with_depth_weights_carry_the_page_the_explorer_command_makes(multirun, tmp_path):
    """Issue 9: the depth-map explorer is logged into every run that has depth weights, so it opens
    in the MLflow UI after training; it is the page `python -m evaluation.explorer <run id>` writes."""
    from evaluation.explorer import main as explorer

    c = client(multirun)
    for run in (r for r in runs(multirun) if r.data.tags.get("attnres.role") == "job"):
        rid, variant = run.info.run_id, run.data.params["residual.name"]
        logged = "explorer/depth.html" in artifacts(multirun, rid, "explorer")
        assert logged == (variant != "baseline"), variant
        if logged:
            page = Path(c.download_artifacts(rid, "explorer/depth.html", str(tmp_path))).read_text()
            out = tmp_path / f"{variant}.html"
            assert explorer([rid, "--tracking-uri", f"sqlite:///{multirun / 'mlflow.db'}", "--out", str(out), "--no-log"]) == 0
            assert page == out.read_text()


def test_rerunning_the_multirun_reuses_its_parent_and_trains_nothing(multirun):
    before = {r.info.run_id for r in runs(multirun)}
    result = run_cli(["-m", f"residual={','.join(VARIANTS)}", *TINY], multirun)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("already finished") == 3
    after = runs(multirun)
    assert {r.info.run_id for r in after} == before  # same parent, same children, no new run
    (parent,) = [r for r in after if r.data.tags.get("attnres.role") == "parent"]
    assert parent.info.status == "FINISHED"


def test_the_run_and_its_checkpoint_load_back_as_the_trained_model(multirun):
    import torch

    import attnres

    child = next(r for r in runs(multirun) if r.data.params.get("residual.name") == "block")
    from_run, config = attnres.load(child.info.run_id, device="cpu", tracking_uri=f"sqlite:///{multirun / 'mlflow.db'}")
    assert config["residual"]["name"] == "block" and config["train"]["seq_len"] == 32
    assert config["data"]["name"] == "stdlib"
    (ckpt,) = [p for p in (multirun / "ckpt").rglob("last.pt") if p.parent.name.startswith("block-")]
    from_ckpt, _ = attnres.load(ckpt, device="cpu")
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(from_run(x)[0], from_ckpt(x)[0])
