"""Seeded workload profiles: the research prototypes' named workloads, re-made as IntentBatch streams.

Every profile is a function ``(seed, scale) -> Iterator[IntentBatch]``: deterministic (one
``random.Random`` seeded from the profile name and ``seed``; time is event time, never the
wall clock), with ``scale`` multiplying its request (or page) counts. ``PROFILES`` names
them; ``profile_config(name)`` is the tier config each is meant to be replayed on. As a
trace format: ``kvbroker replay --trace deadline_pressure --format profile``.

Three families:

- **kv_deadline_scheduler** (``deadline_pressure``, ``long_context_extreme``,
  ``rag_mixed_priority``, ``speculative_decode``, ``balanced``): requests of 1 MiB blocks
  (8 tokens of llama-3-8b at fp16) run by a simulated engine (``_Engine``) in iterations of
  ``step_us``. At iteration start (t) new requests prefill and the batch announced last
  iteration decodes (one access of all its blocks, naming the request's next expected
  decode as their next use). At t + step/2 the scheduler announces the next batch (earliest
  token due first, interactive requests due more often than batch ones, within a budget of
  blocks): its blocks become DECODE_CRITICAL, pinned, due at the next iteration. At
  t + step - 300 us the forward pass ends: finished requests free their blocks (shared ones
  are released), the decoded blocks that are not needed next are unpinned back to HOT
  (interactive, request_priority >= 80) or WARM. Every block has prefetch_ok and a
  recompute cost growing with its position in the request. Replay on ``KVDS_TIERS_TOML``.
  Why three instants per iteration: the broker promotes a block once event time passes its
  deadline minus transfer time minus the prefetch margin (500 us by default), and time only
  moves with events; an announcement at mid-step followed by the end of the forward pass
  300 us before the deadline gives a deadline-aware policy that moment, as a live engine's
  stream would.
- **kv-hierarchy-lab** (``chat_continuation``, ``rag_burst``, ``periodic_reuse``,
  ``long_tail_mix``, ``prefetch_friendly``, ``adversarial_prefetch``, ``adversarial_burst``,
  ``mixed_locality``): page-access sequences, 48-128 pages and 240-400 accesses drawn per
  seed, one access per 1 ms step. A page's first access allocates it, the others read it;
  no intent (the lab had none). Pages belong to groups (a conversation, a document, a
  loop); a group's pages are released right after the group's last access. Replay on
  ``LAB_TIERS_TOML``.
- ``scan_pollution``: a hot 64-block prefix read repeatedly, a burst of 1,984 blocks used
  once, then the hot prefix again. Replay on ``SCAN_TIERS_TOML``.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from broker.replay.traces.base import SkipCounter, TraceError, batched
from broker.replay.traces.kvds import KVDS_TIERS_TOML
from kvbroker.v1 import intent_pb2 as pb

if TYPE_CHECKING:  # broker.replay.traces imports this module to register the format
    from broker.replay.traces.options import TraceOptions

BATCH_EVENTS = 512

# ---- the kv_deadline_scheduler family -------------------------------------------------------

MIB = 1 << 20
# One 1 MiB block holds 8 tokens of llama-3-8b at fp16 (131,072 bytes per token).
BLOCK_BYTES = MIB
TOKENS_PER_BLOCK = 8
# Recompute cost of block k of a request: re-running its prefill, whose attention reads the
# k blocks before it, so later blocks cost more.
RECOMPUTE_BASE_US = 1_000
RECOMPUTE_PER_BLOCK_US = 120
# Drafts come from a small draft model: cheap to recompute.
DRAFT_RECOMPUTE_US = 200
# The forward pass of an iteration ends this long before the next iteration starts.
FORWARD_TAIL_US = 300

INTERACTIVE_PRIORITY = 80  # request_priority at or above it: interactive (HOT), else batch (WARM)


@dataclasses.dataclass
class _Request:
    rid: str
    arrival_us: int
    # Chains of blocks shared by content id (a system prompt, retrieved documents) the prompt
    # starts with, then private prompt blocks.
    chains: list[list[str]]
    private_prompt: int
    # Decode steps (verify steps under speculative decoding).
    tokens: int
    request_priority: int
    slack_us: int
    # Target time between two of its tokens: the scheduler decodes the earliest due first.
    tpot_us: int
    blocks: list[str] = dataclasses.field(default_factory=list)
    drafts: list[str] = dataclasses.field(default_factory=list)
    generated: int = 0
    next_due_us: int = 0
    draft_seq: int = 0

    @property
    def shared(self) -> list[str]:
        return [b for chain in self.chains for b in chain]

    @property
    def klass(self) -> int:
        return pb.PRIORITY_HOT if self.request_priority >= INTERACTIVE_PRIORITY else pb.PRIORITY_WARM

    @property
    def done(self) -> bool:
        return self.generated >= self.tokens


class _Engine:
    """The simulated serving engine of the kv_deadline_scheduler profiles (module docstring)."""

    def __init__(
        self,
        requests: list[_Request],
        rng: random.Random,
        *,
        step_us: int,
        budget_blocks: int,
        drafts: int = 0,
        accept: float = 0.0,
    ) -> None:
        if step_us <= 2 * FORWARD_TAIL_US:
            raise ValueError(f"step_us must be > {2 * FORWARD_TAIL_US}, got {step_us}")
        self.requests = sorted(requests, key=lambda r: r.arrival_us)  # stable: list order breaks ties
        self.rng = rng
        self.step = step_us
        self.budget = budget_blocks
        self.drafts = drafts
        self.accept = accept
        self.refs: dict[str, int] = {}  # shared block -> requests holding it
        self.live: set[str] = set()  # blocks allocated, neither freed nor released
        self.base: dict[str, int] = {}  # block -> priority it returns to when unpinned
        self.order = {r.rid: i for i, r in enumerate(self.requests)}

    def events(self) -> Iterator[pb.Event]:
        step = self.step
        waiting = deque(self.requests)
        running: list[_Request] = []
        current: list[_Request] = []
        i = 0
        while waiting or running:
            now = i * step
            while waiting and waiting[0].arrival_us <= now:
                req = waiting.popleft()
                yield from self._prefill(req, now)
                running.append(req)
            for req in current:
                yield from self._decode(req, now)
            nxt = self._schedule([r for r in running if not r.done])
            yield from self._announce(nxt, now + step // 2, now + step)
            done_at = now + step - FORWARD_TAIL_US
            before = list(dict.fromkeys(b for r in current for b in r.blocks))
            for req in current:
                if req.done:
                    running.remove(req)
                    yield from self._finish(req, done_at)
            needed = {b for r in nxt for b in r.blocks}
            for block_id in before:
                if block_id in self.live and block_id not in needed:
                    yield _update(done_at, block_id, priority=self.base[block_id], pin_requested=False)
            if self.drafts:
                for req in nxt:
                    yield from self._draft(req, done_at, now + step)
            current = nxt
            i += 1
            if not running and waiting:
                i = max(i, -(-waiting[0].arrival_us // step))

    def _needs(self, req: _Request) -> int:
        """Blocks the request's next step pins: its own, a new one, its drafts."""
        new = 1 if not self.drafts and req.generated % TOKENS_PER_BLOCK == 0 else 0
        return len(req.blocks) + new + self.drafts

    def _schedule(self, candidates: list[_Request]) -> list[_Request]:
        """Earliest due first, first fit within the block budget (at least one request)."""
        chosen: list[_Request] = []
        used = 0
        for req in sorted(candidates, key=lambda r: (r.next_due_us, self.order[r.rid])):
            need = self._needs(req)
            if not chosen or used + need <= self.budget:
                chosen.append(req)
                used += need
        return chosen

    def _intent(self, req: _Request, block_id: str, position: int, parent: str, phase: int, priority: int) -> pb.MemoryIntent:
        return pb.MemoryIntent(
            block_id=block_id,
            request_id=req.rid,
            phase=phase,  # type: ignore[arg-type]
            priority=priority,  # type: ignore[arg-type]
            size_bytes=BLOCK_BYTES,
            request_priority=req.request_priority,
            recompute_cost_us=RECOMPUTE_BASE_US + RECOMPUTE_PER_BLOCK_US * position,
            recompute_ok=True,
            prefetch_ok=True,
            parent_block_id=parent,
            token_start=position * TOKENS_PER_BLOCK,
            token_count=TOKENS_PER_BLOCK,
        )

    def _prefill(self, req: _Request, now: int) -> Iterator[pb.Event]:
        req.blocks = []
        parent = ""
        for chain in req.chains:
            # Each chain (a document chunk) is cached by its content, wherever it sits in the prompt.
            parent = ""
            for block_id in chain:
                intent = self._intent(req, block_id, len(req.blocks), parent, pb.PHASE_PREFILL, req.klass)
                # Held by a running request: one more reference; released: prefix reuse; else new.
                held = self.refs.get(block_id, 0) > 0
                yield pb.Event(ts_us=now, allocated=pb.BlockAllocated(intent=intent, reuse=held))
                self.refs[block_id] = self.refs.get(block_id, 0) + 1
                self.live.add(block_id)
                self.base[block_id] = max(self.base[block_id], req.klass) if held else req.klass
                req.blocks.append(block_id)
                parent = block_id
        for _ in range(req.private_prompt):
            block_id = f"{req.rid}/b{len(req.blocks)}"
            intent = self._intent(req, block_id, len(req.blocks), parent, pb.PHASE_PREFILL, req.klass)
            yield pb.Event(ts_us=now, allocated=pb.BlockAllocated(intent=intent))
            self._own(req, block_id)
            parent = block_id
        req.next_due_us = now + self.step

    def _own(self, req: _Request, block_id: str) -> None:
        req.blocks.append(block_id)
        self.live.add(block_id)
        self.base[block_id] = req.klass

    def _critical(self, req: _Request, block_id: str, position: int, parent: str, due_us: int, *, draft: bool = False) -> pb.MemoryIntent:
        """A block allocated for a step about to run: decode-critical, pinned, due then."""
        intent = self._intent(req, block_id, position, parent, pb.PHASE_DECODE, pb.PRIORITY_DECODE_CRITICAL)
        intent.pin_requested = True
        intent.deadline_us = due_us
        intent.slack_us = req.slack_us
        if draft:
            intent.is_draft = True
            intent.recompute_cost_us = DRAFT_RECOMPUTE_US
        return intent

    def _decode(self, req: _Request, now: int) -> Iterator[pb.Event]:
        if self.drafts:
            for block_id in req.drafts:
                yield _update(now, block_id, phase=pb.PHASE_VERIFY)
        elif req.generated % TOKENS_PER_BLOCK == 0:
            # The prompt fills whole blocks: every 8th token (the first included) opens a block.
            block_id = f"{req.rid}/b{len(req.blocks)}"
            intent = self._critical(req, block_id, len(req.blocks), req.blocks[-1] if req.blocks else "", now)
            yield pb.Event(ts_us=now, allocated=pb.BlockAllocated(intent=intent))
            self._own(req, block_id)
        req.generated += 1
        req.next_due_us += req.tpot_us
        accessed = pb.BlocksAccessed(block_ids=[*req.blocks, *req.drafts])
        if not req.done:
            accessed.next_use_us = max(req.next_due_us, now + self.step)
        yield pb.Event(ts_us=now, accessed=accessed)
        if self.drafts:
            # Verification accepts a prefix of the drafts; the rest roll back.
            accepted = 0
            while accepted < len(req.drafts) and self.rng.random() < self.accept:
                accepted += 1
            for block_id in req.drafts[:accepted]:
                # Committed: the target model's KV now, as costly to recompute as any block there.
                cost = RECOMPUTE_BASE_US + RECOMPUTE_PER_BLOCK_US * len(req.blocks)
                yield _update(now, block_id, phase=pb.PHASE_DECODE, is_draft=False, is_committed=True, recompute_cost_us=cost)
                req.blocks.append(block_id)
                self.base[block_id] = req.klass
            rejected = req.drafts[accepted:]
            if rejected:
                yield pb.Event(ts_us=now, freed=pb.BlocksFreed(block_ids=rejected))
                self.live.difference_update(rejected)
            req.drafts = []

    def _announce(self, nxt: list[_Request], at: int, due_us: int) -> Iterator[pb.Event]:
        """The next batch's blocks: decode-critical, pinned, due at the next iteration."""
        slack: dict[str, int] = {}
        for req in nxt:
            for block_id in req.blocks:
                slack[block_id] = min(slack.get(block_id, req.slack_us), req.slack_us)
        critical = {"priority": pb.PRIORITY_DECODE_CRITICAL, "pin_requested": True, "phase": pb.PHASE_DECODE}
        for block_id, s in slack.items():
            yield _update(at, block_id, deadline_us=due_us, slack_us=s, **critical)

    def _draft(self, req: _Request, now: int, due_us: int) -> Iterator[pb.Event]:
        """The draft model proposes the next step's tokens: draft blocks, verified at ``due_us``."""
        parent = req.blocks[-1] if req.blocks else ""
        for _ in range(self.drafts):
            block_id = f"{req.rid}/draft{req.draft_seq}"
            req.draft_seq += 1
            intent = self._critical(req, block_id, len(req.blocks) + len(req.drafts), parent, due_us, draft=True)
            yield pb.Event(ts_us=now, allocated=pb.BlockAllocated(intent=intent))
            req.drafts.append(block_id)
            self.live.add(block_id)
            parent = block_id

    def _finish(self, req: _Request, now: int) -> Iterator[pb.Event]:
        shared = set(req.shared)
        private = [b for b in req.blocks if b not in shared]
        if private:
            yield pb.Event(ts_us=now, freed=pb.BlocksFreed(block_ids=private))
            self.live.difference_update(private)
        for block_id in req.shared:
            self.refs[block_id] -= 1
            if self.refs[block_id] == 0:
                # Kept cached for a later request with this content; nobody needs it now.
                yield _update(now, block_id, priority=pb.PRIORITY_COLD, phase=pb.PHASE_IDLE, clear_deadline=True, pin_requested=False)
                self.live.discard(block_id)
        if req.shared:
            # One reference each, like vLLM's ref_cnt: a block other requests hold stays held.
            yield pb.Event(ts_us=now, released=pb.BlocksReleased(block_ids=req.shared))


