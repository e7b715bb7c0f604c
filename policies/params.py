"""Every numeric policy parameter declares its range, where it is declared.

A parameter that passes validation must also work when the policy runs: ``retained_ratio``
1e308 passed a ">= 0" check and then overflowed ``int(ratio * capacity)`` inside vLLM's
``prepare_load``; NaN passed every comparison written as a refusal. So a numeric field of a
``Params`` dataclass is declared with ``bounded(default, lo, hi)``: a closed range, finite
at both ends, that the policy's arithmetic is known to take. ``check_ranges`` (called by
the registry's ``make_params``, the one way config values become parameters) refuses a
value outside it, NaN, infinities and bools, naming the parameter. A test walks every
registered policy and requires a range on each numeric field, so a new policy must declare
its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Final

# The metadata key of a field's range.
RANGE: Final = "kvbroker_range"


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric parameter takes: ``lo`` <= value <= ``hi`` (``lo_open``: > lo;
    ``hi_open``: < hi)."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def describe(self, integer: bool) -> str:
        kind = "an integer" if integer else "a number"
        return f"{kind} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"

    def holds(self, value: float) -> bool:
        """Whether ``value`` is in the range (NaN is not: it fails every comparison)."""
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below


def bounded(default: Any, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Any:
    """A dataclass field of ``default`` whose values lie in ``lo``..``hi`` (``lo_open`` /
    ``hi_open``: that end excluded). Both ends finite: a parameter's arithmetic must never
    meet an infinity or overflow a float's conversion to int."""
    if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
        raise ValueError(f"a range needs finite ends lo <= hi, got {lo!r}..{hi!r}")
    bounds = Range(float(lo), float(hi), lo_open, hi_open)
    if not bounds.holds(default):
        raise ValueError(f"the default {default!r} is outside its own range {bounds.describe(isinstance(default, int))}")
    return dataclasses.field(default=default, metadata={RANGE: bounds})


def range_of(field: dataclasses.Field[Any]) -> Range | None:
    """The range ``field`` declares (None: none)."""
    found = field.metadata.get(RANGE)
    return found if isinstance(found, Range) else None


def is_numeric(field: dataclasses.Field[Any]) -> bool:
    """A field whose default is a number (not a bool): it must declare a range."""
    default = field.default
    return isinstance(default, (int, float)) and not isinstance(default, bool)


def check_ranges(params: Any) -> None:
    """Refuse (ValueError naming the field) a numeric value outside its declared range."""
    for field in dataclasses.fields(params):
        bounds = range_of(field)
        if bounds is None:
            continue
        value = getattr(params, field.name)
        integer = isinstance(field.default, int)
        number = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not number:
            raise ValueError(f"{field.name} must be {bounds.describe(integer)}, got {value!r}")
        # Compared as written (an int of any size against float ends is exact in Python).
        if not bounds.holds(value):
            raise ValueError(f"{field.name} must be {bounds.describe(integer)}, got {value!r}")
