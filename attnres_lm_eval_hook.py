"""Lets the stock `lm_eval` command find the model `attnres`. lm-eval 0.4.13 has no plugin discovery.

    pip install -e ".[dev]"        # or pip install ".[eval]"
    lm_eval --model attnres --model_args pretrained=<path or run id> --tasks hellaswag,lambada_openai,wikitext

The problem: lm-eval 0.4.13 resolves `--model NAME` against a registry that holds only lm-eval's
own models (`lm_eval/models/__init__.py` lists them). Nothing in that version loads models from
other packages: no entry-point group, no environment variable, and `--include_path` reads task
YAMLs only. The `lm_eval` console script never imports this project, so `attnres` is unknown.

What this does: the project declares its model the way later lm-eval releases discover plugins,
as an entry point (pyproject.toml, `[project.entry-points."lm_eval.models"]`,
`attnres = "evaluation.lm_eval_adapter:AttnResLM"`). This module reads that entry point in place
of lm-eval 0.4.13, and only at the moment lm-eval needs it: once `lm_eval.models` has been
imported, it registers `attnres` in lm-eval's model registry. The registration is lazy, a
"module:object" string such as lm-eval uses for its own models, so torch and the adapter are
imported only when a run asks for `--model attnres`. `lm_eval.models` is the module to wait for
because lm-eval's `get_model` imports it when the registry is empty. Registering earlier would
make the registry non-empty, so `get_model` would skip that import and lose lm-eval's own
models (hf, vllm, ...).

How it gets run: `attnres_lm_eval_hook.pth`, which the build backend
(build_support/attnres_build_backend.py) adds to every wheel, editable ones included. Python runs
the `import` line of each .pth file in site-packages at start-up. That line calls `install()`.
`install()` puts one finder at the front of `sys.meta_path`, and imports and registers nothing
else. The finder compares each import's name with "lm_eval.models" and does nothing for every
other import. If the hook module is missing (for example, an editable install whose checkout was
deleted), the .pth line does nothing rather than print an error at every start. If lm-eval is
not installed, the finder is never triggered.

Why a .pth file: lm-eval 0.4.13 has no plugin mechanism, so code from this project must run
inside the `lm_eval` process before lm-eval looks the model up. In a Python environment, only
startup files in site-packages (.pth, or a sitecustomize module shared with every other package)
can do that without a wrapper command. A .pth file is the narrower of the two, and it is what
setuptools itself uses for editable installs. Other options were rejected for these reasons. A
second console script named `lm_eval` would overwrite lm-eval's own. A wrapper command already
exists (`python -m evaluation.lm_eval_cli`), but it is not the stock command. With an lm-eval
release that reads the `lm_eval.models` entry points itself, this hook adds nothing, and both
paths give the same registration: whichever runs first registers the name and the other skips it.

Rules kept: models already registered win (as in lm-eval's own plugin discovery), so this never
replaces one of lm-eval's models. Only this distribution's own entry points are registered, not
those of other installed packages. If the adapter's top-level package cannot be found, nothing
is registered, and `--model attnres` gives lm-eval's usual "no model for this name found". A
failure while registering is a warning, never an error in lm-eval's own import.
"""
from __future__ import annotations

import sys

WATCHED = "lm_eval.models"
DISTRIBUTION = "attnres"
ENTRY_POINT_GROUP = "lm_eval.models"


def install() -> None:
    """Put the finder in front of the import system, once per process (several site folders may
    each hold the .pth, e.g. a virtual environment with system site-packages)."""
    if not any(isinstance(f, _RegisterAfterLmEvalModels) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLmEvalModels())


def register_models() -> list[str]:
    """Register this distribution's `lm_eval.models` entry points lazily in lm-eval's registry.

    Returns the names registered. Names already registered are left alone, and so are entry
    points whose top-level package cannot be imported."""
    from importlib.metadata import PackageNotFoundError, distribution
    from importlib.util import find_spec

    from lm_eval.api.registry import model_registry

    try:
        entry_points = distribution(DISTRIBUTION).entry_points.select(group=ENTRY_POINT_GROUP)
    except PackageNotFoundError:  # the hook is importable but the project is not installed
        return []
    registered = []
    for ep in entry_points:
        if ep.name in model_registry or find_spec(ep.module.partition(".")[0]) is None:
            continue
        model_registry.register(ep.name, target=ep.value)  # "module:object", imported on first use
        registered.append(ep.name)
    return registered


class _RegisterAfterLmEvalModels:
    """A meta path finder that finds nothing by itself. When `lm_eval.models` is imported, it gets
    the module's spec from the finders after it. It then wraps the spec's loader so that
    `register_models` runs right after lm-eval has filled its registry. After that one time it
    removes itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != WATCHED:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister:
    """A loader that runs the real loader, gives the module its real loader back, and then
    registers. Any other attribute is read from the real loader."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self._loader
        try:
            register_models()
        except Exception as e:  # noqa: BLE001  (a broken registration must not break `import lm_eval.models`)
            import warnings

            warnings.warn(f"attnres: could not register the lm-eval model 'attnres': {e!r}", stacklevel=2)
