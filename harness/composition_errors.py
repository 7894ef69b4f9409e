"""Hydra's composition errors as one line, `error: <key>=<value>: <what is wrong>; allowed: <...>`,
and exit code 2 — the harness's form for bad input (docs/RELIABILITY.md).

Hydra reports a misspelt key, a wrong type or an unknown option in several lines and exits 1, which
a script cannot tell from a crash. Only composition errors are translated: a job's own exception
keeps its traceback, and `HYDRA_FULL_ERROR=1` still gives Hydra's report.
"""
from __future__ import annotations

import difflib
import os
import re
import sys
from typing import Any, Iterable

from hydra.errors import CompactHydraException, ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError
from omegaconf.nodes import BooleanNode, BytesNode, EnumNode, FloatNode, IntegerNode, PathNode, StringNode

GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic"


def install() -> None:
    """Make `@hydra.main` print composition errors as one line and exit 2 (idempotent).

    Wraps Hydra's private `run_and_report`, through which every composition runs: composing once
    more up front would need a second reading of the command line (sweep syntax, --config-dir).
    Should the name move, Hydra's own report comes back (the bad-input tests would say so)."""
    try:
        import hydra._internal.utils as hydra_utils

        original = hydra_utils.run_and_report
    except (ImportError, AttributeError):  # another Hydra: its own report stays
        return
    if getattr(original, "one_line_composition_errors", False):
        return

    def run_and_report(func: Any) -> Any:
        def guarded() -> Any:
            try:
                return func()
            except Exception as error:
                exit_if_composition_error(error)
                exit_if_one_line(error)
                exit_if_output_folder_refused(error)
                raise

        return original(guarded)

    run_and_report.one_line_composition_errors = True  # type: ignore[attr-defined]
    hydra_utils.run_and_report = run_and_report


def exit_if_composition_error(error: BaseException) -> None:
    """Print `error: <line>` and exit 2 if `error` is a composition error; else return."""
    line = None if os.environ.get("HYDRA_FULL_ERROR") == "1" else describe(error)
    if line is not None:
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(2)


def exit_if_one_line(error: BaseException) -> None:
    """An error that is its own one-line report (it has an `exit_code`: the Optuna sweeper's bad
    options and aborted sweeps): print it and exit with that status, without Hydra's hint about
    HYDRA_FULL_ERROR after it; else return."""
    code = getattr(error, "exit_code", None)
    if isinstance(code, int) and isinstance(error, CompactHydraException) and os.environ.get("HYDRA_FULL_ERROR") != "1":
        print(f"error: {error}" if code == 2 else str(error), file=sys.stderr, flush=True)  # 2: bad input
        sys.exit(code)


def exit_if_output_folder_refused(error: BaseException) -> None:
    """Hydra makes a job's output folder (hydra.run.dir, hydra.sweep.dir) and writes its config
    copy there before the job runs: a folder that cannot be made or written is bad input, one line
    and exit 2, not Hydra's traceback. Only an OSError raised by Hydra's own job setup (run_job),
    never one from inside the job, which keeps its own handling."""
    if not isinstance(error, OSError) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    in_job = any(f.filename.endswith(("harness/job.py", "run.py")) and f.name in ("main", "run", "_run") for f in frames)
    if in_job or not any(f.name == "run_job" and "hydra" in f.filename for f in frames):
        return
    print(f"error: hydra.run.dir / hydra.sweep.dir: cannot create or write the output folder {error.filename} "
          f"({error.strerror}); allowed: a writable folder", file=sys.stderr, flush=True)
    sys.exit(2)


def is_composition_error(error: BaseException | None) -> bool:
    return isinstance(error, (ConfigCompositionException, OverrideParseException))


def describe(error: BaseException) -> str | None:
    """`<key>=<value>: <what is wrong>; allowed: <...>` for a composition error, else None."""
    if isinstance(error, OverrideParseException):
        key, sep, value = str(error.override).partition("=")
        if sep and value.startswith("~"):
            # Hydra's grammar reads a leading ~ as its delete operator and refuses it in a value,
            # and the shell leaves ~ alone after `data.path=` (not a variable name): a home path
            # must come expanded or quoted.
            return (f"{error.override}: ~ is not allowed unquoted in a value; allowed: "
                    f"{key}=$HOME{value[1:]} (the shell expands it) or '{key}=\"{value}\"'")
        reason = _first_line(error.message)
        return f"{error.override}: not a valid override ({reason}); allowed: key=value, +key=value, " \
               f"++key=value, ~key, group=option ({GRAMMAR})"
    if isinstance(error, MissingConfigException):
        return _missing_option(error)
    if isinstance(error, ConfigCompositionException):
        return _composition(error)
    if isinstance(error, CompactHydraException) and is_composition_error(error.__cause__):
        return describe(error.__cause__)  # e.g. the Optuna sweeper's check that every cell composes
    if isinstance(error, ValueError) and str(error).startswith(_ONE_COMMAND):
        return ("-m/--multirun, --cfg, --info and --run are separate commands: give one "
                "(a sweep's config: `--cfg job` without -m shows the sweep file's own values)")
    return None


