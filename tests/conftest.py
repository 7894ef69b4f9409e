import os
import sys
from pathlib import Path

# Tests import the project from the checkout (run.py, conf/ and sweeps/ live beside the packages).
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("MPLBACKEND", "Agg")
