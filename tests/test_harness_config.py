"""The config: every group composes and validates; bad input is one line, exit 2, nothing written."""
import pytest
from omegaconf import OmegaConf

from attnres import VARIANTS
from harness.config import ConfigError, validate
from harness_testing import ROOT, TINY, compose, run_cli, sweep_jobs

SWEEPS = sorted(p.stem for p in (ROOT / "sweeps").glob("*.yaml"))


def test_default_config_validates_into_a_cpu_plan():
    spec = validate(compose([]))
    assert spec.cfg.model.name == "default" and spec.cfg.residual.name == "baseline"
    assert spec.cfg.model.vocab_size == spec.cfg.data.vocab_size == 256
    assert spec.steps * spec.tokens_per_step >= spec.cfg.train.tokens
    assert spec.counts["count.params_total"] > 0 and spec.counts["count.flops_per_token"] > 0


def test_every_variant_has_a_residual_file_that_validates():
    """One file per variant, named as it; any other file is a setting of one of them (block_n8:
    Block with about 8 blocks) and validates as that variant."""
    files = sorted(p.stem for p in (ROOT / "conf" / "residual").glob("*.yaml"))
    assert set(VARIANTS) <= set(files)
    for name in files:
        spec = validate(compose([f"residual={name}", "model.layers=16"]))
        assert spec.cfg.residual.name == (name if name in VARIANTS else "block"), name
    assert sorted(set(files) - set(VARIANTS)) == ["block_n4", "block_n8"]


@pytest.mark.parametrize("preset,d_model,layers,lr,batch", [
    ("194m", 896, 12, 2.99e-3, 192), ("241m", 960, 13, 2.80e-3, 256), ("296m", 1024, 14, 2.50e-3, 320),
    ("436m", 1168, 16, 2.20e-3, 384), ("528m", 1264, 17, 2.02e-3, 432),
])
def test_paper_presets_are_dense_models_with_the_papers_shape_lr_and_batch(preset, d_model, layers, lr, batch):
    spec = validate(compose([f"model={preset}", "train.device=cpu"]))
    m = spec.cfg.model
    assert (m.d_model, m.layers, spec.cfg.optim.lr, spec.cfg.train.batch_size) == (d_model, layers, lr, batch)
    assert m.d_ff == pytest.approx(4 * d_model, rel=0.02)  # dense: ≈ 4·d_model (≈ 9 experts' width)
    assert spec.cfg.train.seq_len == m.max_seq_len == 8192
    assert spec.accum_steps == batch // spec.micro_batch_size


def test_overrides_reach_the_typed_objects():
    spec = validate(compose(["residual=block", "residual.num_blocks=4", "model.layers=16", "optim=muon",
                             "schedule=wsd", "train.batch_size=32", "train.micro_batch_size=8",
                             "train.steps=10"]))
    assert spec.cfg.residual.num_blocks == 4 and spec.accum_steps == 4 and spec.steps == 10
    assert spec.cfg.optim.name.value == "muon" and spec.cfg.schedule.name.value == "wsd"


def test_residual_knobs_the_variant_does_not_read_leave_the_run_as_it_was():
    """`-m residual=baseline,block residual.block_size=8` compares Block at S = 8 with the baseline:
    the baseline's run is the plain baseline (its record, key and name), trained once whatever S
    the grid sets; the knob is reported, and kept where the variant reads it."""
    from harness.checkpoint import run_key
    from harness.config import to_plain

    plain = validate(compose(["residual=baseline"]))
    spec = validate(compose(["residual=baseline", "residual.block_size=8", "residual.gate_init=0.5"]))
    assert spec.ignored == {"block_size": 8, "gate_init": 0.5}
    assert to_plain(spec.cfg) == to_plain(plain.cfg) and run_key(to_plain(spec.cfg)) == run_key(to_plain(plain.cfg))
    block = validate(compose(["residual=block", "residual.block_size=8", "model.layers=16"]))
    assert block.ignored == {} and block.cfg.residual.block_size == 8