_ONE_COMMAND = "Only one of --run, --multirun, --cfg"  # Hydra's check of its command flags


def unknown_key(full_key: str, value: Any, allowed: Iterable[str], override: str | None = None) -> str:
    """The line for a key the schema does not have, naming its section and close matches."""
    section, _, key = full_key.rpartition(".")
    allowed = [str(k) for k in allowed]
    close = difflib.get_close_matches(key, allowed, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    where = section or "the config"
    return f"{override or f'{full_key}={value}'}: {where} has no key {key!r}{hint}; allowed: {', '.join(allowed)}"


def _composition(error: ConfigCompositionException) -> str:
    text = str(error)
    first = _first_line(text)
    cause = error.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        keys = list(cause.parent_node.keys()) if isinstance(cause.parent_node, DictConfig) else []
        appended = _match(r"To append to your config use \+(.+)$", text)
        return unknown_key(str(cause.full_key), "?", keys, appended)
    if isinstance(cause, ValidationError) and cause.full_key:
        override = _match(r"^Error merging override (.+)$", first) or f"{cause.full_key}={cause.value}"
        return _wrong_value(override, cause)
    if m := re.match(r"(?:In '.*': )?Could not override '(.+?)'\.", first):
        key = m.group(1)
        override = _match(r"use \+(.+)$", text) or key
        suggestion = _match(r"Did you mean to override (.+)\?", text)
        if suggestion:
            return f"{override}: {key} is not a config group of this config; allowed: {suggestion}"
        return f"{override}: {key} is not in the defaults list, so it cannot be overridden; " \
               f"allowed: +{override} (adds it)"
    if m := re.match(r"Could not append to config\. An item is already at '(.+?)'", first):
        key, plain = m.group(1), _match(r"Either remove \+ prefix: '(.+)'", text) or m.group(1)
        return f"+{plain}: {key} already exists and + only adds new keys; allowed: {plain} (overrides it) " \
               f"or ++{plain} (adds or overrides)"
    if m := re.match(r"Multiple values for (.+?)\. To override a value use 'override .+?: (.+)'", first):
        key, option = m.groups()
        return f"+{key}={option}: {key} is already in the defaults list and + adds a second one; " \
               f"allowed: {key}={option} (replaces the default)"
    if m := re.match(r"Ambiguous value for argument '(.+)'", first) or re.match(
            r"Sweep parameters '(.+)' requires --multirun", first):
        override = m.group(1)
        return f"{override}: a sweep needs a multirun; allowed: python run.py -m {override} (one job per value), " \
               f"a list key=[a,b], a quoted string key='a,b'"
    if m := re.match(r"Could not delete from config\. '(.+?)' does not exist", first):
        return f"~{m.group(1)}: there is nothing at {m.group(1)} to delete; allowed: ~<an existing key>"
    return " ".join(line.strip() for line in _without_search_path(text).splitlines() if line.strip())


def _missing_option(error: MissingConfigException) -> str:
    path = error.missing_cfg_file or ""
    if not error.options or "/" not in path:  # e.g. a primary config (--config-name) that is not there
        return " ".join(line.strip() for line in _without_search_path(str(error)).splitlines() if line.strip())
    group, option = path.rsplit("/", 1)
    options = list(error.options)
    close = difflib.get_close_matches(option, options, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return f"{group}={option}: no option {option!r} in group {group}{hint}; allowed: {', '.join(options)}"


def _wrong_value(override: str, cause: ValidationError) -> str:
    node = cause.child_node
    kind, allowed = _expected(node)
    optional = node is not None and node._is_optional()
    if cause.value is None and not optional:
        problem = "null is not allowed"
    elif kind:
        problem = f"not {kind}"
    else:
        problem = " ".join(_first_line(cause.msg).split())
    if override.lstrip("+~").split("=", 1)[0] != cause.full_key:  # a mapping set a whole section
        problem = f"{cause.full_key} is {problem}" if problem.startswith("not") else f"{cause.full_key}: {problem}"
    return f"{override}: {problem}; allowed: {allowed or 'a value of the field type'}{' or null' if optional else ''}"


def _expected(node: Any) -> tuple[str | None, str | None]:
    """(what the field is, the values it takes) from the schema's node for the field."""
    if isinstance(node, EnumNode):
        return "one of the choices", ", ".join(member.name for member in node.enum_type)
    kinds = [(BooleanNode, "a boolean", "true, false"), (IntegerNode, "an integer", "an integer"),
             (FloatNode, "a number", "a number"), (StringNode, "a string", "a string"),
             (PathNode, "a path", "a path"), (BytesNode, "bytes", "bytes"),
             (ListConfig, "a list", "a list [a,b,...]"), (DictConfig, "a mapping", "a mapping {key: value}")]
    return next(((noun, values) for cls, noun, values in kinds if isinstance(node, cls)), (None, None))


def _without_search_path(text: str) -> str:
    return text.split("Config search path:")[0]


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def _match(pattern: str, text: str) -> str | None:
    m = re.search(pattern, text, re.MULTILINE)
    return m.group(1).strip() if m else None
