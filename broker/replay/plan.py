"""The jobs of a sweep: sources x capacities x policies x policy parameters (x intent).

Jobs are ordered by sweep point first and source last, so that the rows of every pod at
one point are together and a fleet's total row can follow them (broker.replay.fleet);
with one source the order is the one replay always had: per capacity point, the live
split's verification (if any), every policy, then every policy with its intent stripped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from broker.config import ConfigError, CoreConfig
from broker.replay.sweep import Job, Source


@dataclasses.dataclass(frozen=True)
class PlannedSource:
    """A source, the config its replays start from, and the policy its broker ran (None:
    unknown, a trace) or its split's label (``split(...)``, verified by following it)."""

    source: Source
    base: CoreConfig
    live_policy: str | None = None


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    policies: list[str]
    # policy -> its parameter sets (broker.replay.grid); a policy absent runs as configured.
    params: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    # Capacity points: tier position -> bytes ([{}]: the configs' own capacities).
    combos: list[dict[int, int]] = dataclasses.field(default_factory=lambda: [{}])
    quant: str | None = None
    verify: bool = False
    ablate_intent: bool = False


def plan_jobs(sources: list[PlannedSource], spec: SweepSpec) -> list[Job]:
    keyed: list[tuple[tuple[int, int, int, int, int], Job]] = []
    for s_index, planned in enumerate(sources):
        base = planned.base
        for c_index, combo in enumerate(spec.combos):
            if combo and max(combo) >= len(base.tiers):
                flag = ("--hbm", "--dram", "--nvme")[max(combo)]
                count = len(base.tiers)
                raise ConfigError(f"{flag}: the config of {planned.source.label} has {count} tier(s); cannot size tier {max(combo) + 1}")
            tiers = tuple(dataclasses.replace(t, capacity_bytes=combo.get(i, t.capacity_bytes)) for i, t in enumerate(base.tiers))
            config = dataclasses.replace(base, tiers=tiers, quant=spec.quant or base.quant)
            live = planned.live_policy
            if spec.verify and live is not None and live.startswith("split("):
                keyed.append(((c_index, 0, -1, 0, s_index), Job(planned.source, live, config, verify=True, combo=c_index)))
            for p_index, name in enumerate(spec.policies):
                param_sets: list[dict[str, Any] | None] = list(spec.params.get(name, [None]))
                for k_index, params in enumerate(param_sets):
                    # The journal's own policy as it ran (its parameters) is what verification checks.
                    verify = spec.verify and name == live and params is None
                    job = Job(planned.source, name, config, verify=verify, params=params, combo=c_index)
                    keyed.append(((c_index, 0, p_index, k_index, s_index), job))
                    if spec.ablate_intent:
                        bare = dataclasses.replace(planned.source, ablate_intent=True)
                        keyed.append(((c_index, 1, p_index, k_index, s_index), Job(bare, name, config, params=params, combo=c_index)))
    return [job for _, job in sorted(keyed, key=lambda item: item[0])]
