"""A shadow added by a reload, copied off the event loop (broker.service.forked_copy).

A shadow added while the broker runs starts from a copy of the primary's residency as it
was at the reload, with the shadow's policy warmed from it, exactly as if the copy had been
taken there and then. The copy is taken by ``fork()`` at the reload (a few ms); a child
process warms the shadow's policy and pickles it; a thread of the broker unpickles it.
Meanwhile the loop keeps serving, and every batch (and config change) it applies is also
queued here; once the copy arrives the loop replays the queue onto it a few entries per
batch served, and the shadow reports from the moment it has caught up. The shadow then
holds what it would hold had it been copied synchronously at the reload
(tests/broker/service/test_shadow_builds.py compares the two).
"""

from __future__ import annotations

import copy
import logging
import pickle
from collections import deque

from broker.config import ConfigError, CoreConfig
from broker.model.apply import apply_batch
from broker.model.core import Core
from broker.model.stats import CoreStats
from broker.model.wire import BatchReader
from broker.service.forked_copy import ForkedCopy, forking_available, unpickle_yielding
from policies.base import PolicyError

log = logging.getLogger("kvbroker.service")

# Entries of the queue replayed onto an arrived copy per batch the loop serves: the replay
# catches up (it gains this many minus one per batch) without one long pause.
CATCH_UP_PER_BATCH = 16


def fresh_shadow(primary: Core, shadow_config: CoreConfig, generation: int) -> Core:
    """A shadow starting from ``primary`` as it is: a copy with its own counters, running the
    shadow's policy warmed from the copy's residency."""
    shadow = copy.deepcopy(primary)
    shadow.stats = CoreStats(len(shadow.tiers))
    shadow.reconfigure(shadow_config, generation)
    return shadow


def check_shadow_config(shadow_config: CoreConfig) -> None:
    """Refuse now, with the key, what the copy would refuse later (a policy that cannot be
    built with these parameters); the tiers are the primary's, which it just accepted."""
    try:
        Core(shadow_config)
    except PolicyError as exc:
        raise ConfigError(f"policy.shadows: {shadow_config.policy.name}: {exc}") from exc


class ShadowBuild:
    """One shadow being copied: the forked copy, and what the loop applied since."""

    def __init__(self, name: str, primary: Core, shadow_config: CoreConfig, generation: int) -> None:
        self.name = name
        self.config = shadow_config
        self.generation = generation
        # Batches (BatchReader) and config changes ((CoreConfig, generation)), in apply order.
        self.pending: deque[BatchReader | tuple[CoreConfig, int]] = deque()

        def produce() -> bytes:  # in the child, on its frozen image of ``primary``
            shadow = primary
            shadow.stats = CoreStats(len(shadow.tiers))
            shadow.reconfigure(shadow_config, generation)
            return pickle.dumps(shadow, protocol=pickle.HIGHEST_PROTOCOL)

        self.copy = ForkedCopy(produce, unpickle_yielding)

    def follow(self, shadow_config: CoreConfig, generation: int) -> None:
        self.config, self.generation = shadow_config, generation
        self.pending.append((shadow_config, generation))

    def catch_up(self, primary: Core, budget: int) -> Core | None:
        """Replay up to ``budget`` queued entries onto the arrived copy; the shadow once the
        queue is empty, else None (not arrived, or still behind). A copy that failed is
        taken again synchronously from the primary as it is now (logged: a pause)."""
        if not self.copy.done():
            return None
        if self.copy.error is not None:
            why = self.copy.error
            log.warning("shadow %s: the copy off the event loop failed (%s); copying the primary on the loop instead", self.name, why)
            self.pending.clear()
            return fresh_shadow(primary, self.config, self.generation)
        shadow: Core = self.copy.result
        for _ in range(min(budget, len(self.pending))):
            entry = self.pending.popleft()
            if isinstance(entry, tuple):
                shadow.follow(*entry)
            else:
                apply_batch(shadow, entry)
                shadow.take_directives()
        return shadow if not self.pending else None


def start_build(name: str, primary: Core, shadow_config: CoreConfig, generation: int) -> ShadowBuild | Core:
    """A build of the shadow off the loop, or (where processes cannot fork) the shadow,
    copied here. ``check_shadow_config`` first."""
    if not forking_available():
        return fresh_shadow(primary, shadow_config, generation)
    return ShadowBuild(name, primary, shadow_config, generation)
