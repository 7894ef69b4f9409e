"""A Hydra sweeper on Optuna 5 that treats comma lists as a grid of studies and prunes.

Select it with ``hydra/sweeper=attnres_optuna``; see ``docs/SWEEPER.md``. The modules whose
names start with ``_`` hold the implementation: Hydra's plugin scan skips them, so a Hydra app
that does not sweep never pays for importing Optuna or MLflow.
"""
