"""Robustness (python -m analysis robustness): each comparison re-judged at the settings a
declaration names; the verdict rule on synthetic runs, the filter that keeps each setting's runs
apart, bad declarations, the report section, and one tiny study whose stored runs are found, not
trained again."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from analysis import robustness as rob
from analysis.__main__ import main
from analysis.adaptive import Plan
from analysis.runs import _tidy
from analysis.significance import seeds_needed_paired
from harness_testing import ROOT

SEEDS = 4
PLAN = Plan((("block", "baseline"),), start=SEEDS, step=1, max_seeds=SEEDS, half_width=0.03)
NOISE = np.array([0.01, -0.02, 0.015, -0.005])  # per seed, shared by both arms at a setting


def _decl(*settings: rob.Setting) -> rob.Declaration:
    return rob.Declaration("study_cpu", "study_cpu", "rob", PLAN.comparisons,
                           (rob.Setting(), *settings), PLAN)


def _rows(diffs, sweep="rob", base=2.0, **knobs) -> list[dict]:
    """Baseline and block at seeds 0-3, block − baseline = diffs[seed], at the knob params given."""
    rows = []
    for s in range(SEEDS):
        for variant, x in (("baseline", base + NOISE[s]), ("block", base + NOISE[s] + diffs[s])):
            rows.append({"run_id": f"{sweep}-{variant}-{s}-{sorted(knobs.items())}", "sweep": sweep,
                         "experiment": sweep,
                         "variant": variant, "seed": s, "status": "FINISHED", "final_val_loss": x,
                         "model": "default", "layers": 16, "tokens": 1e6, "lr": 3e-3, **knobs})
    return rows


def _frame(*groups) -> pd.DataFrame:
    return _tidy([r for g in groups for r in g])


def _outcome(runs, *settings) -> str:
    decl = _decl(*settings)
    (out,) = rob.survival(rob.judge(runs, decl), decl.plan)["outcome"]
    return out


LOWER = [-0.10, -0.12, -0.09, -0.11]  # block clearly below the baseline
HIGHER = [0.10, 0.12, 0.09, 0.11]
NOISY = [-0.3, 0.25, -0.2, 0.28]  # interval wide and across 0
FLAT = [0.001, -0.001, 0.0005, -0.0005]  # tight around 0: resolves by width, with no sign
E5, E8 = rob.Setting("model.norm_eps", 1e-5), rob.Setting("model.norm_eps", 1e-8)


def test_a_verdict_survives_when_every_setting_resolves_with_the_defaults_sign():
    runs = _frame(_rows(LOWER, "study_cpu"), _rows(LOWER, norm_eps="1e-05"),
                  _rows([d + 0.02 for d in LOWER], norm_eps="1e-08"))
    assert _outcome(runs, E5, E8) == "survives"


def test_one_opposite_setting_reverses_it_even_when_another_is_open():
    runs = _frame(_rows(LOWER, "study_cpu"), _rows(NOISY, norm_eps="1e-05"),
                  _rows(HIGHER, norm_eps="1e-08"))
    assert _outcome(runs, E5, E8).startswith("reverses at model.norm_eps=1e-08")


def test_a_setting_without_a_sign_leaves_it_undecided_with_seeds_sized_by_the_target():
    """Resolved by width around 0 is not the default's sign; the seeds it needs come from the
    target 0.03 and the setting's σ of differences, not from its (near 0) observed effect."""
    runs = _frame(_rows(LOWER, "study_cpu"), _rows(FLAT, norm_eps="1e-05"), _rows(LOWER, norm_eps="1e-08"))
    out = _outcome(runs, E5, E8)
    assert out.startswith("undecided at model.norm_eps=1e-05: 4 seeds") and "1e-08" not in out
    k = seeds_needed_paired(float(np.std(FLAT, ddof=1)), 0.03, PLAN.look_level)
    assert f"needs about {k:.0f} seeds to detect 0.03" in out


