"""A finished or resumable run whose code changed since is not answered silently: one line naming
the changed files and exit 2, unless train.code_change=keep (the recorded result) or retrain
(train it again from step 0, into a new MLflow run)."""
import pytest

from harness import job, provenance
from harness_testing import TINY, compose, isolated, process_state_kept, runs

ARGS = [*TINY, "tracking.log_code=false", "tracking.log_env=false", "tracking.log_model=false",
        "tracking.log_plots=false", "tracking.log_explorer=false"]


def _run(tmp, *extra):
    with process_state_kept():
        return job.run(compose([*ARGS, *extra, *(o for o in isolated(tmp) if not o.startswith("hydra."))]))


@pytest.fixture
def edited(monkeypatch):
    """attnres/model.py as if edited since the run finished (the real file is not touched)."""
    real = provenance.run_code_files()
    assert "attnres/model.py" in real and "harness/train.py" in real and "run.py" in real

    def now():
        return dict(real, **{"attnres/model.py": "0" * 64})

    return now


def test_the_recorded_code_is_every_file_of_model_data_and_loop():
    files = provenance.run_code_files()
    assert {"attnres/model.py", "harness/train.py", "harness/data/batches.py", "run.py"} <= set(files)
    assert not any(name.startswith(("tests/", "analysis/")) for name in files)
    assert provenance.changed_code_files(files, dict(files, **{"run.py": "x"})) == ["run.py"]


def test_a_finished_run_with_changed_code_is_refused_naming_the_file(tmp_path, edited, monkeypatch, capsys):
    first = _run(tmp_path)
    monkeypatch.setattr(provenance, "run_code_files", edited)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        _run(tmp_path)
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "attnres/model.py" in lines[0] and "train.code_change" in lines[0], lines
    assert _run(tmp_path, "train.code_change=keep") == first  # the recorded result, accepted explicitly
    assert len(runs(tmp_path)) == 1
    again = _run(tmp_path, "train.code_change=retrain")
    statuses = sorted(r.info.status for r in runs(tmp_path))
    assert statuses == ["FINISHED", "FINISHED"] and again == first  # (the code did not really change)


def test_unchanged_code_answers_as_before(tmp_path):
    first = _run(tmp_path)
    assert _run(tmp_path) == first and len(runs(tmp_path)) == 1


def test_the_code_change_choice_is_not_part_of_the_run_identity():
    from harness.checkpoint import run_key
    from harness.config import to_plain, validate

    keys = {run_key(to_plain(validate(compose([*TINY, f"train.code_change={c}"])).cfg)) for c in ("ask", "keep", "retrain")}
    assert len(keys) == 1
