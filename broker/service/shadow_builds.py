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
import io
import logging
import pickle
from collections import deque
from typing import Any, ClassVar

from broker.config import ConfigError, CoreConfig
from broker.model.apply import apply_batch
from broker.model.core import Core, OwnedBlocks, RequestBlocks
from broker.model.stats import CoreStats
from broker.model.wire import read_batch
from broker.service.forked_copy import ForkedCopy, forking_available
from policies.base import Block, PolicyError, untrack
from policies.deadline_edf import _Held

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


# What the live core keeps out of the cyclic collector's lists (policies/_gc.c says why); a
# copy's must be too, or each full collection walks every block of the shadow.
_UNTRACKED = (Block, _Held)
_UNTRACKED_WITH_IDS = (RequestBlocks, OwnedBlocks)


class ShadowUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (it gives the GIL back to the event loop every switch
    interval, where the C one holds it to the end), which leaves what it builds untracked
    by the collector as the live core does, as it goes (a collection in the middle of the
    copy then does not walk what is already built)."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def load_build(self) -> None:
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]
        built = self.stack[-1]  # type: ignore[attr-defined]
        if isinstance(built, _UNTRACKED):
            untrack(built)
        elif isinstance(built, _UNTRACKED_WITH_IDS):
            untrack(built)
            untrack(built.ids)

    dispatch[pickle.BUILD[0]] = load_build


class ListMemo:
    """The unpickler's memo (every object built so far, by number) in a list the collector
    does not track: a dict memo is tracked, and each full collection during the copy
    walked its million entries."""

    def __init__(self) -> None:
        self.items: list[Any] = untrack([])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]

    def __setitem__(self, index: int, value: Any) -> None:
        if index == len(self.items):
            self.items.append(value)
        else:  # BINPUT/LONG_BINPUT may number out of order
            self.items.extend([None] * (index + 1 - len(self.items)))
            self.items[index] = value


def unpickle_shadow(data: bytes) -> Core:
    unpickler = ShadowUnpickler(io.BytesIO(data))
    unpickler.memo = ListMemo()  # type: ignore[attr-defined]
    shadow: Core = unpickler.load()
    return shadow


class ShadowBuild:
    """One shadow being copied: the forked copy, and what the loop applied since."""

    def __init__(self, name: str, primary: Core, shadow_config: CoreConfig, generation: int) -> None:
        self.name = name
        self.config = shadow_config
        self.generation = generation
        # Batches (their bytes, which the collector does not track, where a read batch's
        # objects would be walked by each full collection while the copy is taken) and
        # config changes ((CoreConfig, generation)), in apply order.
        self.pending: deque[bytes | tuple[CoreConfig, int]] = deque()

        def produce() -> bytes:  # in the child, on its frozen image of ``primary``
            shadow = primary
            shadow.stats = CoreStats(len(shadow.tiers))
            shadow.reconfigure(shadow_config, generation)
            return pickle.dumps(shadow, protocol=pickle.HIGHEST_PROTOCOL)

        self.copy = ForkedCopy(produce, unpickle_shadow)

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
                apply_batch(shadow, read_batch(entry))
                shadow.take_directives()
        return shadow if not self.pending else None


def start_build(name: str, primary: Core, shadow_config: CoreConfig, generation: int) -> ShadowBuild | Core:
    """A build of the shadow off the loop, or (where processes cannot fork) the shadow,
    copied here. ``check_shadow_config`` first."""
    if not forking_available():
        return fresh_shadow(primary, shadow_config, generation)
    return ShadowBuild(name, primary, shadow_config, generation)