def test_no_verdict_at_the_default_is_undecided_there_whatever_the_settings_say():
    runs = _frame(_rows(NOISY, "study_cpu"), _rows(HIGHER, norm_eps="1e-05"))
    out = _outcome(runs, E5)
    assert out.startswith("undecided at default") and "reverses" not in out


def test_runs_of_another_setting_or_recipe_never_count_at_a_setting():
    """The study's runs at the default; runs that changed two knobs, another learning rate or a
    different budget must not join it (they say the opposite, so mixing them would flip it)."""
    runs = _frame(_rows(LOWER, "study_cpu"), _rows(LOWER, norm_eps="1e-05"),
                  _rows(HIGHER, "study_cpu", init_std="0.05", norm_eps="1e-05"),
                  _rows(HIGHER, "study_cpu", lr=1e-2), _rows(HIGHER, "study_cpu", tokens=2e6)[:6])
    table = rob.judge(runs, _decl(E5))
    assert list(table["seeds"]) == [4, 4] and (table["sign"] == -1).all()
    assert table["diff"].to_numpy() == pytest.approx([np.mean(LOWER)] * 2, abs=1e-12)
    assert rob.setting_of(runs.iloc[-1]) == rob.Setting()
    assert rob.setting_of(_tidy(_rows(LOWER, init_std="0.05", norm_eps="1e-05")).iloc[0]) is None


def test_unset_knobs_read_as_the_value_they_ran_at():
    """A per-family epsilon logged as None is model.norm_eps; a snapshot without the columns
    (exported before them) ran at the defaults."""
    new = _tidy([{"run_id": "a", "experiment": "e", "norm_eps": "1e-05", "prenorm_eps": "None", "final_norm_eps": "1e-07",
                  "init_std": "0.1", "embed_std": "None"}]).iloc[0]
    assert (new["prenorm_eps"], new["residual_norm_eps"], new["final_norm_eps"]) == (1e-5, 1e-5, 1e-7)
    assert new["embed_std"] == 0.1
    old = _tidy([{"run_id": "b", "experiment": "e"}]).iloc[0]
    assert [old[c] for c in rob.KNOB_COLUMNS if c != "lr"] == [1e-6] * 4 + [0.02, 0.02]
    assert rob.setting_of({**old.to_dict(), "lr": 3e-3}) == rob.Setting()


def test_the_ablation_never_takes_runs_at_another_epsilon_as_seeds():
    from analysis.report import _ablation_runs

    fin = _frame(_rows(LOWER, "study_cpu"), _rows(HIGHER, "study_cpu", norm_eps="1e-05")[:6])
    chosen, note = _ablation_runs(fin.assign(section="ablation"))
    assert len(chosen) == 2 * SEEDS and (chosen["norm_eps"] == 1e-6).all() and "norm_eps" in note


# --------------------------------------------------------------------------------------------
GOOD = """recipe: study_cpu
experiment: rob_test
comparisons: [block:baseline]
knobs: {model.norm_eps: [1.0e-05]}
seeds: {start: 2, step: 1, max: 2}
"""


