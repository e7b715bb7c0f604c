"""Every numeric policy parameter declares its range (policies/params.py), a value outside it
is refused naming the parameter, and a policy built at either end of every range runs: what
validates is what works (issue 41: lru_k ``retained_ratio`` 1e308 or NaN and ``k`` 10**30
passed validation and raised inside vLLM's calls)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from broker.config import ConfigError, CoreConfig, PolicyConfig, TierConfig
from broker.config.settings import validate_policy
from policies.base import PolicyError
from policies.params import Range, bounded, check_ranges, is_numeric, range_of
from policies.registry import BUILTIN, make_params, policy_class
from tests.policies.harness import SimTier

NUMERIC = [(name, field.name) for name in sorted(BUILTIN) for field in dataclasses.fields(policy_class(name).Params) if is_numeric(field)]


def field_of(policy: str, param: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(policy_class(policy).Params) if f.name == param)


def test_every_numeric_parameter_of_every_policy_declares_a_finite_range() -> None:
    # A new policy's numeric parameter without bounded(...) fails here.
    assert len(NUMERIC) > 30
    missing = [f"{policy}.{param}" for policy, param in NUMERIC if range_of(field_of(policy, param)) is None]
    assert missing == []


def outside(bounds: Range, integer: bool) -> list[Any]:
    """Values every range refuses: past each end, NaN, infinities, the issue's extremes."""
    step = 1 if integer else max(abs(bounds.hi) * 1e-9, 1e-9)
    values: list[Any] = [bounds.hi + step if not bounds.hi_open else bounds.hi, float("nan"), float("inf"), float("-inf"), True]
    values.append(bounds.lo if bounds.lo_open else bounds.lo - step)
    values += [10**30, -(10**30)] if integer else [1e308, -1e308, 10**400]
    return [int(v) if integer and isinstance(v, float) and v == v and abs(v) != float("inf") else v for v in values]


@pytest.mark.parametrize(("policy", "param"), NUMERIC)
def test_a_value_outside_the_range_is_refused_naming_the_parameter(policy: str, param: str) -> None:
    field = field_of(policy, param)
    bounds = range_of(field)
    assert bounds is not None
    for value in outside(bounds, isinstance(field.default, int)):
        with pytest.raises(PolicyError, match=f"policy {policy}: (parameter )?{param} "):
            make_params(policy_class(policy), {param: value})


def ends(bounds: Range, integer: bool) -> list[Any]:
    """The range's extreme values that it holds (just inside an open end)."""
    lo = bounds.lo + (1 if integer else bounds.lo * 1e-9 + 1e-12) * bounds.lo_open
    hi = bounds.hi - (1 if integer else bounds.hi * 1e-9) * bounds.hi_open
    return [int(lo), int(hi)] if integer else [lo, hi]


@pytest.mark.parametrize(("policy", "param"), [(p, q) for p, q in NUMERIC if not policy_class(p).offline])
def test_a_policy_built_at_either_end_of_a_range_runs(policy: str, param: str) -> None:
    field = field_of(policy, param)
    bounds = range_of(field)
    assert bounds is not None
    for value in ends(bounds, isinstance(field.default, int)):
        # A tier of 1 TiB, blocks of 1 GiB: ratios times capacities of real tiers' bytes.
        tier = SimTier(policy, 2**40, {param: value})
        rng = random.Random(7)
        for step in range(600):
            block_id = f"b{rng.randrange(2400)}"
            if block_id in tier.blocks:
                tier.access(block_id)
            else:
                tier.insert(block_id, 2**30)
            if step % 97 == 0:
                tier.make_room(2**31)
        assert tier.used <= 2**40 and tier.evictions


def test_validation_builds_the_policy_and_refuses_in_one_config_error() -> None:
    core = CoreConfig(tiers=(TierConfig("cpu", 1000, 0.0, 25.0),), policy=PolicyConfig("lru_k", {"retained_ratio": 1e308}))
    with pytest.raises(ConfigError, match=r"^policy\.params: policy lru_k: retained_ratio must be a number in \[0, 1024\], got 1e\+308$"):
        validate_policy(core)
    # An int no float holds, for a float parameter: refused, not an OverflowError.
    core = dataclasses.replace(core, policy=PolicyConfig("s3fifo", {"ghost_ratio": 10**400}))
    with pytest.raises(ConfigError, match=r"^policy\.params: policy s3fifo: parameter ghost_ratio is too large"):
        validate_policy(core)


def test_bounded_refuses_a_range_without_finite_ends_or_missing_its_default() -> None:
    with pytest.raises(ValueError, match="finite ends"):
        bounded(1.0, 0.0, float("inf"))
    with pytest.raises(ValueError, match="outside its own range"):
        bounded(5, 0, 4)

    @dataclasses.dataclass(frozen=True)
    class P:
        ratio: float = bounded(0.5, 0.0, 1.0, hi_open=True)

    check_ranges(P(0.0))
    with pytest.raises(ValueError, match=r"ratio must be a number in \[0, 1\), got 1\.0"):
        check_ranges(P(1.0))
