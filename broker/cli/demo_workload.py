"""The built-in demo workload: a small serving engine's KV traffic, seeded and deterministic.

Requests arrive over event time, prefill their prompt (a shared system-prompt prefix for
some of them, reused by content id), then decode in round robin, a few requests per
iteration. One iteration ahead, the engine knows which requests it will decode next and
says so: their blocks become DECODE_CRITICAL with a deadline at the next iteration. That
is exactly the intent plain LRU never sees: under cyclic decode it evicts the blocks needed
soonest, while an intent-aware policy keeps or prefetches them.
"""

from __future__ import annotations

import dataclasses
import random

from kvbroker.v1 import intent_pb2 as pb

BLOCK_BYTES = 2 * 2**20  # 16 tokens of llama-3-8b at fp16: 16 x 131,072 bytes
TOKENS_PER_BLOCK = 16
ITERATION_US = 1_000
PREFIX_BLOCKS = 4

DEMO_CONFIG = """\
[broker]
id = "kvbroker-demo"
listen = "127.0.0.1:0"

[policy]
name = "priority_lru"

[prefetch]
# Two iterations ahead: the scheduler announces the next decode set one iteration early.
margin_us = 2000

[[tiers]]
name = "hbm"
capacity = "128MiB"
read_latency_us = 0.0
bandwidth_gb_per_s = 2000.0

[[tiers]]
name = "dram"
capacity = "256MiB"
read_latency_us = 2.0
bandwidth_gb_per_s = 25.0

[[tiers]]
name = "nvme"
capacity = "4GiB"
read_latency_us = 80.0
bandwidth_gb_per_s = 6.0
"""


# The deadline-bound demo: share of requests that arrive with the one before them (a burst),
# and the mean pause before the others.
BURST_SHARE = 0.7
BURST_GAP_US = 30_000
# Requests decoded per iteration in the deadline-bound demo (about 80 blocks to read).
DEADLINE_DECODE_BATCH = 6

# The demo's default tiers: HBM for about 6 decoding requests and a burst's prefills, host
# memory behind two copy channels (a 25 GB/s link: 2 MiB in about 94 us, every transfer out
# of the tier sharing it) and NVMe behind one.
DEADLINE_CONFIG = """\
[broker]
id = "kvbroker-demo"
listen = "127.0.0.1:0"

[policy]
name = "deadline_edf"

[prefetch]
# The scheduler announces the next decode set one iteration early.
margin_us = 1000

[[tiers]]
name = "hbm"
capacity = "192MiB"
read_latency_us = 0.0
bandwidth_gb_per_s = 2000.0

[[tiers]]
name = "dram"
capacity = "512MiB"
read_latency_us = 10.0
bandwidth_gb_per_s = 25.0
channels = 2

[[tiers]]
name = "nvme"
capacity = "4GiB"
read_latency_us = 100.0
bandwidth_gb_per_s = 2.0
channels = 1
"""


@dataclasses.dataclass
class _Request:
    rid: str
    arrival_us: int
    prompt_blocks: int
    output_tokens: int
    priority: int  # request priority 0..100
    shared_prefix: bool
    blocks: list[str] = dataclasses.field(default_factory=list)
    generated: int = 0


