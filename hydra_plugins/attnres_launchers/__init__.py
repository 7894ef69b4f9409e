"""Hydra launchers on submitit that know the harness's checkpoint-and-requeue contract.

``hydra/launcher=slurm`` (conf/hydra/launcher/slurm.yaml) sends each job of a multirun to SLURM;
``hydra/launcher=local_gpus`` runs the jobs on this machine, in parallel, one GPU each. See
docs/HARNESS.md ("Launchers") and docs/RELIABILITY.md ("Requeue on SLURM"). The modules whose
names start with ``_`` hold the implementation: Hydra's plugin scan skips them, so an app that
does not launch with these never imports submitit.
"""
