"""The report's diagnosis of Full: which of fault / recipe / finding the runs support, from run
frames built here (the numbers are chosen so that each rule is the one that decides)."""
import numpy as np
import pandas as pd
import pytest

from analysis.sections.full import diagnose

RECIPE = dict(model="default", layers=16, tokens=1_000_000, num_blocks=np.nan)


def run(variant, seed, loss, lr=3e-3, sweep="study_cpu", block_size=4):
    return dict(run_id=f"{sweep}-{variant}-{block_size}-{lr:g}-{seed}", sweep=sweep, variant=variant,
                seed=seed, lr=lr, final_val_loss=loss, block_size=block_size, **RECIPE)


def frames(full_at_low_lr=0.05, s1_gap=0.0, scatter=0.0, baseline_fails_high=0.0):
    base = {0: 1.70, 1: 1.69, 2: 1.72, 3: 1.68}
    ablation = pd.DataFrame([run(v, s, base[s] + d + 0.01 * (s % 2) + (v == "full") * scatter * (-1) ** (s // 2))
                             for s in base for v, d in (("baseline", 0.0), ("block", -0.07), ("full", 0.07))])
    tuned = pd.DataFrame([run(v, s, base[s] + d + (v == "baseline" and lr == 1e-2) * baseline_fails_high,
                              lr=lr, sweep="tuned_lr")
                          for s in (0, 1) for lr, fd in ((1e-3, full_at_low_lr), (1e-2, 0.2))
                          for v, d in (("baseline", 0.03), ("block", -0.04), ("full", 0.03 + fd))])
    full_loss = ablation[ablation.variant == "full"].set_index("seed")["final_val_loss"]
    block_size = pd.DataFrame([run("block", s, full_loss[s] + s1_gap, sweep="block_size", block_size=1)
                               for s in (0, 1)]
                              + [run("block", s, base[s] - 0.07, sweep="block_size", block_size=8) for s in (0, 1)])
    steps = [25, 50, 75]
    histories = pd.DataFrame([(r.run_id, "depth/entropy", st, (0.95 if r.variant == "full" else 0.6) - 0.001 * st / 25)
                              for r in ablation.itertuples() if r.variant in ("block", "full") for st in steps],
                             columns=["run_id", "key", "step", "value"])
    return ablation, tuned, ablation, block_size, histories


@pytest.mark.parametrize("full_at_low_lr, s1_gap, nuisance, kind", [
    (0.05, 0.0, "survives", "finding"),   # above at every rate; S = 1 equivalent; robust to ε, init
    (0.05, 0.0, None, "undecided"),       # the same, never varied over its nuisance settings
    (0.05, 0.0, "reverses", "undecided"),  # the sign flips at another ε
    (-0.10, 0.0, None, "recipe"),         # below the baseline at lr 1e-3
    (0.05, 0.02, "survives", "finding"),  # 0.02 from Full, inside the ±0.03 equivalence margin
    (0.05, -0.12, None, "fault"),         # Block at S = 1 lands beside Block: Full's own path differs
    (-0.10, -0.12, None, "fault"),        # a fault outranks the learning rate
])
def test_the_rule_that_decides(tmp_path, full_at_low_lr, s1_gap, nuisance, kind):
    got, text, files = diagnose(*frames(full_at_low_lr, s1_gap), tmp_path, nuisance)
    assert got == kind
    table = pd.read_csv(tmp_path / "tables" / "full_lr.csv")
    assert sorted(table["lr"]) == pytest.approx([1e-3, 3e-3, 1e-2], rel=1e-12)
    assert (table["seeds"] == 2).all()  # only seeds 0, 1 were trained at every rate
    low = table.set_index("lr").loc[1e-3]
    assert low["full − baseline"] == pytest.approx(full_at_low_lr, abs=1e-12)  # float64 means
    assert (tmp_path / "figures" / "depth_entropy.png").is_file()


def test_entropy_part_compares_full_with_block(tmp_path):
    ablation, tuned, extra, block_size, histories = frames()
    _, text, _ = diagnose(ablation, tuned, extra, block_size, histories, tmp_path)
    assert "full 0.947" in text and "block 0.597" in text  # last step's mean over 4 runs each


def test_missing_parts_leave_it_undecided(tmp_path):
    ablation, tuned, extra, block_size, histories = frames()
    kind, _, _ = diagnose(ablation, tuned.iloc[:0], extra, block_size.iloc[:0], histories.iloc[:0], tmp_path)
    assert kind == "undecided"
    kind, _, _ = diagnose(ablation[ablation.variant != "full"], tuned, extra, block_size, histories, tmp_path)
    assert kind == "undecided"


def test_a_grid_within_the_ablations_noise_decides_nothing(tmp_path):
    """Full's same-seed differences in the ablation scatter by ±0.2: two seeds per grid point
    cannot place Full above or below the baseline at any rate, so the rule does not say *finding*."""
    kind, _, _ = diagnose(*frames(full_at_low_lr=0.05, scatter=0.2), tmp_path)
    assert kind == "undecided"
    table = pd.read_csv(tmp_path / "tables" / "full_lr.csv")
    assert (table["±"] > table["full − baseline"].abs()).all()


def test_a_rate_where_the_baseline_fails_is_not_one_where_full_wins(tmp_path):
    """The baseline 0.5 nats worse at lr 1e-2 puts Full below it there; each at its own best rate
    Full still trails, so the rule says *finding*, not *recipe*."""
    kind, _, _ = diagnose(*frames(baseline_fails_high=0.5), tmp_path, "survives")
    assert kind == "finding"
    table = pd.read_csv(tmp_path / "tables" / "full_lr.csv").set_index("lr")
    assert table.loc[1e-2, "full − baseline"] < 0
