"""How OpenMP's idle workers wait between torch's parallel ops: set by run.py before torch loads.

Imports nothing but the standard library: it must run before `import torch` (libgomp reads its
environment once, when torch loads it).

A short spin (GOMP_SPINCOUNT=1000): libgomp's default spin takes the cores from the threads with
work when two jobs share a machine, and a passive wait sleeps between ops that last well under a
millisecond at CPU sizes; the figures are in benchmarks/RESULTS_HARNESS.md.
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
