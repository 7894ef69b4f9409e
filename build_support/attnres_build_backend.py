"""The project's build backend: setuptools' own, plus `attnres_lm_eval_hook.pth` in every wheel.

pyproject.toml names this module (`build-backend`, found through `backend-path`). Every PEP 517
hook is setuptools.build_meta's own, unchanged. `build_wheel` (`pip install .`, `pip wheel .`) and
`build_editable` (`pip install -e .`, PEP 660) also write one line, the .pth that lets the stock
`lm_eval` command find the model `attnres` (see attnres_lm_eval_hook.py for why it exists), at the
root of the wheel they built. Files at a wheel's root install into site-packages, which is where
Python reads .pth files. The line is added to the wheel's RECORD with its hash, so pip installs it,
lists it and uninstalls it like any other file.

Why a backend and not setuptools options: setuptools has no setting that puts a file at the root
of site-packages. `data_files` install under sys.prefix, not site-packages. A custom `build_py`
reaches regular wheels only. Editable wheels hold nothing but setuptools' own finder and .pth,
built by its `editable_wheel` command, which setuptools documents as internal. Here only the
standard hooks (their names, arguments, and the wheel file name they return) and the wheel format
(PEP 427: RECORD rows `path,sha256=<urlsafe base64, no padding>,size`) are relied on, so this works
the same with whatever setuptools version build isolation installs.
"""
from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # every other hook, unchanged

PTH_NAME = "attnres_lm_eval_hook.pth"
# One line, run by site at start-up. If the hook module is missing (an editable install whose
# checkout was removed), it does nothing rather than print an error at every start.
PTH_LINE = ('import importlib.util; importlib.util.find_spec("attnres_lm_eval_hook") '
            'and __import__("attnres_lm_eval_hook").install()\n')


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_to_wheel(Path(wheel_directory, name), PTH_NAME, PTH_LINE.encode())
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    add_to_wheel(Path(wheel_directory, name), PTH_NAME, PTH_LINE.encode())
    return name


def add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Rewrite `wheel` with one more root file `name`, and with that file in its RECORD."""
    rewritten = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as dst:
        if name in src.namelist():
            raise ValueError(f"{wheel.name} already holds {name}")
        records = [i for i in src.infolist() if i.filename.count("/") == 1 and i.filename.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise ValueError(f"{wheel.name}: expected one .dist-info/RECORD, found {[i.filename for i in records]}")
        record = records[0]
        for info in src.infolist():
            if info is not record:
                dst.writestr(info, src.read(info))
        entry = zipfile.ZipInfo(name, date_time=record.date_time)  # the wheel's own timestamp: reproducible
        entry.external_attr = 0o644 << 16
        entry.compress_type = zipfile.ZIP_DEFLATED
        dst.writestr(entry, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows = src.read(record).decode()
        dst.writestr(record, rows + ("" if rows.endswith("\n") else "\n") + f"{name},sha256={digest},{len(data)}\n")
    os.replace(rewritten, wheel)
