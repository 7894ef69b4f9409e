"""The sweeper's parts on their own, in this process: no Hydra app, no jobs, no MLflow (fast)."""

from pathlib import Path

import attnres
import optuna
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from harness import pruning
from hydra_plugins.attnres_optuna_sweeper import settings as sweeper_config
from hydra_plugins.attnres_optuna_sweeper._ledger import (
    FAILURE_ATTR,
    VOID_ATTR,
    Ledger,
    failure_budget,
    rank,
)
from hydra_plugins.attnres_optuna_sweeper._space import build_plan
from hydra_plugins.attnres_optuna_sweeper._strategy import describe, make_pruner, make_sampler, scaled_pruner
from hydra_plugins.attnres_optuna_sweeper.settings import (
    AttnresOptunaSweeperConf,
    SweeperConfigError,
    validate,
)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = list(attnres.VARIANTS)  # the source of truth for residual names


def plan(*arguments, params=None):
    return build_plan(list(arguments), params or {}, OverridesParser.create())


# -- harness.pruning --------------------------------------------------------------------------


class FakeTrial:
    number = 7

    def __init__(self, prune_at):
        self.prune_at, self.reports = prune_at, []

    def report(self, value, step):
        self.reports.append((step, value))

    def should_prune(self):
        return self.reports[-1][0] >= self.prune_at


def test_pruning_is_a_no_op_outside_a_sweep():
    assert not pruning.active()
    assert pruning.current_trial() is None
    pruning.report(1, 2.5)  # nothing bound: nothing happens, nothing raised


def test_pruning_reports_to_the_bound_trial_and_raises_when_told():
    trial = FakeTrial(prune_at=3)
    with pruning.bind(trial):
        assert pruning.active() and pruning.current_trial() is trial
        pruning.report(1, 2.0)
        pruning.report(2, 1.5)
        with pytest.raises(pruning.TrialPruned, match="trial 7 pruned at step 3"):
            pruning.report(3, 9.0)
    assert trial.reports == [(1, 2.0), (2, 1.5), (3, 9.0)]
    assert not pruning.active()


def test_pruning_refuses_two_bound_trials():
    with pruning.bind(FakeTrial(prune_at=99)):
        with pytest.raises(RuntimeError, match="already bound"):
            with pruning.bind(FakeTrial(prune_at=99)):
                pass


# -- override syntax -> plan --------------------------------------------------------------------


def test_comma_lists_are_grid_cells_and_ranges_are_searched():
    p = plan(
        "residual=block,full",
        "model.layers=8,16",
        "optim.lr=tag(log,interval(1e-4,3e-2))",
        "train.tokens=1000",
    )
    assert [c.study_name("lr") for c in p.cells] == [
        "lr/residual=block/model.layers=8",
        "lr/residual=block/model.layers=16",
        "lr/residual=full/model.layers=8",
        "lr/residual=full/model.layers=16",
    ]
    assert p.cells[0].overrides == ("residual=block", "model.layers=8")
    assert p.fixed == ("train.tokens=1000",)
    assert p.distributions == {"optim.lr": FloatDistribution(1e-4, 3e-2, log=True)}
    assert p.dimensions[0].override(0.00123456789) == "optim.lr=0.00123456789"


def test_choice_range_and_int_interval_are_search_dimensions():
    p = plan(
        "a=choice(1,2.5,x,true)",
        "b=range(1,10,3)",
        "c=tag(int,log,interval(1,64))",
        "d=range(0.1,0.4,0.1)",
    )
    d = p.distributions
    assert d["a"] == CategoricalDistribution([1, 2.5, "x", True])
    assert d["b"] == IntDistribution(1, 7, step=3)
    assert d["c"] == IntDistribution(1, 64, log=True)
    assert isinstance(d["d"], FloatDistribution) and d["d"].step == pytest.approx(0.1)
    assert [p.dimensions[0].override(v) for v in (1, True)] == ["a=1", "a=True"]
    assert len(p.cells) == 1 and p.cells[0].labels == ()