class DemoWorkload:
    """Yields the events of one engine iteration at a time.

    ``deadline_bound`` (the demo's default, with ``DEADLINE_CONFIG``): requests arrive in
    bursts, and the next iteration's decode set is announced with its deadline but keeps its
    class (HOT or WARM): unpinned blocks with deadlines, which a policy may still push out.
    On DEADLINE_CONFIG's tiers (host memory behind two shared copy channels, 2 MiB in about
    94 us each, so about 21 blocks per 1 ms iteration; NVMe behind one, about 1.1 ms a
    block) a step's blocks that are not in HBM when it is announced cannot all be back by
    its deadline, so where the policy put them decides
    whether deadlines are met. Each iteration decodes 6 requests (about 80 blocks to read
    against HBM for 96). Without it: every announced block is DECODE_CRITICAL (pinned
    where it is) and arrivals are spread out: the classic demo, where no deadline binds.
    """

    def __init__(self, *, requests: int = 40, seed: int = 7, decode_batch: int | None = None, deadline_bound: bool = False) -> None:
        rng = random.Random(seed)
        if decode_batch is None:
            decode_batch = DEADLINE_DECODE_BATCH if deadline_bound else 2
        self.decode_batch = decode_batch
        self.deadline_bound = deadline_bound
        t = 0
        self.waiting: list[_Request] = []
        for i in range(requests):
            if deadline_bound:
                # Bursts: most requests come with the one before them, a few after a pause.
                t += 0 if rng.random() < BURST_SHARE else int(rng.expovariate(1 / BURST_GAP_US))
            else:
                t += int(rng.expovariate(1 / 4_000))
            interactive = rng.random() < 0.5
            self.waiting.append(
                _Request(
                    rid=f"req-{i:03d}",
                    arrival_us=t,
                    prompt_blocks=rng.randint(3, 8),
                    output_tokens=rng.randint(32, 96),
                    priority=90 if interactive else 20,
                    shared_prefix=rng.random() < 0.6,
                )
            )
        self.active: list[_Request] = []
        self.refs: dict[str, int] = {}  # live references to shared prefix blocks
        self.cached: set[str] = set()  # released prefix blocks the broker may still hold
        self.now_us = 0
        self._rr = 0
        self._next: list[_Request] = []

    @property
    def done(self) -> bool:
        return not self.waiting and not self.active

    def step(self) -> list[pb.Event]:
        """Events of the iteration at ``now_us``; then time moves one iteration on."""
        events: list[pb.Event] = []
        now = self.now_us
        while self.waiting and self.waiting[0].arrival_us <= now:
            req = self.waiting.pop(0)
            self._prefill(req, now, events)
            self.active.append(req)
        # Decode the requests announced last iteration (or pick now, on the first one).
        current = [r for r in self._next if r in self.active] or self._pick()
        for req in current:
            self._decode(req, now, events)
        for req in current:
            if req.generated >= req.output_tokens:
                self._finish(req, now, events)
            else:
                for block_id in req.blocks:
                    events.append(_update(now, block_id, priority=_class(req), clear_deadline=True))
        # Announce the next iteration's decode set: the engine's scheduler already knows it.
        self._next = self._pick()
        deadline = now + ITERATION_US
        for req in self._next:
            for block_id in req.blocks:
                if self.deadline_bound:
                    events.append(_update(now, block_id, deadline_us=deadline, slack_us=0))
                else:
                    events.append(_update(now, block_id, priority=pb.PRIORITY_DECODE_CRITICAL, deadline_us=deadline))
        self.now_us = now + ITERATION_US
        return events

    def _pick(self) -> list[_Request]:
        if not self.active:
            return []
        n = min(self.decode_batch, len(self.active))
        start = self._rr % len(self.active)
        self._rr += n
        return [self.active[(start + k) % len(self.active)] for k in range(n)]

    def _prefill(self, req: _Request, now: int, events: list[pb.Event]) -> None:
        if req.shared_prefix:
            for k in range(PREFIX_BLOCKS):
                block_id = f"sys-prefix-{k}"
                req.blocks.append(block_id)
                if self.refs.get(block_id, 0) > 0:
                    events.append(pb.Event(ts_us=now, accessed=pb.BlocksAccessed(block_ids=[block_id])))
                else:
                    events.append(_alloc(now, block_id, req, parent=f"sys-prefix-{k - 1}" if k else ""))
                    self.cached.discard(block_id)
                self.refs[block_id] = self.refs.get(block_id, 0) + 1
        for k in range(req.prompt_blocks):
            parent = req.blocks[-1] if req.blocks else ""
            block_id = f"{req.rid}/p{k}"
            req.blocks.append(block_id)
            events.append(_alloc(now, block_id, req, parent=parent))
        events.append(pb.Event(ts_us=now, accessed=pb.BlocksAccessed(block_ids=list(req.blocks))))

    def _decode(self, req: _Request, now: int, events: list[pb.Event]) -> None:
        if req.generated and req.generated % TOKENS_PER_BLOCK == 0:
            block_id = f"{req.rid}/d{req.generated // TOKENS_PER_BLOCK}"
            events.append(_alloc(now, block_id, req, parent=req.blocks[-1], phase=pb.PHASE_DECODE))
            req.blocks.append(block_id)
        events.append(pb.Event(ts_us=now, accessed=pb.BlocksAccessed(block_ids=list(req.blocks))))
        req.generated += 1

    def _finish(self, req: _Request, now: int, events: list[pb.Event]) -> None:
        self.active.remove(req)
        private = [b for b in req.blocks if not b.startswith("sys-prefix-")]
        events.append(pb.Event(ts_us=now, freed=pb.BlocksFreed(block_ids=private)))
        for block_id in req.blocks[: len(req.blocks) - len(private)]:
            self.refs[block_id] -= 1
            if self.refs[block_id] == 0:
                # Kept cached for the next request with this prefix, but nobody needs it now.
                events.append(_update(now, block_id, priority=pb.PRIORITY_COLD, clear_deadline=True, phase=pb.PHASE_IDLE))
                events.append(pb.Event(ts_us=now, released=pb.BlocksReleased(block_ids=[block_id])))
                self.cached.add(block_id)


def _class(req: _Request) -> int:
    return pb.PRIORITY_HOT if req.priority >= 80 else pb.PRIORITY_WARM


def _alloc(now: int, block_id: str, req: _Request, *, parent: str, phase: int = pb.PHASE_PREFILL) -> pb.Event:
    intent = pb.MemoryIntent(
        block_id=block_id,
        request_id=req.rid,
        phase=phase,  # type: ignore[arg-type]
        priority=_class(req),  # type: ignore[arg-type]
        size_bytes=BLOCK_BYTES,
        recompute_cost_us=4_000,
        request_priority=req.priority,
        parent_block_id=parent,
        token_count=TOKENS_PER_BLOCK,
    )
    return pb.Event(ts_us=now, allocated=pb.BlockAllocated(intent=intent))


def _update(now: int, block_id: str, **changes: object) -> pb.Event:
    return pb.Event(ts_us=now, intent_updated=pb.IntentUpdated(block_id=block_id, **changes))  # type: ignore[arg-type]
