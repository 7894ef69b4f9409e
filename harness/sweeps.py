"""The `sweep` config group: every `sweeps/NAME.yaml` becomes `python run.py -m +sweep=NAME`.

Design decision: the sweep definitions live in `sweeps/` at the project root (where a researcher
looks for them, and where the Optuna sweeper's `lr.yaml` lives), but Hydra finds a config group
only as a folder named after the group inside a search-path root. Rather than rename the folder to
`conf/sweep/` or add a symlink, each file is stored in Hydra's ConfigStore under group `sweep`
with the package its `# @package` header names. Defaults lists inside the files (e.g.
`override /hydra/sweeper: ...`) work as in any config file. Loading a handful of small YAML
files at import costs about a millisecond.
"""
from __future__ import annotations

import re
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

SWEEPS_DIR = Path(__file__).resolve().parents[1] / "sweeps"
_PACKAGE = re.compile(r"^#\s*@package\s+(\S+)\s*$")


def header_package(text: str) -> str | None:
    """The `# @package X` of a config file's leading comment block, as Hydra reads it."""
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        match = _PACKAGE.match(line)
        if match:
            return match.group(1)
    return None


def register(folder: Path = SWEEPS_DIR) -> list[str]:
    """Store every sweeps/*.yaml as option NAME of the group `sweep`; returns the names."""
    names = []
    store = ConfigStore.instance()
    for path in sorted(folder.glob("*.yaml")):
        text = path.read_text()
        store.store(
            group="sweep", name=path.stem, node=OmegaConf.create(text),
            package=header_package(text), provider=f"attnres sweeps ({folder})",
        )
        names.append(path.stem)
    return names