def test_params_are_parsed_like_the_command_line_which_wins():
    p = plan(
        "residual=full",
        params={
            "residual": "block,full",
            "optim": {"lr": "tag(log, interval(1e-4, 1e-2))"},
            "model.layers": 16,
        },
    )
    # The command line narrowed the params' grid axis to one value: still an axis, so the study
    # is lr/residual=full, apart from residual=block's (it used to be one study for both).
    assert [(c.overrides, c.labels) for c in p.cells] == [(("residual=full",), ("residual=full",))]
    assert p.cells[0].study_name("lr") == "lr/residual=full"
    assert set(p.fixed) == {"model.layers=16"}
    # A key the params fix (no grid) stays fixed when the command line sets it.
    q = plan("model.layers=8", params={"residual": "block,full", "optim.lr": "interval(1e-4, 1e-2)", "model.layers": 16})
    assert [c.labels for c in q.cells] == [("residual=block",), ("residual=full",)] and q.fixed == ("model.layers=8",)
    assert p.distributions["optim.lr"] == FloatDistribution(1e-4, 1e-2, log=True)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["optim.lr=interval(1,"], "cannot parse override"),
        (["optim.lr=tag(loq,interval(1e-4,1e-2))"], "unknown tag 'loq'"),
        (["residual=block,full"], "nothing to search"),
        (["optim.lr=tag(log,interval(0,1))"], "optim.lr: "),
        (["layers=range(5,1)"], "is empty"),
    ],
)
def test_bad_search_syntax_is_one_clear_line(arguments, message):
    with pytest.raises(SweeperConfigError, match=message) as error:
        plan(*arguments)
    assert "\n" not in str(error.value)


def test_lr_sweep_config_is_a_grid_of_thirteen_studies_over_a_log_lr():
    text = (ROOT / "sweeps" / "lr.yaml").read_text()
    assert text.startswith("# @package _global_")
    conf = OmegaConf.create(text)
    assert {"override /hydra/sweeper": "attnres_optuna"} in OmegaConf.to_container(conf.defaults)
    sweeper = OmegaConf.merge(OmegaConf.structured(AttnresOptunaSweeperConf), conf.hydra.sweeper)
    validate(OmegaConf.to_object(sweeper))
    p = plan(params=OmegaConf.to_container(sweeper.params))
    assert [c.study_name(sweeper.study_name) for c in p.cells] == [
        f"lr/residual={v}" for v in VARIANTS
    ]
    assert p.distributions == {"optim.lr": FloatDistribution(1e-4, 3e-2, log=True)}
    assert sweeper.sampler.seed is not None


# -- samplers, pruners, options -----------------------------------------------------------------


def test_samplers_and_pruners_are_built_from_settings():
    p = plan("a=choice(x,y)", "b=range(1,4)")
    conf = AttnresOptunaSweeperConf()
    for name, cls in [
        ("tpe", optuna.samplers.TPESampler),
        ("random", optuna.samplers.RandomSampler),
        ("gp", optuna.samplers.GPSampler),
        ("cmaes", optuna.samplers.CmaEsSampler),
        ("grid", optuna.samplers.GridSampler),
    ]:
        conf.sampler.name = name
        assert isinstance(make_sampler(conf.sampler, p.dimensions), cls)
    for name, cls in [
        ("median", optuna.pruners.MedianPruner),  # with a margin: a subclass
        ("successive_halving", optuna.pruners.SuccessiveHalvingPruner),
        ("hyperband", optuna.pruners.HyperbandPruner),
        ("none", optuna.pruners.NopPruner),
    ]:
        conf.pruner.name = name
        assert isinstance(make_pruner(conf.pruner), cls)


def median_study(tmp_path, pruner_conf, finished, direction="minimize"):
    """A study on SQLite whose finished trials reported `finished` (one value each) at step 10."""
    study = optuna.create_study(
        storage=f"sqlite:///{tmp_path / 'optuna.db'}", pruner=make_pruner(pruner_conf), direction=direction
    )
    for value in finished:
        study.add_trial(create_trial(value=value, intermediate_values={10: value}, state=TrialState.COMPLETE))
    return study


def pruned_at(study, value, step=10):
    trial = study.ask()
    trial.report(value, step)
    return trial.should_prune()


@pytest.mark.parametrize("n_trials, startup", [(3, 1), (4, 2), (8, 4), (20, 5), (1, 1)])
def test_the_median_pruners_warm_up_is_at_most_half_the_study(n_trials, startup):
    conf = AttnresOptunaSweeperConf().pruner  # n_startup_trials=5
    assert scaled_pruner(conf, n_trials).n_startup_trials == startup
    assert conf.n_startup_trials == 5  # the settings themselves are left as configured
    assert f"n_startup_trials={startup}," in describe(scaled_pruner(conf, n_trials))


