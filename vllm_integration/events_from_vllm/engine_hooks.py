"""Engine hooks: the intent an engine knows and its KV-cache events cannot carry.

vLLM's KV events say which blocks are cached and where; they do not say which request is
decoding, when its blocks are needed next, how much the request matters, or which blocks
hold speculative draft tokens. The scheduler knows. ``EngineHooks`` sends that, for blocks
the bridge has told the broker about, as ``intent_updated`` and ``accessed`` events on a
client id of its own (``SyncBrokerClient``: a scheduler step never waits on the network).

Blocks are named as the bridge names them (``vllm_integration.events_from_vllm.zmq_events.block_id``: same hash
keys, same ``dp<rank>/`` namespace when the bridge serves several ranks, same adapter and
group prefixes), and event time is unix microseconds, the clock of vLLM's batch ``ts``
that the bridge uses, so deadlines mean the same thing on both paths.

    from vllm_integration.events_from_vllm.engine_hooks import EngineHooks
    from clients.sync_client import SyncBrokerClient

    client = SyncBrokerClient("127.0.0.1:50051", "vllm-dp0-hooks", max_block_s=0.0005)
    hooks = EngineHooks(client)                 # dp_rank=r, dp_size=n with several ranks

    # In the scheduler, once per step, for each scheduled request (block_hashes: the
    # request's cached block hashes, as in its BlockStored events):
    hooks.prefill(block_hashes, priority=Priority.PRIORITY_HOT, request_priority=80)
    hooks.decode_step(block_hashes, next_step_us=now_us + tpot_us)
    hooks.drafts(draft_hashes)                 # speculative tokens' blocks
    hooks.verified(draft_hashes, accepted=n_accepted)
    hooks.preempted(block_hashes)              # swapped out / recompute later
    hooks.finished(block_hashes)               # keep cached, but no longer needed soon

    print(client.counters()["dropped_events"])  # what the bounded queue dropped, if anything

Ordering: the hooks and the bridge are two streams. An update can reach the broker before
the bridge's allocation of its block (BlockStored is published after the step that filled
the block); the broker then rejects it (unknown block, counted in its rejected events) and
nothing else happens. Send hooks for blocks already cached, as above, and the race is rare;
a rejected hint costs nothing but the hint.

``decode_step`` marks the request's blocks DECODE_CRITICAL (pinned: no policy may evict
them) with the next step's time as their deadline; ``finished`` and ``preempted`` lower them
again. An engine that never calls either leaves them pinned, so call one for every request.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvbroker.v1 import intent_pb2 as pb
from vllm_integration.events_from_vllm.zmq_events import BlockHash, block_id, rank_namespace

Phase = pb.Phase
Priority = pb.Priority


class EventSink(Protocol):
    """What the hooks need of a client (SyncBrokerClient has it)."""

    def add(self, event: pb.Event) -> bool: ...


def unix_us() -> int:
    return int(time.time() * 1_000_000)


class EngineHooks:
    def __init__(
        self,
        client: EventSink,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        lora_name: str | None = None,
        lora_id: int | None = None,
        group_idx: int | None = None,
    ) -> None:
        self.client = client
        self.namespace = rank_namespace(dp_rank, dp_size)
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.group_idx = group_idx
        self.sent = 0
        self.refused = 0

    def block_ids(self, block_hashes: Iterable[BlockHash]) -> list[str]:
        """The broker ids of a request's block hashes, as the bridge names them."""
        return [
            block_id(h, namespace=self.namespace, lora_name=self.lora_name, lora_id=self.lora_id, group_idx=self.group_idx)
            for h in block_hashes
        ]

    def _send(self, event: pb.Event) -> None:
        if self.client.add(event):
            self.sent += 1
        else:
            self.refused += 1

    def _update(self, block_hashes: Iterable[BlockHash], ts_us: int | None, **changes: object) -> None:
        ts = unix_us() if ts_us is None else ts_us
        for bid in self.block_ids(block_hashes):
            self._send(pb.Event(ts_us=ts, intent_updated=pb.IntentUpdated(block_id=bid, **changes)))  # type: ignore[arg-type]

    # ---- the request lifecycle -----------------------------------------------------------

    def prefill(
        self,
        block_hashes: Sequence[BlockHash],
        *,
        priority: int = pb.PRIORITY_HOT,
        deadline_us: int | None = None,
        request_priority: int | None = None,
        ts_us: int | None = None,
    ) -> None:
        """The request's prompt blocks are being (re)used by a prefill; ``deadline_us``: when
        the first decode step will read them (unix µs), if known."""
        changes: dict[str, object] = {"phase": pb.PHASE_PREFILL, "priority": priority}
        if deadline_us is not None:
            changes["deadline_us"] = max(0, deadline_us)
        if request_priority is not None:
            changes["request_priority"] = request_priority
        self._update(block_hashes, ts_us, **changes)

    def decode_step(self, block_hashes: Sequence[BlockHash], *, next_step_us: int, ts_us: int | None = None) -> None:
        """A decode step read the request's blocks; the next one reads them at ``next_step_us``."""
        ts = unix_us() if ts_us is None else ts_us
        ids = self.block_ids(block_hashes)
        if not ids:
            return
        self._update(block_hashes, ts, phase=pb.PHASE_DECODE, priority=pb.PRIORITY_DECODE_CRITICAL)
        self._send(pb.Event(ts_us=ts, accessed=pb.BlocksAccessed(block_ids=ids, next_use_us=max(0, next_step_us))))

    def drafts(self, block_hashes: Sequence[BlockHash], *, ts_us: int | None = None) -> None:
        """These blocks hold speculative draft tokens: a rollback may discard them."""
        self._update(block_hashes, ts_us, phase=pb.PHASE_VERIFY, is_draft=True, is_committed=False)

    def verified(self, block_hashes: Sequence[BlockHash], *, accepted: int, ts_us: int | None = None) -> None:
        """The target model verified the drafts: the first ``accepted`` blocks are committed,
        the rest roll back (the engine frees them; vLLM's BlockRemoved follows if cached)."""
        hashes = list(block_hashes)
        self._update(hashes[:accepted], ts_us, phase=pb.PHASE_DECODE, is_draft=False, is_committed=True)
        self._update(hashes[accepted:], ts_us, phase=pb.PHASE_ROLLBACK, priority=pb.PRIORITY_COLD, clear_deadline=True)

    def preempted(self, block_hashes: Sequence[BlockHash], *, ts_us: int | None = None) -> None:
        """The request was preempted: its blocks are not needed until it is rescheduled."""
        self._update(block_hashes, ts_us, phase=pb.PHASE_IDLE, priority=pb.PRIORITY_WARM, clear_deadline=True)

    def finished(self, block_hashes: Sequence[BlockHash], *, ts_us: int | None = None) -> None:
        """The request is done: its blocks stay cached for prefix reuse, with no deadline."""
        self._update(block_hashes, ts_us, phase=pb.PHASE_DONE, priority=pb.PRIORITY_WARM, clear_deadline=True)
