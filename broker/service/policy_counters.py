"""What the primary's policy did since it took over: ``kvbroker ab``'s counters per policy
in force.

The primary core keeps one CoreStats across reloads (``status`` and the metrics count the
broker's whole run), so after deadline_edf -> arc -> lru its counters held what deadline_edf
and arc served, credited to lru. ``PolicyBaseline`` keeps a copy of the counters as they
stood when the policy in force took over; ``since`` gives the difference, the figures of
the policy alone (a shadow's counters, always its own policy's, need none).
"""

from __future__ import annotations

import copy

from broker.model.core import Core
from broker.model.stats import CoreStats

# The counters ArmStats reports besides accesses by tier and the latency histogram.
COUNTED = (
    "dc_accesses",
    "dc_misses",
    "evictions",
    "demotions",
    "prefetches",
    "bytes_up",
    "bytes_down",
    "latency_total_us",
    "deadline_accesses",
    "deadline_misses",
)


def since(now: CoreStats, base: CoreStats | None) -> CoreStats:
    """The counters gained from ``base`` to ``now`` (``now`` itself when ``base`` is None)."""
    if base is None:
        return now
    out = CoreStats(len(now.accesses_by_tier) - 1)
    before = base.accesses_by_tier
    out.accesses_by_tier = [n - (before[i] if i < len(before) else 0) for i, n in enumerate(now.accesses_by_tier)]
    for field in COUNTED:
        setattr(out, field, getattr(now, field) - getattr(base, field))
    out.latency_hist = {key: n - base.latency_hist.get(key, 0) for key, n in now.latency_hist.items()}
    out.latency_hist.setdefault(0, 0)
    return out


class PolicyBaseline:
    """The primary's counters when its policy took over (None: it has run since the start)."""

    def __init__(self) -> None:
        self.base: CoreStats | None = None

    def around_change(self, core: Core) -> tuple[Core, str, CoreStats]:
        """Before a config change: what ``after_change`` compares with."""
        return core, str(core.policy_name), copy.deepcopy(core.stats)

    def after_change(self, before: tuple[Core, str, CoreStats], core: Core) -> None:
        """After it: a new policy on the same core counts from the copy taken before (what
        the change itself does, the new policy settling, is the new policy's); a new core
        (a split entered or left) counts from its own start."""
        old_core, old_policy, stats = before
        if core is not old_core:
            self.base = None
        elif str(core.policy_name) != old_policy:
            self.base = stats

    def stats(self, core: Core) -> CoreStats:
        return since(core.stats, self.base)
