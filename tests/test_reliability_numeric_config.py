"""Every numeric config field, of every group, is checked for finiteness and range in one place
(harness.config.RANGES): NaN, ±inf and integers past what torch and numpy take are one line and
exit 2, never a traceback, a diverged or FAILED run, or a setting silently switched off."""
import copy
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from harness.config import INT_MAX, RANGES, ConfigError, numeric_fields, to_objects, validate
from harness_testing import TINY, compose, run_cli, runs

# sweep.arch is set by the arch and scaling sweeps only: composed with one so its fields are walked too
GROUPS = {"default": [], "arch": ["+sweep=arch"]}


def _composed():
    """(group, key, the field's Python type) for every numeric field of the composed configs."""
    out = []
    for group, extra in GROUPS.items():
        cfg = compose([*TINY, *extra])
        defaults = to_objects(compose([*TINY, *extra]))
        for key, value in numeric_fields(defaults).items():
            if group != "default" and not key.startswith("sweep.arch"):
                continue
            out.append((group, key, _kind(cfg, key, value)))
    return out


def _kind(cfg, key, value) -> type:
    """int or float, from the schema's node (a None default has no value to tell it)."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent)._get_node(leaf)
    name = type(node).__name__ if not isinstance(value, (list, tuple)) else type(node._get_node(0)).__name__
    return float if "Float" in name else int


FIELDS = _composed()
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf]
HUGE_INTS = [2**63, 10**23, -(2**63) - 1]


_BASE = {group: compose([*TINY, *extra]) for group, extra in GROUPS.items()}


def _with(group, key, value):
    cfg = copy.deepcopy(_BASE[group])
    current = OmegaConf.select(cfg, key)
    if isinstance(current, (list, tuple)) or OmegaConf.is_list(OmegaConf.select(cfg, key)):
        value = [value, *list(current)[1:]]  # the first element bad, the rest as they were
    OmegaConf.update(cfg, key, value, force_add=False)
    return cfg


def test_every_numeric_field_has_a_range():
    keys = {key for _, key, _ in FIELDS}
    assert len(keys) > 40  # the walk found the groups' fields, not an empty tree
    assert keys - set(RANGES) == set(), "a numeric field without a range in harness.config.RANGES"
    assert set(RANGES) - keys == set(), "a range for a field that no longer exists"


@pytest.mark.parametrize("group, key, kind", FIELDS, ids=[f"{k}" for _, k, _ in FIELDS])
def test_non_finite_and_huge_values_are_one_line_config_errors(group, key, kind):
    for value in SPECIAL_FLOATS if kind is float else HUGE_INTS:
        with pytest.raises(ConfigError) as refused:
            validate(_with(group, key, value))
        assert "\n" not in str(refused.value) and key.rsplit(".", 1)[-1] in str(refused.value), (value, refused.value)


_floats = st.one_of(st.sampled_from([*SPECIAL_FLOATS, 0.0, -0.0, -1.0, 1e308, -1e308, 5e-324]), st.floats())
_ints = st.one_of(st.sampled_from([*HUGE_INTS, 0, -1, INT_MAX, 2**31, 2**40]), st.integers())


@pytest.mark.parametrize("group, key, kind", FIELDS, ids=[f"{k}" for _, k, _ in FIELDS])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_value_is_accepted_or_refused_in_one_line(group, key, kind, data):
    """Property: whatever number a field is given, validation returns a plan or raises one
    ConfigError line; a non-finite number or an integer past int64 is always refused."""
    value = data.draw(_floats if kind is float else _ints)
    try:
        spec = validate(_with(group, key, value))
    except ConfigError as error:
        assert "\n" not in str(error)
        return
    assert not (isinstance(value, float) and not math.isfinite(value)), (key, value)
    assert not (isinstance(value, int) and abs(value) > INT_MAX), (key, value)
    assert spec.steps >= 1


@pytest.mark.parametrize("override", ["optim.lr=nan", "train.seed=99999999999999999999999",
                                      pytest.param("optim.grad_clip=nan", marks=pytest.mark.slow),
                                      pytest.param("train.flops=inf", marks=pytest.mark.slow)])
def test_run_py_refuses_in_one_line_and_leaves_nothing(override, tmp_path):
    result = run_cli([*TINY, override], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and override.split("=")[0] in lines[0], lines
    assert runs(tmp_path) == [] and not (tmp_path / "ckpt").exists() and not (tmp_path / "out").exists()