def test_a_run_says_which_residual_knobs_its_variant_does_not_read(tmp_path):
    result = run_cli([*TINY, "residual=full", "residual.window=3"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "does not read" in line]
    assert len(lines) == 1 and "residual=full does not read residual.window=3 (read by sliding_window)" in lines[0]
    assert "is a grid over" not in result.stdout + result.stderr  # no sweep file: nothing about -m


def test_a_sweep_file_without_multirun_says_it_trains_one_run(tmp_path):
    """`python run.py +sweep=ablation` (no -m) trained the grid's first member and exited 0 without
    a word; the grid needs -m. One line; the run itself still trains (one job of a sweep is a run
    someone may want)."""
    from harness.job import sweep_needs_multirun

    result = run_cli([*TINY, "+sweep=ablation"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "is a grid over" in line]
    assert len(lines) == 1 and "sweep ablation is a grid over residual, train.seed: run it with -m" in lines[0], lines
    assert sweep_needs_multirun(OmegaConf.create({"sweeper": {"params": None}}), "default") is None


@pytest.mark.parametrize("overrides,message", [
    (["residual=block", "residual.num_blocks=3", "model.layers=4"], "residual.num_blocks=3 must divide"),
    (["residual.name=nope"], "allowed: baseline, denseformer"),
    (["train.batch_size=16", "train.micro_batch_size=5"], "train.micro_batch_size=5 must divide"),
    (["train.device=tpu"], "train.device='tpu'"),
    (["model.n_heads=3"], "model.n_heads=3 must divide model.d_model"),
    (["train.seq_len=64", "model.max_seq_len=32"], "train.seq_len=64 exceeds model.max_seq_len=32"),
    # model.max_seq_len is ${train.seq_len}: the line names the key the user set too
    (["train.seq_len=0"], r"model.max_seq_len must be a positive integer, got 0 \(.*it comes from train.seq_len\)"),
    # a resolver's own line, without OmegaConf's "raised while resolving ... full_key: ..." around it
    (["+sweep=block_size", "sweep.cell=S3"], r"^sweep.cell='S3' is not a cell of this sweep; allowed: S1, S2, S4, S8, S16, S32, baseline$"),
])
def test_bad_values_are_one_config_error_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        validate(compose(overrides))
    assert "\n" not in str(error.value)


def test_several_srun_tasks_without_torchrun_are_refused(monkeypatch):
    """`srun -n 4 python run.py` (no torchrun): four copies that would each train the run alone."""
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NUM_TASKS=4: srun started 4 copies of run.py"):
        validate(compose([]))
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # one task (a batch script's own step, srun -n 1)
    assert validate(compose([])).parallel is None


_gpu_sweep = pytest.mark.slow  # the GPU presets compose as the CPU ones do: checked in the slow set


@pytest.mark.parametrize("name,jobs", [
    ("ablation", 39), pytest.param("ablation_gpu", 39, marks=_gpu_sweep), ("block_size", 14),
    pytest.param("block_size_gpu", 14, marks=_gpu_sweep), ("scaling", 30), pytest.param("scaling_gpu", 15, marks=_gpu_sweep),
    ("arch", 30), pytest.param("arch_gpu", 50, marks=_gpu_sweep), ("multihop", 6), ("tuned_lr", 26),
])
def test_every_job_of_every_sweep_validates(name, jobs):
    """Every job composes and validates (the GPU grids repeat the CPU ones' structure: first,
    middle and last job). The paper fixes N ≈ 8 blocks as depth grows, so every Block
    job of the GPU scaling ladder and architecture grid is checked for N = 7-9 (S = round(L/8),
    block_n8; S = 4 gave 6-20 from 24 to 40 sublayers); its runs are still the variant `block`.
    The CPU scaling ladder: Block with ≥ 4 blocks and S ≥ 2 (S = 1 is Full) at every size, ≥ 5
    sizes, compute spanning ≥ 30× (a compute multiplier needs both)."""
    found = sweep_jobs([f"+sweep={name}"])
    assert len(found) == jobs
    eight_blocks = name in ("scaling_gpu", "arch_gpu")
    if name.endswith("_gpu"):
        ends = [found[0], found[len(found) // 2], found[-1]]
        found = ends + [j for j in found if eight_blocks and j not in ends and j[1].residual.name == "block"]
    blocks, compute, cpu_blocks = {}, {}, {}
    for overrides, cfg in found:
        spec = validate(cfg)
        assert spec.cfg.sweep.name == name.removesuffix("_gpu"), overrides
        if name == "scaling":
            compute.setdefault(spec.cfg.model.name, []).append(spec.counts["count.train_flops"])
            if spec.cfg.residual.name == "block":
                L, S = 2 * spec.cfg.model.layers, spec.cfg.residual.block_size
                cpu_blocks[spec.cfg.model.name] = (-(-L // S), S)
        if eight_blocks and spec.cfg.residual.name == "block":
            L, S = 2 * spec.cfg.model.layers, spec.cfg.residual.block_size
            blocks[(spec.cfg.model.name, L)] = -(-L // S)  # whole blocks, the last one may be short
    if eight_blocks:
        assert len(blocks) >= 5 and all(7 <= n <= 9 for n in blocks.values()), blocks
    if name == "scaling":
        assert len(compute) >= 5 and set(cpu_blocks) == set(compute)
        assert all(n >= 4 and S >= 2 for n, S in cpu_blocks.values()), cpu_blocks
        per_size = sorted(min(v) for v in compute.values())
        assert per_size[-1] / per_size[0] >= 30


def test_the_sweep_folder_holds_the_ready_sweeps_and_the_optuna_one():
    assert set(SWEEPS) >= {"ablation", "block_size", "scaling", "arch", "lr"}
    assert compose(["+sweep=lr"]).sweep.name == "lr"


def test_block_size_sweep_cells_map_onto_the_residual():
    for cell, (variant, size) in {"S1": ("block", 1), "S32": ("block", 32), "baseline": ("baseline", 4)}.items():
        spec = validate(compose(["+sweep=block_size", f"sweep.cell={cell}"]))
        assert (spec.cfg.residual.name, spec.cfg.residual.block_size) == (variant, size)
        assert spec.cfg.model.layers == 16


def test_blocks_resolver_by_hand():
    from harness.config import block_size_for

    assert [block_size_for(8, _root_=OmegaConf.create({"model": {"layers": b}})) for b in (2, 12, 13, 16, 20)] == [1, 3, 3, 4, 5]


def test_arch_sweep_shapes_meet_the_parameter_budget():
    for r in (8, 18, 40):
        for h in (0.25, 1.0):
            spec = validate(compose(["+sweep=arch", f"sweep.arch.d_model_per_layer={r}",
                                     f"sweep.arch.heads_per_layer={h}"]))
            budget = OmegaConf.select(compose(["+sweep=arch"]), "sweep.arch.params")
            got = spec.counts["count.params_non_embedding"]
            assert 0.75 * budget < got < 1.25 * budget, (r, h, got, budget)
            m = spec.cfg.model
            assert m.d_model % m.n_heads == 0 and (m.d_model // m.n_heads) % 2 == 0


def test_cpu_arch_grid_gives_five_distinct_depths():
    # The CPU preset's d_model/L_b values were chosen so that each gives its own whole number of
    # blocks at its parameter budget (the paper's 15…75 would collapse to two or three depths).
    depths = [validate(compose(["+sweep=arch", f"sweep.arch.d_model_per_layer={r}"])).cfg.model.layers
              for r in (8, 12, 18, 27, 40)]
    assert depths == sorted(depths, reverse=True) and len(set(depths)) == 5, depths


# --- the command line: exit code, one clear line, nothing half-made --------------------------

def _nothing_written(tmp):
    assert not (tmp / "ckpt").exists(), "a checkpoint folder was created"
    assert not (tmp / "out").exists() and not (tmp / "multirun").exists(), "a Hydra output folder was left"
    assert not (tmp / "mlflow.db").exists(), "a tracking database was created"


@pytest.mark.parametrize("args,expected", [
    (["residual=block", "residual.num_blocks=3"],
     "residual.num_blocks=3 must divide the number of sublayers L=4 (2 × model.layers); allowed: 1, 2, 4"),
    (["residual.name=blok"], "residual.name='blok' is not a known variant; allowed: baseline"),
])
def test_cli_config_error_exits_2_with_the_key_and_allowed_values(tmp_path, args, expected):
    result = run_cli([*TINY, *args], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected in result.stderr
    assert len([l for l in result.stderr.splitlines() if l.startswith("error:")]) == 1
    _nothing_written(tmp_path)


@pytest.mark.parametrize("args,expected", [  # refused by Hydra's composition (harness/composition_errors.py)
    (["residual=blok"], "error: residual=blok: no option 'blok' in group residual"),
    (["train.foo=1"], "error: train.foo=1: train has no key 'foo'"),
    (["train.batch_size=abc"], "error: train.batch_size=abc: not an integer"),
])
def test_cli_unknown_option_or_key_fails_before_anything_runs(tmp_path, args, expected):
    result = run_cli([*TINY, *args], tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [result.stderr.strip()] and result.stderr.startswith(expected)
    if args == ["residual=blok"]:
        assert "block_multihead" in result.stderr  # the allowed values
    _nothing_written(tmp_path)


def test_multirun_with_one_bad_job_stops_before_any_run(tmp_path):
    result = run_cli(["-m", "residual=baseline,block", "residual.num_blocks=3", *TINY], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "job 1 (residual=block" in result.stderr and "residual.num_blocks=3 must divide" in result.stderr
    _nothing_written(tmp_path)


def test_cfg_job_prints_the_composed_config(tmp_path):
    result = run_cli(["--cfg", "job", "residual=block"], tmp_path)
    assert result.returncode == 0
    cfg = OmegaConf.create(result.stdout)
    assert cfg.residual.name == "block" and "train" in cfg and "tracking" in cfg


@pytest.mark.parametrize("args,expected", [
    (["data=text", "data.path=/no/such/corpus"], "/no/such/corpus: no such file or folder"),
    (["data=shards"], "data.path"),  # required (???) for shards
])
def test_cli_bad_data_exits_2_before_anything_runs(tmp_path, args, expected):
    result = run_cli([*TINY, *args], tmp_path)
    assert result.returncode != 0
    assert expected in result.stderr
    _nothing_written(tmp_path)


def test_an_option_at_its_neutral_value_leaves_the_run_key_as_it_was_before_the_option():
    """A config without data.loss_on (a run from before the option) and the same config with
    data.loss_on=all compute the same thing and share a key; loss_on=answers is another run."""
    import copy

    from harness.checkpoint import run_key
    from harness.config import NEUTRAL

    plain = {"data": {"name": "multihop", "n_vars": 12}, "train": {"seed": 0, "threads": 1}}
    assert NEUTRAL["data.loss_on"] == "all"
    with_option = copy.deepcopy(plain)
    with_option["data"]["loss_on"] = "all"
    assert run_key(with_option) == run_key(plain)
    with_option["data"]["loss_on"] = "answers"
    assert run_key(with_option) != run_key(plain)
    # the probe's layout and the embedding's scale: at their defaults the run is the one before them
    for section, key, neutral, other in (("data", "format", "assign", "compact"), ("data", "aligned", False, True),
                                         ("model", "embed_std", None, 1.0), ("model", "prenorm_eps", None, 1e-8),
                                         ("model", "residual_norm_eps", None, 1e-8),
                                         ("model", "final_norm_eps", None, 1e-8), ("model", "qkv_bias", False, True),
                                         ("model", "qk_norm", False, True)):
        with_option = copy.deepcopy(plain)
        with_option.setdefault(section, {})[key] = neutral
        assert NEUTRAL[f"{section}.{key}"] == neutral and run_key(with_option) == run_key(plain)
        with_option[section][key] = other
        assert run_key(with_option) != run_key(plain)


def test_qkv_bias_and_qk_norm_reach_the_runs_model_and_default_off():
    off = validate(compose(["model=tiny", "train.device=cpu"])).cfg.model
    assert (off.qkv_bias, off.qk_norm) == (False, False)
    on = validate(compose(["model=tiny", "train.device=cpu", "model.qkv_bias=true", "model.qk_norm=true"])).cfg.model
    assert (on.qkv_bias, on.qk_norm) == (True, True)
