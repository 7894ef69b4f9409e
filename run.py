#!/usr/bin/env python
"""Train one model (or, with -m, one per combination) and record it in MLflow.

    python run.py                                           # the CPU-sized default run
    python run.py residual=block model.layers=16            # any group or key, on the command line
    python run.py -m residual=block,full,mhc model.layers=16  # a multirun: one child run each
    python run.py -m +sweep=ablation                        # a ready sweep (sweeps/*.yaml)
    python run.py --cfg job                                 # the composed config, nothing run
    torchrun --standalone --nproc_per_node=8 run.py model=194m train=gpu  # data-parallel (docs/DISTRIBUTED.md)

Returns the final validation loss (for sweepers). Everything else lives in harness/
(docs/HARNESS.md): config (schemas, validation), job (one run: accept, acquire, build, fit,
record), train (the loop), tracking (MLflow), checkpoint, stopping (signals, exit codes),
provenance, dynamics (depth weights and magnitudes over training), callbacks (multirun parent run).
"""
from harness import openmp

# OpenMP's idle workers spin briefly, then sleep: fast on an idle machine, no collapse on a shared
# one (harness/openmp.py says why). Before torch loads OpenMP; a user's own setting wins.
openmp.set_wait_policy()

import hydra
from omegaconf import DictConfig

from harness import composition_errors
from harness.config import register

register()
# A misspelt key, a wrong type, an unknown option: one line and exit 2, not Hydra's report (exit 1).
composition_errors.install()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from harness.job import run  # torch, MLflow and data load only once a job really runs

    return run(cfg)


if __name__ == "__main__":
    import sys

    from harness.launch import torchrun_overrides

    # Under torchrun: all ranks in one output folder, rank 0 its only writer; -m refused (harness/launch.py).
    sys.argv += torchrun_overrides(sys.argv)
    try:
        main()
    except ValueError as error:  # Hydra's check of its flags (-m with --cfg) runs outside its report
        composition_errors.exit_if_composition_error(error)
        raise
