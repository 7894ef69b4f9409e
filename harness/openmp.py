"""How OpenMP's idle workers wait between torch's parallel ops: set by run.py before torch loads.

Imports nothing but the standard library: it must run before `import torch` (libgomp reads its
environment once, when torch loads it).

Why a short spin (GOMP_SPINCOUNT=1000) rather than either extreme, measured on the project's
2-core CPU VM (default model at `model.layers=16`, 2 threads, median step; benchmarks/
RESULTS_HARNESS.md):
- libgomp's default spins ~300,000 iterations after every parallel op. Fast alone, but when the
  cores are shared (two jobs at once, another process) the spinning workers take the cores from
  the threads that have work: earlier runs on a busy machine were 20-100x slower.
- OMP_WAIT_POLICY=PASSIVE (what run.py set before) never collapses, but every worker sleeps
  between ops, and at this project's CPU sizes ops last 0.1-1 ms: alone, a step took 220-270 ms
  against 140-170 with a short spin, and `python run.py` trained in 8 s instead of 5.
- GOMP_SPINCOUNT=1000 keeps nearly all of the spinning speed alone (140-170 ms) and bounds the
  harm when shared: two such jobs at once 364 ms a step each against 275 with PASSIVE and
  1,210 with a spin of 10,000 (libgomp's default spins longer still).
A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = "1000"


def set_wait_policy(environ: MutableMapping[str, str] = os.environ) -> None:
    """Give OpenMP a short spin (see the module docstring) unless the user chose how it waits."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
