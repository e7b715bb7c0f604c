"""Policy parameters of a sweep: ``--param policy.key=v1,v2,...`` (repeatable).

Each policy with parameters given runs once per combination of its keys' values (the
cartesian product, keys in the order given); a policy without runs once, with its
defaults. Values are read as the type of the parameter's default (``kvbroker policies
--json`` lists them), and every combination is checked by the policy's own parameter class
before anything runs, so a bad value is refused up front, naming the policy and the key.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from policies.base import PolicyError
from policies.registry import make_params, policy_class

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _value(text: str, default: Any, where: str) -> Any:
    """``text`` as the type of ``default``."""
    text = text.strip()
    if isinstance(default, bool):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise PolicyError(f"{where}: expected true or false, got {text!r}")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise PolicyError(f"{where}: expected an integer, got {text!r}") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise PolicyError(f"{where}: expected a number, got {text!r}") from None
    return text


def parse_params(flags: list[str] | None, policies: list[str]) -> dict[str, list[dict[str, Any]]]:
    """policy -> the parameter sets it runs with, from ``--param`` flags; a policy that no
    flag names is absent (it runs once, as configured). ``policies``: the sweep's."""
    values: dict[str, dict[str, list[Any]]] = {}
    for flag in flags or []:
        where = f"--param {flag}"
        name, eq, listed = flag.partition("=")
        policy, dot, key = name.strip().rpartition(".")  # module:Class names hold dots; keys do not
        if not eq or not dot or not policy or not key:
            raise PolicyError(f"{where}: expected POLICY.KEY=V1,V2,... (e.g. deadline_edf.guard_us=250,500)")
        cls = policy_class(policy)
        if policy not in policies:
            raise PolicyError(f"{where}: policy {policy} is not in this sweep (policies: {', '.join(policies)})")
        defaults = {f.name: getattr(cls.Params(), f.name) for f in dataclasses.fields(cls.Params)}
        if key not in defaults:
            known = ", ".join(defaults) or "none"
            raise PolicyError(f"{where}: policy {policy} has no parameter {key} (its parameters: {known})")
        items = [v for v in listed.split(",") if v.strip()]
        if not items:
            raise PolicyError(f"{where}: no values for {policy}.{key}")
        parsed = [_value(v, defaults[key], f"{where}: {policy}.{key}") for v in items]
        if key in values.get(policy, {}):
            raise PolicyError(f"{where}: {policy}.{key} is given twice (list every value in one flag)")
        values.setdefault(policy, {})[key] = list(dict.fromkeys(parsed))
    grid: dict[str, list[dict[str, Any]]] = {}
    for policy, keys in values.items():
        combos = [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*keys.values())]
        cls = policy_class(policy)
        for combo in combos:
            try:
                make_params(cls, combo)
            except PolicyError as exc:
                raise PolicyError(f"--param: {exc} (in {_label(policy, combo)})") from None
        grid[policy] = combos
    return grid


def _label(policy: str, params: dict[str, Any]) -> str:
    return f"{policy}(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")"
