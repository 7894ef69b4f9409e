"""Which config keys make a run what it is: a module of its own, without torch, so that the
Optuna sweeper can compare a study's overrides without importing the training stack."""

# Keys that do not change what a run computes (prefixes of flattened keys): a run's folder
# (harness.checkpoint.run_key) and an Optuna study's fixed overrides ignore them.
NOT_IDENTITY = (
    "tracking.", "train.progress", "train.checkpoint_dir", "train.resume", "train.checkpoint_interval",
    "train.log_interval", "train.threads", "train.keep_freed_memory", "train.distributed", "train.retry_failed",
)