def test_a_three_trial_study_prunes_after_its_first_trial(tmp_path):
    conf = AttnresOptunaSweeperConf().pruner
    (tmp_path / "scaled").mkdir(), (tmp_path / "as_configured").mkdir()
    scaled = median_study(tmp_path / "scaled", scaled_pruner(conf, n_trials=3), [3.0])
    assert pruned_at(scaled, 4.0)  # 33% worse than the one finished trial
    assert not pruned_at(scaled, 3.01)  # within the margin
    # Optuna's own warm-up of 5 finished trials would never be reached in a study of 3.
    as_configured = median_study(tmp_path / "as_configured", conf, [3.0])
    assert not pruned_at(as_configured, 4.0)


def test_the_median_pruner_needs_a_margin(tmp_path):
    conf = AttnresOptunaSweeperConf().pruner
    conf.n_startup_trials = 1
    assert conf.margin == 0.02
    (tmp_path / "margin").mkdir(), (tmp_path / "none").mkdir()
    study = median_study(tmp_path / "margin", conf, [3.0, 3.1, 3.4])  # median 3.1, margin 0.062
    assert not pruned_at(study, 3.15)  # 1.6% above the median: a neighbour of the best point
    assert not pruned_at(study, 3.16)  # 1.9% above
    assert pruned_at(study, 3.17)  # 2.3% above
    assert pruned_at(study, float("nan"))
    # With margin 0 it is Optuna's median pruner: anything above the median goes.
    conf.margin = 0.0
    study = median_study(tmp_path / "none", conf, [3.0, 3.1, 3.4])
    assert pruned_at(study, 3.15)
    assert not pruned_at(study, 3.1)


def test_the_margin_points_the_right_way_when_maximizing(tmp_path):
    conf = AttnresOptunaSweeperConf().pruner
    conf.n_startup_trials, conf.margin = 1, 0.1
    study = median_study(tmp_path, conf, [0.5, 0.6, 0.7], direction="maximize")  # median 0.6, gap 0.06
    assert not pruned_at(study, 0.55)
    assert pruned_at(study, 0.53)


@pytest.mark.parametrize("margin", [-0.1, float("nan"), float("inf")])
def test_a_bad_margin_is_a_config_error(margin):
    conf = AttnresOptunaSweeperConf().pruner
    conf.margin = margin
    with pytest.raises(SweeperConfigError):
        make_pruner(conf)


def test_grid_sampler_refuses_a_continuous_interval():
    conf = AttnresOptunaSweeperConf()
    conf.sampler.name = "grid"
    with pytest.raises(SweeperConfigError, match="continuous"):
        make_sampler(conf.sampler, plan("optim.lr=interval(1e-4,1e-2)").dimensions)


def test_wrong_sampler_keyword_is_a_config_error():
    conf = AttnresOptunaSweeperConf()
    conf.sampler.kwargs = {"n_startup_trails": 3}
    with pytest.raises(SweeperConfigError, match="n_startup_trails"):
        make_sampler(conf.sampler, plan("a=interval(0,1)").dimensions)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("direction", "minimise", "hydra.sweeper.direction='minimise' is not one of"),
        ("n_trials", 0, "n_trials=0 must be at least 1"),
        ("max_failure_rate", 1.5, "max_failure_rate=1.5 must be within"),
    ],
)
def test_settings_are_validated(field, value, message):
    conf = AttnresOptunaSweeperConf()
    setattr(conf, field, value)
    with pytest.raises(SweeperConfigError, match=message):
        validate(conf)


def test_the_sweeper_config_is_registered_for_hydra():
    from hydra.core.config_store import ConfigStore

    assert sweeper_config  # importing the module registers it
    repo = ConfigStore.instance().repo["hydra"]["sweeper"]
    assert "attnres_optuna.yaml" in repo


# -- trial accounting -----------------------------------------------------------------------------


def _trial(number, state, **attrs):
    dist = {"x": FloatDistribution(0, 1)}
    values = {"value": 1.0} if state == TrialState.COMPLETE else {}
    trial = create_trial(
        state=state, params={"x": 0.5}, distributions=dist, user_attrs=attrs, **values
    )
    trial.number = number
    return trial


def test_ledger_counts_failures_but_not_interrupted_or_stale_trials():
    trials = [
        _trial(0, TrialState.COMPLETE),
        _trial(1, TrialState.PRUNED),
        _trial(2, TrialState.FAIL, **{FAILURE_ATTR: "FloatingPointError: nan"}),
        _trial(3, TrialState.FAIL, **{VOID_ATTR: "interrupted"}),
        _trial(4, TrialState.FAIL),  # failed by the stale-heartbeat check
        _trial(5, TrialState.RUNNING),
    ]
    ledger = Ledger.of(trials)
    assert (ledger.complete, ledger.pruned, ledger.failed, ledger.void, ledger.running) == (
        1,
        1,
        1,
        2,
        1,
    )
    assert ledger.done == 3 and ledger.to_start(6) == 2 and ledger.to_start(3) == 0
    assert rank(trials, 5) == 4  # voids do not take a place