@pytest.mark.parametrize("change", [
    ("model.norm_eps: [1.0e-05]", "model.norm_epsilon: [1.0e-05]"),  # unknown knob
    ("[1.0e-05]", "[-1.0e-05]"),  # out of range
    ("[1.0e-05]", "[0.5]"),  # out of range
    ("[1.0e-05]", "[1.0e-06]"),  # the default itself
    ("block:baseline", "blocc:baseline"),  # unknown variant
    ("recipe: study_cpu\n", ""),  # no recipe
    ("recipe: study_cpu", "recipe: study_gpu"),  # no such recipe
    ("start: 2", "start: 1"),  # one seed gives no interval
    ("seeds:", "overrides: [model.no_such_key=3]\nseeds:"),  # runs that do not compose
])
def test_a_bad_declaration_exits_2_in_one_line_before_anything_trains(tmp_path, capsys, change):
    path = tmp_path / "d.yaml"
    path.write_text(GOOD.replace(*change))
    assert GOOD.replace(*change) != GOOD
    rc = main(["robustness", "--declare", str(path), "--train", "--tracking-uri",
               f"sqlite:///{tmp_path / 'm.db'}", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "out").exists()


def test_the_committed_declaration_is_valid_and_its_recipe_trains_the_study():
    decl = rob.load_declaration(ROOT / "sweeps" / "robustness" / "norm_eps.yaml")
    assert decl.recipe == decl.study_sweep == "study_cpu" and decl.settings[0] == rob.Setting()
    assert decl.run_overrides(decl.settings[1])[0] == "+sweep=study_cpu"
    assert "model.norm_eps=1.1920929e-07" in decl.run_overrides(decl.settings[1])


def test_the_report_gets_a_section_that_says_what_survives(tmp_path):
    """Only with robustness runs: without them (tests/test_results_snapshot.py) the report is as it was."""
    from analysis import sections as sec
    from analysis.report import _write_report, Options
    from analysis.runs import RunSet

    runs = _frame(_rows(LOWER, "study_cpu"), _rows(HIGHER, "robustness_eps", norm_eps="1e-05"))
    section = sec.robustness_section(runs, tmp_path)
    assert "reverses at model.norm_eps=1e-05" in section.text
    assert (tmp_path / "tables" / "robustness.csv").is_file()
    _write_report(RunSet(runs), tmp_path, Options(n_boot=0))
    assert f"## 5. {sec.robustness.TITLE}" in (tmp_path / "REPORT.md").read_text()


# --------------------------------------------------------------------------------------------
TINY_RUN = ["model=tiny", "model.layers=2", "train.steps=3", "train.seq_len=32", "train.batch_size=4",
            "train.eval_interval=3", "train.eval_batches=1", "train.threads=1", "train.progress=false",
            "data.max_bytes=300000"]


def _stored(tmp_path, grid: list[dict]) -> str:
    """Tiny runs of ``grid`` (override dicts) trained in this process into tmp_path's store."""
    from harness import job
    from harness_testing import compose, process_state_kept

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    for cell in grid:
        with process_state_kept():
            job.run(compose(["+sweep=study_cpu", "sweep.name=rob_test", *TINY_RUN, f"tracking.uri={uri}",
                             f"train.checkpoint_dir={tmp_path / 'ck'}", *(f"{k}={v}" for k, v in cell.items())]))
    return uri


def test_runs_already_in_the_store_at_a_setting_are_found_not_trained(tmp_path, capsys, monkeypatch):
    """The runs at norm_eps 1e-5 are in a real store, those at the default in a snapshot: --train
    finds every seed the plan needs and launches nothing."""
    from analysis import adaptive
    from analysis.runs import RunSet, export_snapshot, load_runs

    grid = [{"residual": v, "train.seed": s, "model.norm_eps": "1e-05"} for v in ("baseline", "block") for s in (0, 1)]
    uri = _stored(tmp_path, grid)
    default = load_runs(uri).assign(sweep="study_cpu", norm_eps=1e-6, prenorm_eps=1e-6, residual_norm_eps=1e-6,
                                    final_norm_eps=1e-6, run_key=None)
    default["run_id"] += "-default"
    default["final_val_loss"] += np.where(default["variant"] == "block", -0.5, 0.0)  # a verdict to keep
    export_snapshot(RunSet(default), tmp_path / "study.csv")
    monkeypatch.setattr(adaptive, "_launch", lambda *a, **k: pytest.fail(f"trained {a[0]}"))
    decl = tmp_path / "d.yaml"
    decl.write_text(GOOD + f"overrides: {TINY_RUN}\n")
    rc = main(["robustness", "--declare", str(decl), "--snapshot", str(tmp_path / "study.csv"), "--train",
               "--tracking-uri", uri, "--out", str(tmp_path / "out")])
    assert rc == 0 and "0 runs trained" in capsys.readouterr().out
    table = pd.read_csv(tmp_path / "out" / "robustness.csv")
    assert list(table["setting"]) == ["default", "model.norm_eps=1e-05"] and list(table["seeds"]) == [2, 2]
    assert table["diff"][0] == pytest.approx(table["diff"][1] - 0.5, abs=1e-5)  # the CSV holds 6 digits


@pytest.mark.slow
def test_only_the_missing_runs_are_trained_with_the_stored_runs_keys(tmp_path):
    """Six of the eight runs (baseline, block × seeds 0, 1 × default, norm_eps 1e-5) are in the
    store; --train trains the two of seed 1 at 1e-5 alone, and a second call nothing."""
    import mlflow

    grid = [{"residual": v, "train.seed": s, **e} for v in ("baseline", "block") for s in (0, 1)
            for e in ({}, {"model.norm_eps": "1e-05"}) if s == 0 or not e]
    uri = _stored(tmp_path, grid)
    decl = tmp_path / "d.yaml"
    mine = [*TINY_RUN, f"train.checkpoint_dir={tmp_path / 'ck'}", f"hydra.sweep.dir={tmp_path / 'ms'}"]
    decl.write_text(GOOD + f"overrides: {mine}\n")
    cmd = [sys.executable, "-m", "analysis", "robustness", "--declare", str(decl), "--train", "--lanes", "1",
           "--tracking-uri", uri, "--out", str(tmp_path / "out")]
    env = {k: v for k, v in __import__("os").environ.items() if k != "MLFLOW_TRACKING_URI"}
    for trained in (2, 0):
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"{trained} runs trained" in done.stdout
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("rob_test").experiment_id])
    keys = {(r.data.params["residual.name"], r.data.params["train.seed"], r.data.params["model.norm_eps"])
            for r in runs if r.data.tags.get("attnres.role") == "job"}
    assert len(keys) == 8 and ("block", "1", "1e-05") in keys
    assert list(pd.read_csv(tmp_path / "out" / "robustness.csv")["seeds"]) == [2, 2]


