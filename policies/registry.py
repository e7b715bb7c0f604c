"""The one registry of policies, used by the server, replay, the CLI and the tests.

Built-in policies are named here once; an out-of-tree policy is loaded by ``module:Class``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from policies.base import Policy, PolicyError
from policies.params import check_ranges, range_of

# name -> "module:Class". Imported lazily so that listing names costs nothing.
BUILTIN: dict[str, str] = {
    "lru": "policies.lru:LRUPolicy",
    "priority_lru": "policies.priority_lru:PriorityLRUPolicy",
    "belady": "policies.belady:BeladyPolicy",
    "prefix_aware": "policies.prefix_aware:PrefixAwarePolicy",
    "fifo": "policies.fifo:FIFOPolicy",
    "lfu": "policies.lfu:LFUPolicy",
    "two_queue": "policies.two_queue:TwoQueuePolicy",
    "arc": "policies.arc:ARCPolicy",
    "s3fifo": "policies.s3fifo:S3FIFOPolicy",
    "sieve": "policies.sieve:SievePolicy",
    "lru_k": "policies.lru_k:LRUKPolicy",
    "hotcold": "policies.hotcold:HotColdPolicy",
    "predictive_hotness": "policies.predictive_hotness:PredictiveHotnessPolicy",
    "intent_aware": "policies.intent_aware:IntentAwarePolicy",
    "deadline_aware": "policies.deadline_aware:DeadlineAwarePolicy",
    "windowed_recency": "policies.windowed_recency:WindowedRecencyPolicy",
    "heavy_hitter": "policies.heavy_hitter:HeavyHitterPolicy",
    "cost_aware": "policies.cost_aware:CostAwarePolicy",
    "markov_prefetch": "policies.markov_prefetch:MarkovPrefetchPolicy",
    "regret_aware": "policies.regret_aware:RegretAwarePolicy",
    "deadline_edf": "policies.deadline_edf:DeadlineEDFPolicy",
    "bayesian_reuse": "policies.bayesian_reuse:BayesianReusePolicy",
    "adaptive": "policies.adaptive:AdaptivePolicy",
    "history_arc": "policies.history_arc:HistoryARCPolicy",
    "prefetch_oracle": "policies.prefetch_oracle:PrefetchOraclePolicy",
}


def names() -> list[str]:
    """Names of the built-in policies, sorted."""
    return sorted(BUILTIN)


def policy_class(spec: str, *, may_import: bool = True) -> type[Policy]:
    """Resolve a built-in name or an out-of-tree ``module:Class`` to a policy class.

    ``may_import=False``: a built-in name only; a ``module:Class`` is refused before
    anything is imported (a name from a file anyone may write must not run code)."""
    target = BUILTIN.get(spec)
    if target is None:
        if ":" not in spec:
            raise PolicyError(f"unknown policy {spec!r}; built-in policies: {', '.join(names())}; or give module:Class")
        if not may_import:
            raise PolicyError(
                f"{spec!r} is not a built-in policy (built-in: {', '.join(names())}); "
                "a module:Class policy is loaded only from the start-up configuration"
            )
        target = spec
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PolicyError(f"cannot import policy module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyError(f"{target!r} is not a Policy subclass")
    return cls


def make_params(cls: type[Policy], values: dict[str, Any] | None) -> Any:
    """Build the frozen parameter object of ``cls`` from plain config values.

    Unknown keys, values of the wrong type and numbers outside the range the parameter
    declares (policies.params) are refused with the parameter named.
    """
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls.Params)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields)) or "none"
        raise PolicyError(f"policy {cls.name}: unknown parameter(s) {', '.join(unknown)} (parameters: {known})")
    for key, value in values.items():
        default = getattr(cls.Params(), key)
        if isinstance(default, bool) != isinstance(value, bool) or (
            isinstance(default, (int, float)) and not isinstance(value, (int, float))
        ):
            raise PolicyError(f"policy {cls.name}: parameter {key} must be {type(default).__name__}, got {value!r}")
        if isinstance(default, float) and isinstance(value, int):
            try:
                values[key] = float(value)
            except OverflowError:  # an int no float holds (10**400): out of any range
                raise PolicyError(f"policy {cls.name}: parameter {key} is too large, got {value!r}") from None
    try:
        params = cls.Params(**values)
        check_ranges(params)
    except (TypeError, ValueError, OverflowError) as exc:
        raise PolicyError(f"policy {cls.name}: {exc}") from exc
    return params


def describe(cls: type[Policy]) -> dict[str, Any]:
    """Name, one-line description, parameters with defaults and the ranges of the numeric
    ones (``[lo, hi]``, an open end shown as ``(`` or ``)``), for `kvbroker policies`."""
    params = {f.name: getattr(cls.Params(), f.name) for f in dataclasses.fields(cls.Params)}
    ranges = {}
    for f in dataclasses.fields(cls.Params):
        bounds = range_of(f)
        if bounds is not None:
            ranges[f.name] = bounds.describe(isinstance(f.default, int)).partition(" in ")[2]
    return {"name": cls.name, "description": cls.description, "offline": cls.offline, "params": params, "ranges": ranges}
