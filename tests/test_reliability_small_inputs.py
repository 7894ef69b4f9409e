"""Smaller doors: a key given twice on the command line is said (Hydra applies the last silently),
a file where a folder is read is named as a file, and a run name must be one line."""
import pytest
from omegaconf import OmegaConf

from harness.config import ConfigError, validate
from harness.data import DataError, load_data
from harness.job import repeated_overrides
from harness_testing import TINY, compose, run_cli, runs


def test_repeated_keys_are_found_in_command_line_order():
    found = repeated_overrides(["train.seed=1", "model=tiny", "train.seed=2", "residual=block", "+residual=full",
                                "train.steps=3"])
    assert found == {"train.seed": ["train.seed=1", "train.seed=2"], "residual": ["residual=block", "+residual=full"]}
    assert repeated_overrides(["train.seed=1", "model=tiny"]) == {}


def test_a_repeated_override_is_warned_about_in_one_line_and_the_last_applies(tmp_path):
    result = run_cli([*TINY, "train.steps=2", "tracking.log_model=false", "tracking.log_code=false",
                      "train.seed=1", "train.seed=2"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # (Hydra's log handler writes to stdout)
    said = [line for line in (result.stdout + result.stderr).splitlines() if "train.seed=1 then train.seed=2" in line]
    assert len(said) == 1 and "train.seed=2 applies" in said[0]
    (run,) = runs(tmp_path)
    assert run.data.tags["attnres.seed"] == "2"


@pytest.mark.parametrize("source", ["stdlib", "shards"])
def test_a_file_given_as_the_folder_a_source_reads_is_named_a_file(tmp_path, source):
    path = tmp_path / "corpus.txt"
    path.write_text("some text\n" * 100)
    cfg = validate(compose([*TINY, f"data={source}", f"data.path={path}"])).cfg
    with pytest.raises(DataError, match="is a file|not a folder") as refused:
        load_data(cfg.data, cfg.train.seq_len)
    assert str(path) in str(refused.value) and "empty corpus" not in str(refused.value)


@pytest.mark.parametrize("name", ["two\nlines", "a\rreturn", "a\ttab"])
def test_a_run_name_with_a_control_character_is_refused(name):
    cfg = compose(TINY)
    OmegaConf.update(cfg, "tracking.run_name", name)
    with pytest.raises(ConfigError, match="tracking.run_name") as refused:
        validate(cfg)
    assert "\n" not in str(refused.value)
    OmegaConf.update(cfg, "tracking.run_name", "one line, with spaces")
    validate(cfg)


def test_a_sweeps_experiment_keeps_its_artifacts_beside_the_sqlite_store(tmp_path, monkeypatch):
    """The Optuna sweeper may create the experiment before any job does: its artifacts then go
    beside the database too, not into the ./mlruns of the folder the sweep was started from."""
    from hydra_plugins.attnres_optuna_sweeper._study_runs import StudyTracker

    monkeypatch.chdir(tmp_path)
    (tmp_path / "store").mkdir()
    tracker = StudyTracker(f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}", "study", plots=False)
    location = tracker.client.get_experiment(tracker.experiment_id).artifact_location
    assert location == (tmp_path / "store" / "mlruns" / "study").as_uri()