def test_failure_budget():
    assert failure_budget(20, 0.25) == 5
    assert failure_budget(10, 0.3) == 3
    assert failure_budget(8, 0.0) == 0
    assert failure_budget(8, 1.0) == 8


# -- which MLflow the sweeper talks to ---------------------------------------------------------


def test_tracking_follows_the_task_config(tmp_path, monkeypatch):
    from hydra_plugins.attnres_optuna_sweeper._study_runs import resolve_tracking
    from hydra_plugins.attnres_optuna_sweeper.settings import MlflowConf

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    task = OmegaConf.create(
        {
            "tracking": {"uri": "sqlite:///runs/mlflow.db", "experiment": None, "enabled": True},
            "sweep": {"name": "lr"},
        }
    )
    uri, experiment = resolve_tracking(MlflowConf(), task, tmp_path)
    assert uri == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}" and experiment == "lr"
    task.tracking.experiment = "tuning"
    assert resolve_tracking(MlflowConf(), task, tmp_path)[1] == "tuning"
    assert resolve_tracking(MlflowConf(experiment="mine"), task, tmp_path)[1] == "mine"
    task.tracking.enabled = False
    assert resolve_tracking(MlflowConf(), task, tmp_path) is None
    assert resolve_tracking(MlflowConf(enabled=False), OmegaConf.create({}), tmp_path) is None


class _ParentWrites:
    """Records the statuses written on a study's parent run; the first write can play another
    worker finishing the study's last running trial meanwhile."""

    def __init__(self, study, finish_meanwhile=None):
        self.study, self.finish_meanwhile, self.statuses = study, finish_meanwhile, []

    def update_parent(self, parent, study, status):
        self.statuses.append(status)
        if self.finish_meanwhile is not None:
            self.study.tell(self.finish_meanwhile, 1.0)
            self.finish_meanwhile = None


@pytest.mark.parametrize("other_worker_finishes_meanwhile, expected", [
    (False, ["RUNNING"]),  # the other worker will write the final view itself
    (True, ["RUNNING", "FINISHED"]),  # its final write may have landed before ours: write it again
])
def test_a_worker_done_early_never_leaves_a_finished_study_running(other_worker_finishes_meanwhile, expected):
    from hydra_plugins.attnres_optuna_sweeper._runner import _update_parent

    study = optuna.create_study()
    study.tell(study.ask(), 2.0)  # this worker's trial
    running = study.ask()  # another worker's, still running
    writes = _ParentWrites(study, running if other_worker_finishes_meanwhile else None)
    _update_parent(writes, "parent-run-id", study, "FINISHED", n_trials=2)
    assert writes.statuses == expected


class _NoLaunch:
    def launch(self, *args, **kwargs):
        raise AssertionError("a surplus trial must not run a job")


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_worker_that_loses_the_race_for_the_last_trial_voids_it_without_a_job(tmp_path, monkeypatch):
    """Two workers pass the 'one trial left' check together; the one whose trial got the later
    number finds it surplus: FAIL, marked void with the reason, no job, and the study's count stays
    n_trials (the other worker's trial counts)."""
    from hydra_plugins.attnres_optuna_sweeper._runner import SweepRunner
    from hydra_plugins.attnres_optuna_sweeper._storage import open_storage

    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat_interval=60, grace_period=None)
    runner = object.__new__(SweepRunner)  # no Hydra app here: only what _run_cell reads
    runner.settings, runner.launcher = AttnresOptunaSweeperConf(), _NoLaunch()
    sweep = plan("optim.lr=tag(log,interval(1e-3,1e-2))")
    (cell,) = sweep.cells
    name = cell.study_name("race")
    other = optuna.create_study(study_name=name, storage=storage)
    other.tell(other.ask(), 1.0)  # one of the two trials is done

    real_ask = optuna.Study.ask

    def ask_after_the_other_worker(self, *args, **kwargs):
        real_ask(other)  # the other worker's ask lands first, after both saw one slot free
        return real_ask(self, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "ask", ask_after_the_other_worker)
    runner._run_cell(cell, sweep, "race", 2, storage, None, [])

    trials = optuna.load_study(study_name=name, storage=storage).trials
    assert [(t.number, t.state) for t in trials] == [
        (0, TrialState.COMPLETE), (1, TrialState.RUNNING), (2, TrialState.FAIL)
    ]
    assert trials[2].user_attrs == {VOID_ATTR: "surplus"}
    assert Ledger.of(trials).done + Ledger.of(trials).running == 2
    storage.engine.dispose()


