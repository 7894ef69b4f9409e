"""A run whose loss turns NaN (a learning rate of 1e30, no clipping: real divergence, no mock) in
a multirun: it ends FAILED with the step and the reason, its last good checkpoint stays, and the
multirun goes on with the next job, which finishes."""
import torch

from harness_testing import TINY, run_cli, runs

FAST = ["optim.grad_clip=0", "train.checkpoint_interval=1", "tracking.log_code=false", "tracking.log_env=false", "tracking.log_model=false",
        "tracking.log_plots=false"]


def test_a_diverging_job_fails_with_step_and_reason_and_the_multirun_goes_on(tmp_path):
    result = run_cli(["-m", "optim.lr=1e30,0.003", *TINY, *FAST], tmp_path)
    assert "non-finite" in result.stderr
    jobs = {r.data.params["optim.lr"]: r for r in runs(tmp_path) if r.data.tags.get("attnres.role") == "job"}
    diverged, healthy = jobs["1e+30"], jobs["0.003"]
    assert diverged.info.status == "FAILED" and diverged.data.tags["attnres.status"] == "FAILED"
    step = int(diverged.data.tags["attnres.failure_step"])
    assert "non-finite" in diverged.data.tags["attnres.failure"]
    assert healthy.info.status == "FINISHED"  # the next job ran after the failure
    (parent,) = [r for r in runs(tmp_path) if r.data.tags.get("attnres.role") == "parent"]
    assert parent.info.status == "FAILED"  # not every child finished
    kept = [torch.load(p, weights_only=True) for p in (tmp_path / "ckpt").rglob("last.pt")
            if torch.load(p, weights_only=True)["config"]["optim"]["lr"] == 1e30]
    (state,) = kept
    assert 0 < state["step"] < step  # a checkpoint from before the divergence is kept...
    assert all(torch.isfinite(v).all() for v in state["model"].values())  # ...and its weights are finite


def test_the_divergence_error_survives_pickling_with_its_step():
    """Launchers send a failed job's exception back pickled; NonFiniteLoss takes (message, step)."""
    import pickle

    from harness.train import NonFiniteLoss

    err = pickle.loads(pickle.dumps(NonFiniteLoss("non-finite training loss (nan) at step 7", 7)))
    assert type(err) is NonFiniteLoss and err.step == 7 and str(err) == "non-finite training loss (nan) at step 7"
