"""From Hydra override syntax to a plan: fixed overrides, grid cells, and Optuna search dimensions.

A comma list (or ``glob(...)``) is a grid, one study per cell, never a search dimension; searching
is asked for with Hydra's ``interval``, ``range``, ``choice`` and ``tag(log, ...)``. Params entries
parse like command-line overrides (which replace them), and every job gets plain ``key=value``
overrides, visible in its ``overrides.yaml``. Syntax table: docs/SWEEPER.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import (
    ChoiceSweep,
    Glob,
    IntervalSweep,
    Override,
    QuotedString,
    RangeSweep,
)
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from .settings import SweeperConfigError

_KNOWN_TAGS = {"log", "int"}


@dataclass(frozen=True)
class Dimension:
    """One searched key: its Optuna distribution and how a sampled value becomes an override."""

    name: str  # Optuna parameter name: the config key (`optim.lr`)
    key: str  # the override's key as written, with any `+` prefix (`+optim.beta`)
    distribution: BaseDistribution
    # Categorical choices: (value, override text Hydra parses back to it). Pairs, not a dict,
    # because 1 == True == 1.0 would collapse distinct choices into one key.
    labels: tuple[tuple[Any, str], ...] = ()

    def override(self, value: Any) -> str:
        if isinstance(self.distribution, CategoricalDistribution):
            text = next(t for v, t in self.labels if type(v) is type(value) and v == value)
        elif isinstance(self.distribution, IntDistribution):
            text = str(int(value))
        else:
            # repr keeps every digit: the job must train with exactly the sampled value.
            text = repr(float(value))
        return f"{self.key}={text}"

    def grid_values(self) -> list[Any]:
        """The finite value list the grid sampler enumerates."""
        d = self.distribution
        if isinstance(d, CategoricalDistribution):
            return list(d.choices)
        if isinstance(d, IntDistribution):
            return list(range(d.low, d.high + 1, d.step))
        if isinstance(d, FloatDistribution) and d.step is not None:
            count = int(round((d.high - d.low) / d.step)) + 1
            return [d.low + i * d.step for i in range(count)]
        raise SweeperConfigError(
            f"sampler grid needs a finite set of values, but {self.name} is a continuous "
            "interval: use choice(...) or range(...), or another sampler"
        )


@dataclass(frozen=True)
class Cell:
    """One grid cell: the overrides that fix it and the labels that name its study."""

    overrides: tuple[str, ...]
    labels: tuple[str, ...]  # "residual=block", "model.layers=16"

    def study_name(self, prefix: str) -> str:
        return "/".join((prefix, *self.labels))

    def values(self) -> dict[str, str]:
        return dict(label.split("=", 1) for label in self.labels)


@dataclass(frozen=True)
class Plan:
    fixed: tuple[str, ...]  # overrides every job gets unchanged
    cells: tuple[Cell, ...]
    dimensions: tuple[Dimension, ...]

    @property
    def distributions(self) -> dict[str, BaseDistribution]:
        return {d.name: d.distribution for d in self.dimensions}


def build_plan(
    arguments: Sequence[str], params: Mapping[str, Any], parser: OverridesParser
) -> Plan:
    """Split overrides into fixed ones, grid cells and search dimensions.

    A grid axis of the sweep's params that the command line narrows to one value stays an axis
    of one value: `+sweep=lr residual=block` studies block in `lr/residual=block`, and a later
    `residual=full` gets a study of its own, not block's (whose trials it would find done)."""
    by_key: dict[str, Override] = {}
    param_axes: set[str] = set()
    for line in _params_as_overrides(params):
        override = _parse(parser, line)
        by_key[override.key_or_group] = override
        if override.is_sweep_override() and _is_grid_axis(override):
            param_axes.add(override.key_or_group)
    for line in arguments:
        override = _parse(parser, line)
        # Re-inserting moves nothing: dict keeps the first position, the later value wins.
        by_key[override.key_or_group] = override

    fixed: list[str] = []
    grid: list[list[tuple[str, str]]] = []  # per grid key: (override, label) per value
    dimensions: list[Dimension] = []
    for override in by_key.values():
        if not override.is_sweep_override() and override.key_or_group in param_axes:
            label = f"{override.get_key_element().lstrip('+')}={override.get_value_element_as_str()}"
            grid.append([(override.input_line, label)])
        elif not override.is_sweep_override():
            fixed.append(override.input_line)
        elif _is_grid_axis(override):
            key = override.get_key_element()
            label_key = key.lstrip("+")
            grid.append(
                [(f"{key}={v}", f"{label_key}={v}") for v in override.sweep_string_iterator()]
            )
        else:
            dimensions.append(_dimension(override))

    if not dimensions:
        raise SweeperConfigError(
            "nothing to search: give at least one interval(...), range(...) or choice(...), "
            "e.g. optim.lr='tag(log,interval(1e-4,3e-2))' (comma lists are grid axes)"
        )
    cells = tuple(
        Cell(tuple(o for o, _ in combo), tuple(label for _, label in combo))
        for combo in itertools.product(*grid)
    )
    return Plan(tuple(fixed), cells, tuple(dimensions))


