"""Which config keys make a run what it is: a module of its own, without torch, so that the
Optuna sweeper can compare a study's overrides without importing the training stack. Used by the
run folders (harness.checkpoint.run_key), run names (harness.job.run_label) and the sweeper's
check that a continued study keeps its overrides."""

# Keys that do not change what a run computes (prefixes of flattened keys): a run's folder
# (harness.checkpoint.run_key) and an Optuna study's fixed overrides ignore them.
NOT_IDENTITY = (
    "tracking.", "train.progress", "train.checkpoint_dir", "train.resume", "train.checkpoint_interval",
    "train.log_interval", "train.threads", "train.keep_freed_memory", "train.distributed", "train.retry_failed",
    "train.code_change",
)


def override_key(line: str) -> str:
    """The key of a Hydra override line (`key=value`, `+key=value`, `++key=value`, `~key`)."""
    return line.lstrip("+~").split("=", 1)[0]


# A config group whose keys are all outside the identity (`tracking=off`) is outside it too, so it
# neither renames runs nor stops an Optuna study from being continued.
GROUPS_NOT_IDENTITY = tuple(p[:-1] for p in NOT_IDENTITY if p.endswith("."))


def changes_the_run(line: str) -> bool:
    """Whether a command-line override can change what a run computes: neither Hydra's own
    (`hydra.*`, `hydra/...`) nor one of the NOT_IDENTITY keys or groups."""
    key = override_key(line)
    return not (key in ("hydra", *GROUPS_NOT_IDENTITY)
                or key.startswith(("hydra.", "hydra/", *NOT_IDENTITY)))