def _update(now: int, block_id: str, **changes: object) -> pb.Event:
    return pb.Event(ts_us=now, intent_updated=pb.IntentUpdated(block_id=block_id, **changes))  # type: ignore[arg-type]


def _count(base: int, scale: float) -> int:
    return max(1, round(base * scale))


def _rng(name: str, seed: int) -> random.Random:
    # A string seed is hashed with SHA-512 by random.Random: stable across runs and processes.
    return random.Random(f"{name}/{seed}")


def _poisson(rng: random.Random, mean_gap_us: int) -> Iterator[int]:
    t = 0.0
    while True:
        yield int(t)
        t += rng.expovariate(1 / mean_gap_us)


def _check_scale(scale: float) -> None:
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a number > 0, got {scale!r}")


def _stream(name: str, events: Iterator[pb.Event]) -> Iterator[pb.IntentBatch]:
    return batched(events, f"profile-{name}", BATCH_EVENTS)


def deadline_pressure(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """The seed's 12x pressure setup: 64 requests x 24 blocks x 1 MiB (1,536 MiB) against 128 MiB of
    HBM, all arriving in the first 8 ms, 1 ms iterations, two requests per batch. Half are
    interactive (slack 100 us, a token due every 2 ms), half batch (slack 1 ms, every 8 ms): it
    stresses on-time promotion of the announced batch under tight deadlines."""
    _check_scale(scale)
    rng = _rng("deadline_pressure", seed)
    step = 1_000
    requests = []
    for r in range(_count(64, scale)):
        interactive = rng.random() < 0.5
        requests.append(
            _Request(
                rid=f"req-{r:03d}",
                arrival_us=rng.randrange(8 * step),
                chains=[],
                private_prompt=23,  # + 1 block opened by the first decoded token = 24
                tokens=rng.randint(6, TOKENS_PER_BLOCK),
                request_priority=90 if interactive else rng.choice((20, 30, 40)),
                slack_us=100 if interactive else 1_000,
                tpot_us=(2 if interactive else 8) * step,
            )
        )
    return _stream("deadline_pressure", _Engine(requests, rng, step_us=step, budget_blocks=48).events())


def long_context_extreme(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """8 long-context batch requests of 96 blocks (each three quarters of HBM) among 48 short
    interactive ones of 16 blocks (1,536 MiB, 12x HBM), 2 ms iterations with a 96-block batch
    budget: one long request's decode flushes HBM, and the next batch cannot be prefetched while
    it is pinned. Stresses keeping short interactive contexts against huge ones."""
    _check_scale(scale)
    rng = _rng("long_context_extreme", seed)
    step = 2_000
    requests = []
    kinds = [True] * _count(8, scale) + [False] * _count(48, scale)
    rng.shuffle(kinds)
    for r, long in enumerate(kinds):
        requests.append(
            _Request(
                rid=f"req-{r:03d}",
                arrival_us=rng.randrange(40 * step),
                chains=[],
                private_prompt=95 if long else 15,
                tokens=rng.randint(4, TOKENS_PER_BLOCK),
                request_priority=30 if long else 85,
                slack_us=20_000 if long else 500,
                tpot_us=(10 if long else 3) * step,
            )
        )
    return _stream("long_context_extreme", _Engine(requests, rng, step_us=step, budget_blocks=96).events())


def rag_mixed_priority(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """64 RAG requests of 24 blocks: a 4-block system prompt shared by all, 2-3 retrieved documents
    of 4 blocks from a corpus of 24 with Zipf popularity (shared by content id, released to the
    cache when unused), private blocks for the rest. Three priority classes (90 / 50 / 10, slack
    200 us / 2 ms / 10 ms); Poisson arrivals every 2 ms. Stresses shared, cached prefixes against
    mixed-priority private blocks."""
    _check_scale(scale)
    rng = _rng("rag_mixed_priority", seed)
    step = 1_000
    docs = _count(24, scale)
    popularity = list(range(docs))
    rng.shuffle(popularity)
    weights = [1.0 / (rank + 1) for rank in popularity]
    system = [f"sys/b{k}" for k in range(4)]
    arrivals = _poisson(rng, 2 * step)
    requests = []
    for r in range(_count(64, scale)):
        picked = _weighted_sample(rng, list(range(docs)), weights, rng.randint(2, 3))
        chains = [system] + [[f"doc{d}/b{k}" for k in range(4)] for d in picked]
        u = rng.random()
        priority, slack, tpot = (90, 200, 2) if u < 0.25 else (50, 2_000, 5) if u < 0.75 else (10, 10_000, 10)
        requests.append(
            _Request(
                rid=f"req-{r:03d}",
                arrival_us=next(arrivals),
                chains=chains,
                private_prompt=23 - 4 * len(chains),
                tokens=rng.randint(6, TOKENS_PER_BLOCK),
                request_priority=priority,
                slack_us=slack,
                tpot_us=tpot * step,
            )
        )
    return _stream("rag_mixed_priority", _Engine(requests, rng, step_us=step, budget_blocks=48).events())


def speculative_decode(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """48 requests of 16 prompt blocks decoding speculatively: after each forward pass the draft
    model allocates 4 draft blocks (is_draft, pinned) for the next step; verification reads them
    with the context, accepts each in turn with probability 0.35 (committed, joining the request)
    and frees the rest. 1.5 ms iterations. Stresses churn of short-lived, cheap-to-recompute drafts."""
    _check_scale(scale)
    rng = _rng("speculative_decode", seed)
    step = 1_500
    arrivals = _poisson(rng, step)
    requests = []
    for r in range(_count(48, scale)):
        interactive = rng.random() < 0.5
        requests.append(
            _Request(
                rid=f"req-{r:03d}",
                arrival_us=next(arrivals),
                chains=[],
                private_prompt=16,
                tokens=rng.randint(6, 10),
                request_priority=90 if interactive else 40,
                slack_us=300 if interactive else 3_000,
                tpot_us=(2 if interactive else 6) * step,
            )
        )
    engine = _Engine(requests, rng, step_us=step, budget_blocks=48, drafts=4, accept=0.35)
    return _stream("speculative_decode", engine.events())


def balanced(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """32 requests of 9-22 blocks (about 500 MiB, 4x HBM) arriving every 8 ms on average, 2 ms
    iterations, half interactive (slack 1 ms) and half batch (slack 5 ms): moderate pressure and
    deadlines, the control against which the other profiles' stresses show."""
    _check_scale(scale)
    rng = _rng("balanced", seed)
    step = 2_000
    arrivals = _poisson(rng, 4 * step)
    requests = []
    for r in range(_count(32, scale)):
        interactive = rng.random() < 0.5
        requests.append(
            _Request(
                rid=f"req-{r:03d}",
                arrival_us=next(arrivals),
                chains=[],
                private_prompt=rng.randint(8, 20),
                tokens=rng.randint(8, 2 * TOKENS_PER_BLOCK),
                request_priority=90 if interactive else 50,
                slack_us=1_000 if interactive else 5_000,
                tpot_us=(3 if interactive else 6) * step,
            )
        )
    return _stream("balanced", _Engine(requests, rng, step_us=step, budget_blocks=48).events())


def _weighted_sample(rng: random.Random, items: list[int], weights: list[float], k: int) -> list[int]:
    """k distinct items, each draw weighted among those left."""
    items, weights = list(items), list(weights)
    out: list[int] = []
    for _ in range(min(k, len(items))):
        cum = list(itertools.accumulate(weights))
        i = min(bisect.bisect_right(cum, rng.random() * cum[-1]), len(items) - 1)
        out.append(items.pop(i))
        weights.pop(i)
    return out


# ---- the kv-hierarchy-lab family --------------------------------------------------------------

# A page is 16 tokens of one attention head of dim 64, K and V, at fp16: 16 x 64 x 2 x 2 bytes.
# The lab's top tier (128,000 B) then holds 31 pages, so its 48-128-page workloads run at 1.5-4x
# the top tier (and mostly fit tier0 + tier1, 93 pages), as in its small fp16 setup where LRU
# hit about half the time (0.459 on rag_burst).
PAGE_BYTES = 4096
PAGE_TOKENS = 16
ACCESS_US = 1_000  # one lab step

LAB_TIERS_TOML = """\
# kv-hierarchy-lab's tiers (its write latency has no key here: a move costs the source's read
# latency plus size / bandwidth). It evicts on overflow just enough to fit, so the watermarks
# are 1.0: no headroom is kept.
[[tiers]]
name = "tier0_gpu_fast"
capacity = 128000
read_latency_us = 20.0
bandwidth_gb_per_s = 0.08
high_watermark = 1.0
low_watermark = 1.0

[[tiers]]
name = "tier1_gpu_overflow"
capacity = 256000
read_latency_us = 60.0
bandwidth_gb_per_s = 0.04
high_watermark = 1.0
low_watermark = 1.0

[[tiers]]
name = "tier2_host_ram"
capacity = 1000000
read_latency_us = 400.0
bandwidth_gb_per_s = 0.008
high_watermark = 1.0
low_watermark = 1.0

[[tiers]]
name = "tier3_nvme_like"
capacity = 8000000
read_latency_us = 2500.0
bandwidth_gb_per_s = 0.002
high_watermark = 1.0
low_watermark = 1.0
"""


@dataclasses.dataclass
class _Pages:
    """A page-access workload: the access sequence, each page's group and chain parent."""

    accesses: list[int] = dataclasses.field(default_factory=list)
    group: dict[int, str] = dataclasses.field(default_factory=dict)
    parent: dict[int, int] = dataclasses.field(default_factory=dict)

    def page(self, index: int, group: str, parent: int | None = None) -> int:
        self.group[index] = group
        if parent is not None:
            self.parent[index] = parent
        return index


def _lab_size(rng: random.Random, scale: float) -> tuple[int, int]:
    """Pages and accesses of one workload: the lab's 48-128 and 240-400, times scale."""
    return _count(rng.randint(48, 128), scale), _count(rng.randint(240, 400), scale)


def _page_events(work: _Pages, limit: int) -> Iterator[pb.Event]:
    """First access allocates, later ones read; a group is released after its last access."""
    seq = work.accesses[:limit]
    last: dict[str, int] = {}
    for i, p in enumerate(seq):
        last[work.group[p]] = i
    held: dict[str, list[str]] = {}
    seen: set[int] = set()
    for i, p in enumerate(seq):
        ts = i * ACCESS_US
        block_id = f"p{p:04d}"
        group = work.group[p]
        if p in seen:
            yield pb.Event(ts_us=ts, accessed=pb.BlocksAccessed(block_ids=[block_id]))
        else:
            seen.add(p)
            parent = work.parent.get(p)
            intent = pb.MemoryIntent(
                block_id=block_id,
                request_id=group,
                size_bytes=PAGE_BYTES,
                parent_block_id=f"p{parent:04d}" if parent is not None and parent in seen else "",
                token_count=PAGE_TOKENS,
            )
            yield pb.Event(ts_us=ts, allocated=pb.BlockAllocated(intent=intent))
            held.setdefault(group, []).append(block_id)
        if last[group] == i:
            yield pb.Event(ts_us=ts, released=pb.BlocksReleased(block_ids=held.pop(group)))


def _lab(name: str, seed: int, scale: float, build: Callable[[random.Random, int, int], _Pages]) -> Iterator[pb.IntentBatch]:
    _check_scale(scale)
    rng = _rng(name, seed)
    pages, accesses = _lab_size(rng, scale)
    work = build(rng, pages, accesses)
    return _stream(name, _page_events(work, accesses))


def _chat(rng: random.Random, pages: int, accesses: int) -> _Pages:
    w = _Pages()
    convs = max(2, pages // 12)
    budget = [pages // convs + (1 if c < pages % convs else 0) for c in range(convs)]
    history: list[list[int]] = [[] for _ in range(convs)]
    fresh = itertools.count()
    cur = 0
    while len(w.accesses) < accesses:
        if rng.random() >= 0.5:  # as often as not, the same conversation continues
            cur = rng.randrange(convs)
        conv = history[cur]
        for _ in range(min(rng.randint(1, 3), budget[cur])):
            budget[cur] -= 1
            conv.append(w.page(next(fresh), f"conv{cur}", conv[-1] if conv else None))
        w.accesses.extend(conv[-10:])  # the turn re-reads its recent history
    return w


def chat_continuation(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """Conversations of 12 pages each, interleaved: a turn (half the time of the conversation just
    served) appends 1-3 pages and re-reads its last 10. Stresses recency when users come back to a
    conversation after others took the top tier."""
    return _lab("chat_continuation", seed, scale, _chat)


def _rag(rng: random.Random, pages: int, accesses: int) -> _Pages:
    w = _Pages()
    system = [w.page(k, "system", k - 1 if k else None) for k in range(min(4, pages))]
    doc_pages = 8
    docs = [
        [w.page(4 + doc_pages * d + k, f"doc{d}", 4 + doc_pages * d + k - 1 if k else None) for k in range(doc_pages)]
        for d in range((pages - 4) // doc_pages)
    ]
    rank = list(range(len(docs)))
    rng.shuffle(rank)
    weights = [1.0 / (r + 1) for r in rank]
    while len(w.accesses) < accesses:
        topic = _weighted_sample(rng, list(range(len(docs))), weights, 4)
        for _ in range(rng.randint(2, 5)):  # a burst of queries on one topic
            w.accesses.extend(system)
            for d in rng.sample(topic, min(len(topic), rng.randint(2, 4))):
                w.accesses.extend(docs[d])
    return w


def rag_burst(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """A 4-page system prompt and 8-page documents with Zipf popularity; a burst of 2-5 queries reads
    the prompt and 2-4 of the same 4 documents (36 pages, a little more than tier0), then the topic
    moves. Stresses bursty reuse whose working set changes between bursts."""
    return _lab("rag_burst", seed, scale, _rag)


def _periodic(rng: random.Random, pages: int, accesses: int) -> _Pages:
    w = _Pages()
    loop_len = max(1, min(pages - 1, rng.randint(36, 60)))
    loop = [w.page(k, "loop", k - 1 if k else None) for k in range(loop_len)]
    noise = list(range(loop_len, pages))
    cycle = 0
    while len(w.accesses) < accesses:
        w.accesses.extend(loop)
        for _ in range(rng.randint(2, 6) if noise else 0):
            w.accesses.append(w.page(noise[rng.randrange(len(noise))], f"noise{cycle}"))
        cycle += 1
    return w


def periodic_reuse(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """A loop of 36-60 pages (more than the 31 of tier0) read in the same order every period, with
    2-6 noise pages between periods. Stresses the cyclic pattern where LRU always evicts the page
    needed next."""
    return _lab("periodic_reuse", seed, scale, _periodic)


def _zipf_draws(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    order = list(range(n))
    rng.shuffle(order)
    cum = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))
    return lambda: order[min(bisect.bisect_right(cum, rng.random() * cum[-1]), n - 1)]


def _long_tail(rng: random.Random, pages: int, accesses: int) -> _Pages:
    w = _Pages()
    for p in range(pages):
        w.page(p, f"doc{p // 8}")
    draw = _zipf_draws(rng, pages, 1.1)
    w.accesses = [draw() for _ in range(accesses)]
    return w


def long_tail_mix(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """Independent Zipf(1.1) draws over all pages: a few hot pages and a long tail read once or
    twice. Stresses frequency against recency (heavy hitters vs one-offs)."""
    return _lab("long_tail_mix", seed, scale, _long_tail)


def _chains(rng: random.Random, pages: int, accesses: int) -> _Pages:
    w = _Pages()
    count = rng.randint(2, 4)
    bounds = [pages * c // count for c in range(count + 1)]
    chains = [[w.page(p, f"chain{c}", p - 1 if p > bounds[c] else None) for p in range(bounds[c], bounds[c + 1])] for c in range(count)]
    chains = [c for c in chains if c]
    while len(w.accesses) < accesses:
        for c in rng.sample(range(len(chains)), len(chains)):  # every chain once a round, in a random order
            w.accesses.extend(chains[c])
    return w


def prefetch_friendly(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """2-4 page chains, each always walked start to end (the successor of a page never changes),
    every chain once a round in a random order. Stresses successor prediction: a Markov prefetcher should hide most
    misses that recency alone takes."""
    return _lab("prefetch_friendly", seed, scale, _chains)


def _misleading(rng: random.Random, pages: int, accesses: int) -> _Pages:
    w = _Pages()
    pool = 8
    # Training: three interleaved walks (a0 b0 a1 b1 ...) of each pair of pools; the first
    # allocates, the two others read every page's successor, in the other pool, twice.
    pairs = max(1, min(pages // (2 * pool), max(3, accesses // 2 // (6 * pool))))
    pools = [[w.page(p, f"pool{k}") for p in range(k * pool, (k + 1) * pool)] for k in range(2 * pairs)]
    for a, b in zip(pools[::2], pools[1::2], strict=True):
        w.accesses.extend([p for pair in zip(a, b, strict=True) for p in pair] * 3)
    # The other pages are read once each, between the walks.
    cold = [w.page(p, f"cold{p // pool}") for p in range(2 * pairs * pool, pages)]
    rng.shuffle(cold)
    while len(w.accesses) < accesses:
        order = pools[rng.randrange(len(pools))][:]
        rng.shuffle(order)  # one pool alone, in a fresh order: every learned successor is wrong
        w.accesses.extend(order)
        for _ in range(min(len(cold), rng.randint(2, 6))):
            w.accesses.append(cold.pop())
    return w


def adversarial_prefetch(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """Pools of 8 pages in pairs: each pair is first walked three times interleaved (a0 b0 a1 b1 ...):
    a Markov predictor learns successors in the other pool; afterwards one pool at a time is walked
    in fresh orders. Stresses prefetchers whose learned successors mislead: every prediction is a
    page of the pool not being read, brought in over useful ones."""
    return _lab("adversarial_prefetch", seed, scale, _misleading)


def _bursts(rng: random.Random, pages: int, accesses: int) -> _Pages:
    w = _Pages()
    hot_n = max(1, min(pages - 1, pages // 6))
    hot = [w.page(p, "hot") for p in range(hot_n)]
    cold = [w.page(p, f"scan{(p - hot_n) // 8}") for p in range(hot_n, pages)]
    cursor = 0
    while len(w.accesses) < accesses:
        w.accesses.extend(hot[rng.randrange(len(hot))] for _ in range(rng.randint(20, 40)))
        for _ in range(rng.randint(24, 40) if cold else 0):  # a scan, each page once
            w.accesses.append(cold[cursor % len(cold)])
            cursor += 1
    return w


def adversarial_burst(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """A small hot set (a sixth of the pages) read steadily, interrupted by scans of 24-40 cold
    pages, each read once per scan, more than tier0 holds. Stresses scan resistance: a burst
    flushes the hot set out of a recency-ordered tier."""
    return _lab("adversarial_burst", seed, scale, _bursts)


def _mixed(rng: random.Random, pages: int, accesses: int) -> _Pages:
    w = _Pages()
    for p in range(pages):
        w.page(p, f"region{p // 16}")
    draw = _zipf_draws(rng, pages, 1.0)
    stream = 0
    while len(w.accesses) < accesses:
        mode = rng.randrange(4)
        length = rng.randint(20, 40)
        if mode == 0:  # a small loop
            start = rng.randrange(pages)
            loop = [(start + k) % pages for k in range(min(8, pages))]
            w.accesses.extend(loop[k % len(loop)] for k in range(length))
        elif mode == 1:  # a sequential stream continuing where it left off
            w.accesses.extend((stream + k) % pages for k in range(length))
            stream += length
        elif mode == 2:  # uniform random
            w.accesses.extend(rng.randrange(pages) for _ in range(length))
        else:  # skewed
            w.accesses.extend(draw() for _ in range(length))
    return w


def mixed_locality(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """Phases of 20-40 accesses switching between a small loop, a sequential stream, uniform random
    and Zipf-skewed reads. Stresses adapting to locality that keeps changing."""
    return _lab("mixed_locality", seed, scale, _mixed)


# ---- scan pollution -------------------------------------------------------------------------

# vLLM's default block: 16 tokens of llama-3-8b at fp16 (16 x 131,072 bytes).
SCAN_BLOCK_BYTES = 2 * MIB
HOT_BLOCKS = 64
SCAN_BLOCKS = 1_984
# The hot prefix is read this many times before the scan, and again after it.
HOT_PASSES = 4

SCAN_TIERS_TOML = """\
# scan_pollution's tiers: HBM holds 256 blocks of 2 MiB, four times the 64-block hot prefix
# (so it fits in two_queue's active half) and an eighth of the scan; DRAM holds everything.
[[tiers]]
name = "hbm"
capacity = "512MiB"
read_latency_us = 0.0
bandwidth_gb_per_s = 2000.0

[[tiers]]
name = "dram"
capacity = "8GiB"
read_latency_us = 2.0
bandwidth_gb_per_s = 25.0

[[tiers]]
name = "nvme"
capacity = "64GiB"
read_latency_us = 80.0
bandwidth_gb_per_s = 6.0
"""


def _scan_events(rng: random.Random, hot_n: int, scan_n: int) -> Iterator[pb.Event]:
    t = 0
    hot = [f"sys/b{k}" for k in range(hot_n)]
    for k, block_id in enumerate(hot):
        intent = pb.MemoryIntent(
            block_id=block_id,
            request_id="system",
            size_bytes=SCAN_BLOCK_BYTES,
            parent_block_id=hot[k - 1] if k else "",
            token_start=k * 16,
            token_count=16,
        )
        yield pb.Event(ts_us=t, allocated=pb.BlockAllocated(intent=intent))

    def passes() -> Iterator[pb.Event]:
        nonlocal t
        for _ in range(HOT_PASSES):
            t += rng.randint(500, 1_500)
            yield pb.Event(ts_us=t, accessed=pb.BlocksAccessed(block_ids=hot))

    yield from passes()
    # The burst: requests of 8-32 blocks, each written once by its prefill and never read.
    made = 0
    r = 0
    while made < scan_n:
        t += rng.randint(500, 1_500)
        ids = [f"scan-{r:04d}/b{k}" for k in range(min(rng.randint(8, 32), scan_n - made))]
        for k, block_id in enumerate(ids):
            intent = pb.MemoryIntent(
                block_id=block_id,
                request_id=f"scan-{r:04d}",
                size_bytes=SCAN_BLOCK_BYTES,
                parent_block_id=ids[k - 1] if k else "",
                token_start=k * 16,
                token_count=16,
            )
            yield pb.Event(ts_us=t, allocated=pb.BlockAllocated(intent=intent))
        yield pb.Event(ts_us=t, released=pb.BlocksReleased(block_ids=ids))
        made += len(ids)
        r += 1
    yield from passes()
    yield pb.Event(ts_us=t, released=pb.BlocksReleased(block_ids=hot))


def scan_pollution(seed: int = 42, scale: float = 1.0) -> Iterator[pb.IntentBatch]:
    """A 64-block hot prefix (a system prompt, 2 MiB blocks) read 4 times, a burst of 1,984 blocks
    written once and never read (released scan requests of 8-32 blocks), the hot prefix read 4
    times again. Stresses scan resistance: LRU loses the prefix to the burst, two_queue, arc and
    s3fifo keep it (while the prefix fits in half of HBM: scale <= 2 on SCAN_TIERS_TOML)."""
    _check_scale(scale)
    rng = _rng("scan_pollution", seed)
    return _stream("scan_pollution", _scan_events(rng, _count(HOT_BLOCKS, scale), _count(SCAN_BLOCKS, scale)))


# ---- registry ---------------------------------------------------------------------------------

Profile = Callable[[int, float], Iterator[pb.IntentBatch]]

KVDS_PROFILES = ("deadline_pressure", "long_context_extreme", "rag_mixed_priority", "speculative_decode", "balanced")
LAB_PROFILES = (
    "rag_burst",
    "adversarial_burst",
    "periodic_reuse",
    "chat_continuation",
    "prefetch_friendly",
    "adversarial_prefetch",
    "mixed_locality",
    "long_tail_mix",
)

PROFILES: dict[str, Profile] = {
    "deadline_pressure": deadline_pressure,
    "long_context_extreme": long_context_extreme,
    "rag_mixed_priority": rag_mixed_priority,
    "speculative_decode": speculative_decode,
    "balanced": balanced,
    "rag_burst": rag_burst,
    "adversarial_burst": adversarial_burst,
    "periodic_reuse": periodic_reuse,
    "chat_continuation": chat_continuation,
    "prefetch_friendly": prefetch_friendly,
    "adversarial_prefetch": adversarial_prefetch,
    "mixed_locality": mixed_locality,
    "long_tail_mix": long_tail_mix,
    "scan_pollution": scan_pollution,
}

FAMILY_CONFIGS = {"kvds": KVDS_TIERS_TOML, "lab": LAB_TIERS_TOML, "scan": SCAN_TIERS_TOML}


def family(name: str) -> str:
    """``kvds``, ``lab`` or ``scan``; KeyError for an unknown profile."""
    if name in KVDS_PROFILES:
        return "kvds"
    if name in LAB_PROFILES:
        return "lab"
    if name == "scan_pollution":
        return "scan"
    raise KeyError(_unknown(name))


def profile_config(name: str) -> str:
    """The tier config (TOML) the profile is meant to be replayed on."""
    return FAMILY_CONFIGS[family(name)]


def _unknown(name: str) -> str:
    return f"unknown profile {name!r} (profiles: {', '.join(sorted(PROFILES))})"


def profile_format(path: str, opts: TraceOptions, skips: SkipCounter) -> Iterator[pb.IntentBatch]:
    """The ``profile`` entry of FORMATS: ``path`` names the profile; seed and scale come from opts."""
    generate = PROFILES.get(path)
    if generate is None:
        raise TraceError(path, 0, "profile", _unknown(path))
    try:
        return generate(opts.seed, opts.scale)
    except ValueError as exc:
        raise TraceError(path, 0, "scale", str(exc)) from None