def test_a_setting_short_of_its_first_look_shows_its_pairs_but_no_verdict():
    runs = _frame(_rows(LOWER, "study_cpu"), _rows(LOWER, norm_eps="1e-05")[:4])  # seeds 0, 1
    table = rob.judge(runs, _decl(E5))
    row = table[table["setting"] == E5.label].iloc[0]
    assert row["seeds"] == 2 and np.isnan(row["sign"]) and row["verdict"] == "not started"
    assert row["diff"] == pytest.approx(np.mean(LOWER[:2]), abs=1e-12)
    assert _outcome(runs, E5).startswith("undecided at model.norm_eps=1e-05: 2 seeds")


def test_the_full_section_takes_its_verdict_from_the_robustness_runs(tmp_path):
    """Full's section hears how full − baseline fared over the nuisance settings: a setting that
    resolves the other way makes its words say the gap reverses, never a finding."""
    from analysis import sections as sec
    from analysis.report import _write_report, Options
    from analysis.runs import RunSet

    def as_full(rows):
        return [{**r, "variant": "full", "run_id": r["run_id"].replace("block", "full")} if r["variant"] == "block"
                else r for r in rows]

    runs = _frame(as_full(_rows(HIGHER, "study_cpu")), as_full(_rows(LOWER, "robustness_eps", norm_eps="1e-10")))
    assert sec.robustness.outcome(runs, "full") == "reverses"
    assert sec.robustness.outcome(_frame(as_full(_rows(HIGHER, "study_cpu"))), "full") is None
    _write_report(RunSet(runs), tmp_path, Options(n_boot=0))
    report = (tmp_path / "REPORT.md").read_text()
    part = report.split(sec.full.TITLE, 1)[1].split("\n## ", 1)[0]
    assert "opposite sign" in part and "not varied in these runs" not in part
    # and the summary gives the ablation's full − baseline no verdict: it does not survive its knob
    row = next(l for l in report.splitlines() if l.startswith("| Ablation") and "Full AttnRes beats the baseline" in l)
    assert row.rstrip(" |").endswith("inconclusive") and "other sign" in row