# -- seeds, grids, resumed studies ----------------------------------------------------------------


def _seeded(name="tpe", seed=0, arguments=("optim.lr=tag(log,interval(1e-4,1e-1))",)):
    conf = AttnresOptunaSweeperConf()
    conf.sampler.name, conf.sampler.seed = name, seed
    sweep = plan(*arguments)
    return sweep, make_sampler(conf.sampler, sweep.dimensions)


@pytest.mark.parametrize("name", ["tpe", "random"])
def test_a_seeded_study_continued_by_a_new_process_samples_new_points(name):
    """A rerun (after Ctrl-C, or with a larger n_trials) makes a new sampler with the same seed; it
    must not hand the study its first trials' points again (the harness would answer them with the
    recorded result, or a second worker's copy with RunBusy). Trial n of every cell stays the same."""
    sweep, sampler = _seeded(name)
    study = optuna.create_study(sampler=sampler)
    for _ in range(3):
        trial = study.ask(sweep.distributions)
        study.tell(trial, 1.0)
    first = [t.params["optim.lr"] for t in study.trials]

    resumed = optuna.load_study(study_name=study.study_name, storage=study._storage,
                                sampler=_seeded(name)[1])
    again = [resumed.ask(sweep.distributions).params["optim.lr"] for _ in range(3)]
    assert not set(again) & set(first)
    other_cell = optuna.create_study(sampler=_seeded(name)[1])
    assert [other_cell.ask(sweep.distributions).params["optim.lr"] for _ in range(3)] == first


def test_the_grid_sampler_runs_an_interrupted_point_again():
    """A void trial's grid point (interrupted, a dead worker's) was never evaluated: the slot that
    replaces it must run that point, not repeat a finished one."""
    sweep, sampler = _seeded("grid", 1, ("optim.lr=choice(0.0001,0.001,0.01,0.1)",))
    study = optuna.create_study(sampler=sampler)
    for number in range(4):
        trial = study.ask(sweep.distributions)
        if number == 1:
            trial.set_user_attr(VOID_ATTR, "interrupted")
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, 1.0)
    trial = study.ask(sweep.distributions)
    assert trial.params["optim.lr"] == study.trials[1].params["optim.lr"]


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_study_continues_whatever_the_order_of_its_fixed_overrides(tmp_path):
    from hydra_plugins.attnres_optuna_sweeper._runner import SweepRunner
    from hydra_plugins.attnres_optuna_sweeper._storage import open_storage

    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat_interval=60, grace_period=None)
    runner = object.__new__(SweepRunner)
    runner.settings = AttnresOptunaSweeperConf()
    lr = "optim.lr=interval(1e-4,1e-2)"
    runner._open_study("s", plan("model.layers=8", "train.tokens=1000", lr), storage, [], n_trials=4)
    _, created = runner._open_study("s", plan("train.tokens=1000", "model.layers=8", lr), storage, [], n_trials=4)
    assert not created
    with pytest.raises(SweeperConfigError, match="would not be comparable"):
        runner._open_study("s", plan("train.tokens=1000", "model.layers=4", lr), storage, [], n_trials=4)
    storage.engine.dispose()


@pytest.mark.parametrize(
    "url, message",
    [
        ("postgres://user:secret@host/db", "'postgres://user:\\*\\*\\*@host/db' is not a database URL"),
        ("sqlit:///optuna.db", "unknown database kind"),
        ("sqlite:////proc/no/such/optuna.db", "cannot create its folder"),
    ],
)
def test_a_bad_storage_url_is_one_clear_line(tmp_path, url, message):
    from hydra_plugins.attnres_optuna_sweeper._storage import resolve_url

    with pytest.raises(SweeperConfigError, match=message):
        resolve_url(url, tmp_path)


def test_a_run_refused_as_busy_is_a_trial_not_run():
    """The harness's refusal of a config another process trains is the one the sweeper voids."""
    from harness.checkpoint import RunBusy

    assert issubclass(RunBusy, pruning.TrialNotRun)