def enqueued_points(points: Sequence[Mapping[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    """``hydra.sweeper.enqueue`` as flat {param: value} dicts, checked against the searched keys."""
    names = {d.name for d in plan.dimensions}
    flat_points = []
    for point in points:
        flat = _flatten(point)
        unknown = sorted(set(flat) - names)
        if unknown:
            raise SweeperConfigError(
                f"hydra.sweeper.enqueue: {unknown[0]} is not a searched parameter "
                f"(searched: {', '.join(sorted(names))})"
            )
        flat_points.append(flat)
    return flat_points


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{optim: {lr: x}} and {optim.lr: x} both become {"optim.lr": x}."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _params_as_overrides(params: Mapping[str, Any]) -> list[str]:
    lines = []
    for full, value in _flatten(params).items():
        if isinstance(value, str):
            lines.append(f"{full}={value}")
        elif value is None:
            lines.append(f"{full}=null")
        elif isinstance(value, bool):
            lines.append(f"{full}={str(value).lower()}")
        elif isinstance(value, (int, float)):
            lines.append(f"{full}={value!r}")
        else:
            raise SweeperConfigError(
                f"hydra.sweeper.params.{full}: write lists as a string, 'a,b' for a grid or "
                "'choice(a,b)' to search"
            )
    return lines


def _parse(parser: OverridesParser, line: str) -> Override:
    try:
        # parse_overrides (not parse_override) hands the override the config loader that
        # glob() needs to list a group's options.
        return parser.parse_overrides([line])[0]
    except Exception as error:  # Hydra's grammar errors carry a multi-line parse tree
        message = str(error).strip().splitlines()[0]
        raise SweeperConfigError(f"cannot parse override {line!r}: {message}") from None


def _is_grid_axis(override: Override) -> bool:
    """A comma list (`a,b`) or a glob over a config group; `choice(a,b)` is searched."""
    value = override.value()
    return isinstance(value, Glob) or (isinstance(value, ChoiceSweep) and value.simple_form)


def _dimension(override: Override) -> Dimension:
    name = override.key_or_group
    key = override.get_key_element()
    sweep = override.value()
    tags = set(getattr(sweep, "tags", set()))
    unknown = tags - _KNOWN_TAGS
    if unknown:
        raise SweeperConfigError(
            f"{name}: unknown tag {sorted(unknown)[0]!r} (known: {', '.join(sorted(_KNOWN_TAGS))})"
        )
    log = "log" in tags
    try:
        if isinstance(sweep, IntervalSweep):
            if "int" in tags:
                dist: BaseDistribution = IntDistribution(
                    math.ceil(sweep.start), math.floor(sweep.end), log=log
                )
            else:
                dist = FloatDistribution(float(sweep.start), float(sweep.end), log=log)
            return Dimension(name, key, dist)
        if isinstance(sweep, RangeSweep):
            return Dimension(name, key, _range_distribution(sweep, log))
        assert isinstance(sweep, ChoiceSweep)
        if log:
            raise ValueError("tag(log, ...) applies to interval() and range(), not choice()")
        labels = tuple(
            (_choice_value(value, text), text)
            for value, text in zip(sweep.list, override.sweep_string_iterator(), strict=True)
        )
        choices = [value for value, _ in labels]
        return Dimension(name, key, CategoricalDistribution(choices), labels)
    except ValueError as error:
        raise SweeperConfigError(f"{name}: {error}") from None


def _range_distribution(sweep: RangeSweep, log: bool) -> BaseDistribution:
    if sweep.step == 0:
        raise ValueError("range() step must not be 0")
    values = list(sweep.range())  # Hydra's own enumeration, as the basic sweeper uses it
    if not values:
        raise ValueError(f"range({sweep.start}, {sweep.stop}, {sweep.step}) is empty")
    low, high, step = min(values), max(values), abs(sweep.step)
    if all(isinstance(v, int) for v in (sweep.start, sweep.stop, sweep.step)):
        # Optuna's log-scaled integers must have step 1; it says so itself if not.
        return IntDistribution(int(low), int(high), log=log, step=int(step))
    if log:
        raise ValueError("tag(log, range(...)) needs integer bounds; use interval() for floats")
    # Rounding undoes float drift (0.1 + 0.1 + 0.1 = 0.30000000000000004) that Optuna warns about.
    return FloatDistribution(round(float(low), 12), round(float(high), 12), step=float(step))


def _choice_value(value: Any, text: str) -> Any:
    """What Optuna stores for a choice: the plain value, or the override text for the rest."""
    if isinstance(value, QuotedString):
        return value.text
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return text  # lists and dicts: Optuna stores primitives only, the text is unambiguous
