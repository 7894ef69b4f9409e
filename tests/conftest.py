import os
import sys
from pathlib import Path

# Tests import the project from the checkout (run.py, conf/ and sweeps/ live beside the packages).
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("MPLBACKEND", "Agg")
# Not as run.py does (a short spin, harness/openmp.py): the tests share a busy machine, where passive
# waiting is the safe choice.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Triton decides at import whether its kernels (and its own standard library) are interpreted: set
# for the whole process, before any test module imports it, so the order of the tests cannot matter.
# Tests that compile for a GPU run their scripts in a subprocess without it.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hydra scans the hydra_plugins namespace once per process, the first time any test composes a
# config, and re-executes the plugin modules it finds in place: classes a test module imported
# before that scan (the sweeper's SweeperConfigError, say) are then no longer the ones raised.
# Scanning here, before any test module is imported, makes the order of the tests irrelevant.
from hydra.core.plugins import Plugins  # noqa: E402

Plugins.instance()
