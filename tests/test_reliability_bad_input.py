"""Bad input at every user-facing door of run.py: exit code 2, one line naming the key, the value
and what is allowed, and nothing left behind (no run folder, no Hydra output folder, no store).

The doors: values the harness validates (harness/config.py), data, the checkpoint folder, the
tracking URI, and what Hydra itself refuses while composing (harness/composition_errors.py): a
misspelt key, a wrong type, an unknown group option, a missing or a superfluous `+`, in a single
run, a basic multirun and an Optuna sweep. `{tmp}` in a case stands for the test's folder."""
import os
import re
import subprocess
import sys

import pytest

from harness_testing import ROOT, TINY

CASES = {
    "a value the config cannot run": (["train.micro_batch_size=3"], "train.micro_batch_size=3"),
    "a data path": (["data=text", "data.path=/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    "a checkpoint path": (["train.checkpoint_dir=/proc/no-such-dir"], "train.checkpoint_dir=/proc/no-such-dir"),
    "a checkpoint path, in a multirun": (["-m", "residual=baseline,block", "train.checkpoint_dir=/proc/no-such-dir"],
                                         "train.checkpoint_dir=/proc/no-such-dir: cannot create /proc/no-such-dir"),
    "a tracking URI scheme": (["tracking.uri=foo://bar"], "tracking.uri=foo://bar"),
    "a SQLite URI in a folder that cannot exist": (["tracking.uri=sqlite:////proc/x/mlflow.db"],
                                                    "tracking.uri=sqlite:////proc/x/mlflow.db"),
    "a dead tracking server, in a multirun": (["-m", "residual=baseline,block", "tracking.uri=http://127.0.0.1:1"],
                                              "tracking.uri=http://127.0.0.1:1: no MLflow server answers"),
    # Refused by Hydra while composing: its multi-line report and exit 1 before harness/composition_errors.py.
    "a misspelt key": (["model.layerz=3"], "model.layerz=3: model has no key 'layerz' (did you mean 'layers'?); "
                                           "allowed: name, vocab_size, d_model, layers,"),
    "a misspelt top-level key": (["sweeper=basic"], "sweeper=basic: the config has no key 'sweeper' (did you mean "
                                                    "'sweep'?); allowed: "),
    "a wrong type": (["model.layers=abc"], "model.layers=abc: not an integer; allowed: an integer"),
    "a value outside an enum": (["train.precision=fp16"], "train.precision=fp16: not one of the choices; "
                                                          "allowed: auto, fp32, bf16"),
    "null for a required value": (["model.layers=null"], "model.layers=null: null is not allowed; allowed: an integer"),
    "an unknown group option": (["residual=blok"], "residual=blok: no option 'blok' in group residual (did you "
                                                   "mean 'block' or 'block_n8' or 'block_n4'?); allowed: baseline, block, "
                                                   "block_multihead,"),
    "a group added without +": (["sweep=ablation"], "sweep=ablation: sweep is not in the defaults list, so it "
                                                    "cannot be overridden; allowed: +sweep=ablation"),
    "an existing key added with +": (["+model.layers=3"], "+model.layers=3: model.layers already exists and + only "
                                                          "adds new keys; allowed: model.layers=3"),
    "a misspelt key added with +": (["+model.layerz=3"], "model.layerz=3: model has no key 'layerz' (did you mean "
                                                         "'layers'?)"),
    "an override that does not parse": (["train.steps=["], "train.steps=[: not a valid override"),
    # docs/DATA.md's own example was `data.path=~/books`: Hydra's grammar refuses ~ there.
    "a home path with ~": (["data=text", "data.path=~/books"],
                           "data.path=~/books: ~ is not allowed unquoted in a value; allowed: "
                           "data.path=$HOME/books (the shell expands it) or 'data.path=\"~/books\"'"),
    "a comma list without -m": (["residual=baseline,block"], "residual=baseline,block: a sweep needs a multirun; "
                                                             "allowed: python run.py -m residual=baseline,block"),
    "a misspelt key, in a multirun": (["-m", "residual=baseline,block", "model.layerz=3"],
                                      "model.layerz=3: model has no key 'layerz'"),
    "an unknown option in a sweep": (["-m", "residual=blok,block"], "residual=blok: no option 'blok' in group residual"),
    "a multirun asked for its config": (["-m", "--cfg=job", "residual=baseline,block"],
                                        "-m/--multirun, --cfg, --info and --run are separate commands"),
    "a wrong type in a sweep": (["-m", "model.layers=4,abc"], "model.layers=abc: not an integer; allowed: an integer"),
    # README's sweeper example without hydra/sweeper=attnres_optuna: Hydra's basic sweeper, exit 1.
    "a search range without the Optuna sweeper": (["-m", "residual=baseline,block", "optim.lr=tag(log,interval(3e-4,3e-2))"],
                                                  "optim.lr=tag(log,interval(3e-4,3e-2)): a search range needs the "
                                                  "Optuna sweeper; allowed: add hydra/sweeper=attnres_optuna"),
    "an unknown option in an Optuna sweep": (["-m", "hydra/sweeper=attnres_optuna", "residual=blok,block",
                                              "optim.lr=interval(1e-3,1e-2)", "hydra.sweeper.storage=sqlite:///{tmp}/optuna.db"],
                                             "residual=blok: no option 'blok' in group residual"),
    "a misspelt Optuna sweeper option": (["-m", "hydra/sweeper=attnres_optuna", "hydra.sweeper.n_trails=2",
                                          "optim.lr=interval(1e-3,1e-2)", "hydra.sweeper.storage=sqlite:///{tmp}/optuna.db"],
                                         "hydra.sweeper.n_trails=2: hydra.sweeper has no key 'n_trails' (did you mean "
                                         "'n_trials'?)"),
    "an Optuna sweeper option outside what it allows": (["-m", "hydra/sweeper=attnres_optuna",
                                                          "hydra.sweeper.sampler.name=bogus", "optim.lr=interval(1e-3,1e-2)",
                                                          "hydra.sweeper.storage=sqlite:///{tmp}/optuna.db"],
                                                         "attnres_optuna sweeper: hydra.sweeper.sampler.name='bogus' is not one of"),
    "an Optuna storage URL of no known database": (["-m", "hydra/sweeper=attnres_optuna", "optim.lr=interval(1e-3,1e-2)",
                                                    "hydra.sweeper.storage=postgres://user@127.0.0.1:1/db"],
                                                   ("hydra.sweeper.storage='postgres://user@127.0.0.1:1/db' is not a "
                                                    "database URL (unknown database kind")),
    "a wrong Optuna sampler keyword": (["-m", "hydra/sweeper=attnres_optuna", "optim.lr=interval(1e-3,1e-2)",
                                        "+hydra.sweeper.sampler.kwargs.n_startup_trails=3",
                                        "hydra.sweeper.storage=sqlite:///{tmp}/optuna.db"],
                                       "unexpected keyword argument 'n_startup_trails'"),
    # Found by the UX audit: each of these was a traceback (exit 1), and in a multirun Hydra turned
    # the callback's exception into a warning and launched every job unchecked.
    "an undefined interpolation": (["optim.lr=${oops}"], "Interpolation key 'oops' not found full_key: optim.lr"),
    "an undefined interpolation, in a multirun": (["-m", "residual=baseline,block", "optim.lr=${oops}"],
                                                  "Interpolation key 'oops' not found full_key: optim.lr"),
    "a SQLite URI naming a folder": (["tracking.uri=sqlite:///{tmp}"], "is not a SQLite database (a folder)"),
    # On a CPU the OOM killer would end it without a line (harness/memory_budget.py); ~3 TB asked for.
    "a micro-batch no memory holds": (["train.batch_size=16777216"],
                                      "train.batch_size=16777216, train.seq_len=32: one micro-batch of 16777216 × 32 "
                                      "tokens needs about"),
    "a rope_theta that gives NaN": (["model.rope_theta=0"], "model.rope_theta=0.0 must be positive"),
    "a negative embed_std": (["model.embed_std=-1"], "model.embed_std=-1.0"),
    "a probe format that does not exist": (["data=multihop", "data.format=json"], "data.format='json'"),
    "aligned probe rows of the wrong length": (["data=multihop", "data.n_vars=6", "data.format=compact",
                                                "data.aligned=true"], "data.aligned=true"),
    "a negative init_std": (["-m", "residual=baseline,block", "model.init_std=-1"],
                            "model.init_std=-1.0 must be a finite number >= 0"),
    # The config's own line named the sampled value (model.layers=2.0), which the user never typed.
    "a float range over an integer key": (["-m", "hydra/sweeper=attnres_optuna", "model.layers=interval(2,4)",
                                           "hydra.sweeper.storage=sqlite:///{tmp}/optuna.db"],
                                          "model.layers: interval(...) samples floats, but model.layers takes "
                                          "integers; allowed: tag(int, interval(2, 4)) or range(2, 5)"),
    "a value no Optuna trial can run": (["-m", "hydra/sweeper=attnres_optuna", "optim.lr=interval(1e-3,1e-2)",
                                         "residual=block", "residual.num_blocks=3",
                                         "hydra.sweeper.storage=sqlite:///{tmp}/optuna.db"],
                                        "residual.num_blocks=3 must divide the number of sublayers"),
}


# Doors already tested in a single run, again through a multirun's or a sweep's composition: in
# the slow set (CI runs it), one multirun case of each kind stays in the default run.
AGAIN_IN_A_MULTIRUN = {"a misspelt key, in a multirun", "a wrong type in a sweep", "an undefined interpolation, in a multirun",
                       "a negative init_std", "an unknown option in an Optuna sweep"}
assert AGAIN_IN_A_MULTIRUN <= set(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in AGAIN_IN_A_MULTIRUN else c
                                  for c in CASES])
def test_bad_input_exits_2_with_one_line_naming_the_key(case, tmp_path):
    extra, named = CASES[case]
    base = [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
            f"hydra.run.dir={tmp_path / 'out'}", f"hydra.sweep.dir={tmp_path / 'out'}"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    flags = [a for a in extra if a.startswith("-")]  # before the overrides (argparse)
    overrides = [a.replace("{tmp}", str(tmp_path)) for a in extra if not a.startswith("-")]
    result = subprocess.run([sys.executable, "run.py", *flags, *TINY, *base, *overrides], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)  # the last override of a key wins
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "optuna.db").exists()
    assert not list((tmp_path / "ckpt").rglob("run.json")) if (tmp_path / "ckpt").exists() else True


@pytest.mark.parametrize("flags, expected", [
    (["--help"], "== Configuration groups =="),
    (["--cfg", "job"], "layers: 3"),
    (["--info", "defaults"], "Defaults List"),
])
def test_help_cfg_and_info_still_work(flags, expected):
    """The one-line errors wrap Hydra's reporting; Hydra's own commands must be untouched."""
    result = subprocess.run([sys.executable, "run.py", *flags, "model.layers=3"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and expected in result.stdout, result.stderr[-3000:]
    assert result.stderr == ""


def test_full_error_still_gives_hydras_report(tmp_path):
    """HYDRA_FULL_ERROR=1 is the way to debug a composition error: Hydra's traceback, not our line."""
    env = dict(os.environ, HYDRA_FULL_ERROR="1")
    result = subprocess.run([sys.executable, "run.py", "model.layerz=3", f"hydra.run.dir={tmp_path / 'out'}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" in result.stderr and "error: model.layerz" not in result.stderr


@pytest.mark.parametrize("flags", [[], ["-m", "residual=baseline,block"]])
def test_a_tracking_file_that_is_not_a_database_is_one_line_before_anything_runs(flags, tmp_path):
    """It was SQLAlchemy's traceback per job (exit 1, run folders left); in a multirun the callback's
    error became a warning and both jobs were launched anyway."""
    store = tmp_path / "notes.db"
    store.write_text("not a database\n")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result = subprocess.run([sys.executable, "run.py", *flags, *TINY, f"tracking.uri=sqlite:///{store}",
                             f"train.checkpoint_dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path / 'out'}",
                             f"hydra.sweep.dir={tmp_path / 'out'}"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "is not a SQLite database (another kind of file)" in lines[0], lines
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "out").exists()
    assert store.read_text() == "not a database\n"


@pytest.mark.parametrize("flags", [[], ["-m", "residual=baseline,block"]])
def test_a_sweep_name_that_is_a_path_is_refused_before_hydra_makes_its_folder(flags, tmp_path):
    """Hydra's output folder is outputs/<sweep.name>/… under the working folder: `sweep.name=../../x`
    made it outside (the checkpoint folders were sanitised, this one was not). Started from
    <tmp>/a/b, the folder would be <tmp>/a/escaped/…; nothing may appear anywhere under <tmp>."""
    start = tmp_path / "a" / "b"
    start.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), *flags, *TINY, "sweep.name=../../escaped",
                             f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"train.checkpoint_dir={tmp_path / 'ckpt'}"],
                            cwd=start, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "sweep.name='../../escaped' is not one folder name" in lines[0], lines
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/b"]


@pytest.mark.parametrize("name", ["..", "...", "/"])
def test_an_experiment_name_keeps_its_artifacts_in_a_folder_of_its_own(name, tmp_path):
    """An experiment's artifacts go to <store folder>/mlruns/<its name made a folder name>; `..`
    put them in the store's own folder."""
    from mlflow import MlflowClient

    from harness.tracking import experiment_id

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    location = client.get_experiment(experiment_id(client, name, uri)).artifact_location
    assert location.startswith((tmp_path / "mlruns").as_uri() + "/") and location.rsplit("/", 1)[1] not in ("", ".", "..")


def _sparse(path, size: int, tail: bytes = b"\n"):
    """A file of `size` bytes that takes no disk: zeros (valid UTF-8) and `tail` at its end."""
    with open(path, "wb") as handle:
        handle.truncate(size - len(tail))
        handle.seek(size - len(tail))
        handle.write(tail)
    return path


def _limited_memory():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # a regression fails here, not in the OOM killer


def test_a_text_file_larger_than_memory_is_refused_before_it_is_read(tmp_path):
    """A text corpus with data.max_bytes unset was read whole, at three to five times its size (read,
    decoded, split, copied): the OOM killer, no line. Four times this machine's memory, sparse."""
    from harness.memory_budget import available_bytes

    big = _sparse(tmp_path / "big.txt", 4 * available_bytes())
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result = subprocess.run([sys.executable, "run.py", *TINY, "data=text", f"data.path={big}", "data.max_bytes=null",
                             f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
                             f"hydra.run.dir={tmp_path / 'out'}"], cwd=ROOT, env=dict(env, ATTNRES_CACHE="off"),
                            capture_output=True, text=True, timeout=120, preexec_fn=_limited_memory)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: data.path={big}: ") and "data.max_bytes=None" in lines[0], lines
    assert "allowed: the text split into smaller files" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt"]


def test_the_refusal_names_a_max_bytes_that_fits_and_the_characters_width_counts(tmp_path, monkeypatch):
    """With the machine's memory faked to 150 MB: a 64 MiB file is refused naming a data.max_bytes,
    which then loads; the same file with one character beyond U+FFFF decodes to 4 bytes a byte,
    and no cap helps then (the file is read and decoded whole)."""
    from harness import memory_budget
    from harness.data import DataConfig, DataError, load_data

    monkeypatch.setenv("ATTNRES_CACHE", "off")
    monkeypatch.setattr(memory_budget, "available_bytes", lambda: 150_000_000)
    text = _sparse(tmp_path / "zeros.txt", 64 << 20)
    with pytest.raises(DataError, match=r"allowed: data\.max_bytes=(\d+)") as refused:
        load_data(DataConfig(name="text", path=str(text), max_bytes=None), 32)
    fits = int(re.search(r"data\.max_bytes=(\d+) \(or less\)", str(refused.value)).group(1))
    data = load_data(DataConfig(name="text", path=str(text), max_bytes=fits), 32)
    assert 0 < data.train.numel() + data.val.numel() <= fits
    wide = _sparse(tmp_path / "wide.txt", 64 << 20, "😀\n".encode())
    with pytest.raises(DataError, match="allowed: the text split into smaller files"):
        load_data(DataConfig(name="text", path=str(wide), max_bytes=fits), 32)


def test_token_files_joined_beyond_memory_are_refused(tmp_path, monkeypatch):
    from harness import memory_budget
    from harness.data import DataConfig, DataError, load_data
    from harness.data.shards import write_shard

    for split in ("train", "val"):
        for i in range(2):
            write_shard(tmp_path / f"x_{split}_{i:06d}.bin", list(range(200)) * 10)
    monkeypatch.setattr(memory_budget, "available_bytes", lambda: 2000)
    with pytest.raises(DataError, match=r"data\.max_bytes: joining the token files .* allowed: data\.max_bytes="):
        load_data(DataConfig(name="shards", path=str(tmp_path), vocab_size=256), 32)
