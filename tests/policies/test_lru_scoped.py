"""lru's request-scoped recency (BlocksAccessed.scope / token_positions / ends_scope,
BlockAllocated.scope), checked through the real core against a reference model.

The reference is deliberately naive: a dict block id -> rank ``(r, s)`` and a counter. A
plain use (allocation, plain access, a reload of a dropped block) gives ``(++c, 0)``; a
scope (client, name) takes ``R = ++c`` at its first scoped use and keeps it until
``ends_scope`` names it or the client clears; a scoped access of a resident block at
position p raises it to ``(R, -p)`` only if its rank is below that; a scoped allocation
places it at ``(R, -token_start)`` unconditionally. The eviction order is ascending
``(r, s, block_id)`` (vLLM 0.33's LRUCachePolicy: request rank, ``(rank, -position)``).

Every batch goes through ``broker.model.apply.apply_batch`` on a one-tier core of one-byte
chunks (the embedded vLLM core's config, vllm_integration/decisions_to_vllm/settings.py), large enough that no
allocation ever evicts. Victims are taken with ``eviction_requested``; after each batch the
test compares the EVICT directives (in order), the rejections, the known and resident
blocks and the whole eviction order (``choose_victims`` over every block: read only).
"""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from broker.model import wire
from broker.model.apply import BatchOutcome, apply_batch
from broker.model.core import Core, DirectiveKind
from kvbroker.v1 import intent_pb2 as pb
from vllm_integration.decisions_to_vllm.settings import OffloadSettings

# One-byte chunks: the tier never fills, so only eviction_requested takes victims.
CAPACITY = 100_000
CLIENTS = ("c0", "c1")

# ---- the events, as small values (hypothesis shrinks them; a failure prints them) --------


@dataclasses.dataclass(frozen=True)
class Alloc:
    block: str
    scope: str = ""
    start: int = 0  # MemoryIntent.token_start
    reuse: bool = False


@dataclasses.dataclass(frozen=True)
class Access:
    blocks: tuple[str, ...] = ()
    scope: str = ""
    positions: tuple[int, ...] = ()
    ends: str = ""


@dataclasses.dataclass(frozen=True)
class Release:
    blocks: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Free:
    blocks: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Clear:
    pass


@dataclasses.dataclass(frozen=True)
class Evict:
    count: int
    protected: tuple[str, ...] = ()


Op = Alloc | Access | Release | Free | Clear | Evict
Batch = tuple[str, tuple[Op, ...]]  # (client, events)


def to_pb(op: Op, ts: int) -> pb.Event:
    if isinstance(op, Alloc):
        intent = pb.MemoryIntent(block_id=op.block, size_bytes=1, token_start=op.start)
        return pb.Event(ts_us=ts, allocated=pb.BlockAllocated(intent=intent, reuse=op.reuse, scope=op.scope))
    if isinstance(op, Access):
        accessed = pb.BlocksAccessed(block_ids=op.blocks, scope=op.scope, token_positions=op.positions, ends_scope=op.ends)
        return pb.Event(ts_us=ts, accessed=accessed)
    if isinstance(op, Release):
        return pb.Event(ts_us=ts, released=pb.BlocksReleased(block_ids=op.blocks))
    if isinstance(op, Free):
        return pb.Event(ts_us=ts, freed=pb.BlocksFreed(block_ids=op.blocks))
    if isinstance(op, Clear):
        return pb.Event(ts_us=ts, cleared=pb.AllBlocksCleared())
    return pb.Event(ts_us=ts, eviction_requested=pb.EvictionRequested(count=op.count, protected_block_ids=op.protected))


# ---- the core under test -----------------------------------------------------------------


class Harness:
    """A one-tier core of ``CAPACITY`` one-byte chunks with ``policy``; batches go in as the
    broker receives them (serialized bytes: the native reader, unless the test switches to
    the reference reader)."""

    def __init__(self, policy: str = "lru") -> None:
        self.core = Core(OffloadSettings().core_config(CAPACITY, policy))
        self.seq = 0
        self.ts = 0

    def send(self, client: str, ops: Sequence[Op]) -> BatchOutcome:
        self.seq += 1
        events = []
        for op in ops:
            self.ts += 1
            events.append(to_pb(op, self.ts))
        batch = pb.IntentBatch(client_id=client, batch_seq=self.seq, events=events)
        return apply_batch(self.core, batch.SerializeToString())

    def order(self) -> list[str]:
        """The whole eviction order, coldest first (choose_victims changes nothing)."""
        policy = self.core.tiers[0].policy
        chosen = policy.choose_victims(len(policy), frozenset())
        assert chosen is not None
        return [b.block_id for b in chosen]

    def known(self) -> set[str]:
        return set(self.core.blocks)

    def resident(self) -> set[str]:
        return {b.block_id for b in self.core.blocks.values() if b.tier == 0}

    def check_consistent(self) -> None:
        tier = self.core.tiers[0]
        resident = self.resident()
        assert tier.used == tier.blocks == len(resident) <= CAPACITY
        assert len(tier.policy) == len(resident)
        assert all(block_id in tier.policy for block_id in resident)


# ---- reference models ----------------------------------------------------------------------


@dataclasses.dataclass
class Known:
    owner: str
    refs: int = 1
    released: bool = False


class Model:
    """What the core does with the events whatever the order: which blocks are known (resident
    or dropped), referenced, whose, and which events are rejected. The order is the
    subclass's: ``use`` (a plain use; a dropped block is reloaded), ``scoped_use``,
    ``place``, ``end``, ``drop`` and ``order``."""

    def __init__(self) -> None:
        self.blocks: dict[str, Known] = {}

    # The order's hooks.
    def use(self, block_id: str) -> None:
        raise NotImplementedError

    def scoped_use(self, client: str, scope: str, hot: list[str], positions: dict[str, int]) -> None:
        raise NotImplementedError

    def place(self, client: str, scope: str, block_id: str, start: int) -> None:
        raise NotImplementedError

    def end(self, client: str, scope: str) -> None:
        raise NotImplementedError

    def end_client(self, client: str) -> None:
        raise NotImplementedError

    def drop(self, block_id: str) -> None:
        raise NotImplementedError

    def is_resident(self, block_id: str) -> bool:
        raise NotImplementedError

    def order(self) -> list[str]:
        raise NotImplementedError

    # The events: each returns the rejected field (None: applied) and the victims.
    def apply(self, client: str, op: Op) -> tuple[str | None, list[str]]:
        if isinstance(op, Alloc):
            return self._alloc(client, op), []
        if isinstance(op, Access):
            return self._access(client, op), []
        if isinstance(op, Release | Free):
            kind = "released" if isinstance(op, Release) else "freed"
            bad = self._unknown(op.blocks, f"{kind}.block_ids", empty_ok=False)
            if bad is not None:
                return bad, []
            for block_id in op.blocks:
                if isinstance(op, Free):
                    if self.blocks.pop(block_id, None) is not None:
                        self.drop(block_id)
                    continue
                known = self.blocks[block_id]
                if not known.released:
                    known.refs -= 1
                    known.released = known.refs == 0
            return None, []
        if isinstance(op, Clear):
            self.end_client(client)
            for block_id in [b for b, k in self.blocks.items() if k.owner == client]:
                del self.blocks[block_id]
                self.drop(block_id)
            return None, []
        candidates = [b for b in self.order() if b not in op.protected]
        if op.count > len(candidates):
            return "eviction_requested.count", []
        victims = candidates[: op.count]
        for block_id in victims:
            self.drop(block_id)  # dropped, still known until freed
        return None, victims

    def _unknown(self, ids: Sequence[str], field: str, *, empty_ok: bool) -> str | None:
        for i, block_id in enumerate(ids):
            if block_id not in self.blocks:
                return f"{field}[{i}]"
        if not ids and not empty_ok:
            return field
        return None

    def _alloc(self, client: str, op: Alloc) -> str | None:
        known = self.blocks.get(op.block)
        if known is None:
            self.blocks[op.block] = Known(client)
        elif known.released:  # prefix reuse: a new owner, and an access
            known.owner, known.refs, known.released = client, 1, False
        elif op.reuse:  # one more reference, and an access
            known.refs += 1
        else:
            return "allocated.intent.block_id"
        self.use(op.block)
        if op.scope:
            self.place(client, op.scope, op.block, op.start)
        return None

    def _access(self, client: str, op: Access) -> str | None:
        ids = op.blocks
        bad = self._unknown(ids, "accessed.block_ids", empty_ok=bool(op.scope or op.ends))
        if bad is not None:
            return bad
        if op.scope and len(op.positions) != len(ids):
            return "accessed.token_positions"
        if not op.scope and op.positions:
            return "accessed.token_positions"
        if op.scope:
            positions = dict(zip(ids, op.positions, strict=True))
            # The scope opens with the event, before any of its uses. The blocks in the tier
            # rank with the scope; a dropped one is reloaded, a plain use (so above the
            # scope), at its place in the event (the scoped ones before it applied first).
            self.scoped_use(client, op.scope, [], positions)
            hot: list[str] = []
            for block_id in ids:
                if self.is_resident(block_id):
                    hot.append(block_id)
                    continue
                if hot:
                    self.scoped_use(client, op.scope, hot, positions)
                    hot = []
                self.use(block_id)
            self.scoped_use(client, op.scope, hot, positions)  # even with none: the scope's rank
        else:
            for block_id in ids:
                self.use(block_id)
        if op.ends:
            self.end(client, op.ends)
        return None


class ScopedLRU(Model):
    """The reference: ranks ``(r, s)``, victims by ``(r, s, block_id)``."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = 0
        self.rank: dict[str, tuple[int, int]] = {}
        self.scopes: dict[tuple[str, str], int] = {}

    def _next(self) -> int:
        self.counter += 1
        return self.counter

    def _scope(self, client: str, scope: str) -> int:
        key = (client, scope)
        if key not in self.scopes:
            self.scopes[key] = self._next()
        return self.scopes[key]

    def use(self, block_id: str) -> None:
        self.rank[block_id] = (self._next(), 0)

    def scoped_use(self, client: str, scope: str, hot: list[str], positions: dict[str, int]) -> None:
        r = self._scope(client, scope)
        for block_id in hot:
            new = (r, -positions[block_id])
            if self.rank[block_id] < new:
                self.rank[block_id] = new

    def place(self, client: str, scope: str, block_id: str, start: int) -> None:
        self.rank[block_id] = (self._scope(client, scope), -start)

    def end(self, client: str, scope: str) -> None:
        self.scopes.pop((client, scope), None)

    def end_client(self, client: str) -> None:
        for key in [k for k in self.scopes if k[0] == client]:
            del self.scopes[key]

    def drop(self, block_id: str) -> None:
        self.rank.pop(block_id, None)

    def is_resident(self, block_id: str) -> bool:
        return block_id in self.rank

    def order(self) -> list[str]:
        return sorted(self.rank, key=lambda b: (*self.rank[b], b))


class PlainLRU(Model):
    """Textbook LRU, for streams with no scoped field: an OrderedDict, a use moves to the end."""

    def __init__(self) -> None:
        super().__init__()
        self.lru: OrderedDict[str, None] = OrderedDict()

    def use(self, block_id: str) -> None:
        self.lru[block_id] = None
        self.lru.move_to_end(block_id)

    def scoped_use(self, client: str, scope: str, hot: list[str], positions: dict[str, int]) -> None:
        raise AssertionError("a scoped event in a plain stream")

    def place(self, client: str, scope: str, block_id: str, start: int) -> None:
        raise AssertionError("a scoped event in a plain stream")

    def end(self, client: str, scope: str) -> None:
        raise AssertionError("a scoped event in a plain stream")

    def end_client(self, client: str) -> None:
        pass

    def drop(self, block_id: str) -> None:
        self.lru.pop(block_id, None)

    def is_resident(self, block_id: str) -> bool:
        return block_id in self.lru

    def order(self) -> list[str]:
        return list(self.lru)


# ---- playing a stream against a model ------------------------------------------------------


def step(h: Harness, model: Model, client: str, ops: Sequence[Op], where: str) -> None:
    """Apply one batch to the core and the model; everything observable must agree."""
    expected_rejections: list[tuple[int, str]] = []
    expected_victims: list[str] = []
    for i, op in enumerate(ops):
        field, victims = model.apply(client, op)
        if field is not None:
            expected_rejections.append((i, field))
        expected_victims += victims
    out = h.send(client, ops)
    got = [(r.index, r.field) for r in out.rejections]
    assert got == expected_rejections, f"{where}: rejections {out.rejections}, expected {expected_rejections}"
    assert all(d.kind == DirectiveKind.EVICT and d.reason == "eviction requested by the engine" for d in out.directives), where
    assert [d.block_id for d in out.directives] == expected_victims, f"{where}: victims"
    assert h.known() == set(model.blocks), f"{where}: known blocks"
    order = model.order()
    assert h.resident() == set(order), f"{where}: resident blocks"
    assert h.order() == order, f"{where}: eviction order"
    h.check_consistent()


# ---- hypothesis streams: few ids, scopes and positions, so that they collide -----------
#
# Drawn once, as templates: an id "#i" stands for the i-th known block when the event is
# applied (so that most events apply), "new" for an id not in use; literal ids may be
# unknown (rejected). The stream as applied is noted when a check fails.

IDS = tuple(f"b{i}" for i in range(8))
SCOPES = ("r0", "r1", "r2")
POSITIONS = st.integers(0, 3)
KNOWN = st.sampled_from([f"#{i}" for i in range(6)])
BLOCK = st.one_of(*[KNOWN] * 7, st.sampled_from(IDS))
SOME = st.lists(BLOCK, min_size=1, max_size=3).map(tuple)


def resolve(op: Op, model: Model) -> Op:
    """The template's placeholders as ids, from the model's state now."""
    known = sorted(model.blocks)

    def one(name: str) -> str:
        if name == "new":
            return next((b for b in IDS if b not in model.blocks), IDS[0])
        if name.startswith("#"):
            i = int(name[1:])
            return known[i % len(known)] if known else IDS[i]
        return name

    if isinstance(op, Alloc):
        return dataclasses.replace(op, block=one(op.block))
    if isinstance(op, Access | Release | Free):
        return dataclasses.replace(op, blocks=tuple(map(one, op.blocks)))
    if isinstance(op, Evict):
        return dataclasses.replace(op, protected=tuple(map(one, op.protected)))
    return op


@st.composite
def scoped_accesses(draw: st.DrawFn) -> Access:
    blocks = draw(st.lists(BLOCK, max_size=3).map(tuple))
    scope = draw(st.sampled_from(("", *SCOPES, *SCOPES)))
    at: tuple[int, ...] = ()
    if scope:
        # One position per block, but now and then a count that must be rejected.
        n = len(blocks) if draw(st.integers(0, 11)) < 11 else draw(st.integers(0, 4))
        at = tuple(draw(st.lists(POSITIONS, min_size=n, max_size=n)))
    ends = draw(st.sampled_from(("", "", "", "", *SCOPES)))
    return Access(blocks, scope, at, ends)


def rarely_clear(i: int) -> Op:
    return Clear() if i == 11 else Alloc("new")


def streams(scoped: bool) -> st.SearchStrategy[list[Batch]]:
    scope = st.sampled_from(("", *SCOPES)) if scoped else st.just("")
    alloc = st.builds(Alloc, st.one_of(st.just("new"), st.just("new"), BLOCK), scope, POSITIONS, st.booleans())
    evict = st.builds(Evict, st.integers(0, 3), st.lists(st.one_of(BLOCK, st.just("ghost")), max_size=3).map(tuple))
    access = scoped_accesses() if scoped else st.builds(Access, SOME)
    # A clear wipes the client's state: rare (it shrinks to an allocation).
    clear = st.integers(0, 11).map(rarely_clear)
    others = (evict, evict, st.builds(Release, SOME), st.builds(Free, SOME), clear)
    op = st.one_of(alloc, alloc, alloc, access, access, access, access, *others)
    batch = st.tuples(st.sampled_from(CLIENTS), st.lists(op, min_size=1, max_size=3).map(tuple))
    return st.lists(batch, min_size=10, max_size=50)


def play_templates(templates: list[Batch], model: Model) -> None:
    h = Harness("lru")
    stream: list[Batch] = []
    for n, (client, batch) in enumerate(templates):
        # From the state before the batch: an id an earlier event of it freed is rejected.
        ops = tuple(resolve(op, model) for op in batch)
        stream.append((client, ops))
        try:
            step(h, model, client, ops, f"batch {n}")
        except AssertionError:
            note(f"the stream: {stream}")
            raise


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(scoped=True))
def test_lru_matches_the_scoped_reference_on_random_streams(templates: list[Batch]) -> None:
    play_templates(templates, ScopedLRU())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(scoped=False))
def test_with_no_scoped_event_lru_is_plain_lru(templates: list[Batch]) -> None:
    play_templates(templates, PlainLRU())


# ---- long seeded streams, shaped like an engine's -----------------------------------------


class StreamGen:
    """Random batches chosen from the core's current state: requests (scopes) that allocate
    chunks at growing token positions, read prefixes with positions (their own, or others:
    ties and out-of-order ones), end; plain reads, releases, frees, clears and eviction
    requests with protected ids. ``valid``: one event per batch, none the core may reject;
    else up to three, some invalid. ``scoped=False``: no scoped field at all."""

    def __init__(self, rng: random.Random, h: Harness, *, valid: bool = False, scoped: bool = True) -> None:
        self.rng = rng
        self.h = h
        self.valid = valid
        self.scoped = scoped
        self.next_id = 0
        self.next_request = 0
        # client -> open request scope -> its next token position
        self.requests: dict[str, dict[str, int]] = {c: {} for c in CLIENTS}
        self.freed: list[str] = []

    def batch(self) -> Batch:
        client = self.rng.choice(CLIENTS)
        n = 1 if self.valid else self.rng.choice((1, 1, 1, 2, 3))
        return client, tuple(self.op(client) for _ in range(n))

    def _new_id(self) -> str:
        if self.freed and self.rng.random() < 0.3:
            block_id = self.freed.pop(self.rng.randrange(len(self.freed)))
            if block_id not in self.h.core.blocks:
                return block_id
        self.next_id += 1
        return f"k{self.next_id}"

    def _request(self, client: str) -> str:
        open_ = self.requests[client]
        if not open_ or self.rng.random() < 0.1:
            self.next_request += 1
            name = f"q{self.next_request}"
            open_[name] = 0
            return name
        return self.rng.choice(sorted(open_))

    def _sample(self, pool: list[str], lo: int, hi: int) -> tuple[str, ...]:
        k = min(len(pool), self.rng.randint(lo, hi))
        return tuple(self.rng.sample(pool, k))

    def op(self, client: str) -> Op:
        rng = self.rng
        blocks = self.h.core.blocks
        known = sorted(blocks)
        resident = sorted(b for b in known if blocks[b].tier == 0)
        if len(resident) > 90:
            return Evict(rng.randint(10, 30), self._sample(known, 0, 3))
        roll = rng.random()
        if not self.scoped and roll < 0.5:
            roll += 0.5  # the scoped kinds below become plain ones
        if roll < 0.22:  # a request stores its next chunk (or takes a known one again)
            name = self._request(client)
            start = self.requests[client][name]
            # Now and then the same position as the previous chunk (a hybrid model's groups).
            self.requests[client][name] = start + rng.choice((16, 16, 16, 0, 1))
            if known and rng.random() < 0.2:
                block_id = rng.choice(known)
                reuse = True if self.valid else rng.random() < 0.8
                return Alloc(block_id, name, start, reuse)
            return Alloc(self._new_id(), name, start)
        if roll < 0.45:  # a request reads blocks at positions
            name = self._request(client) if rng.random() < 0.9 else rng.choice(("x", "q1", "q2"))
            pool = resident if rng.random() < 0.85 else known
            chosen = self._sample(pool, 0 if rng.random() < 0.1 else 1, 6)
            at = [blocks[b].token_start if rng.random() < 0.6 else rng.randint(0, 40) for b in chosen]
            if not self.valid and rng.random() < 0.05:
                at.append(7)  # one position too many: rejected
            ends = ""
            if rng.random() < 0.1:
                ends = name
                self.requests[client].pop(name, None)
            return Access(chosen, name, tuple(at), ends)
        if roll < 0.5:  # a request ends, with or without a last plain read
            open_ = self.requests[client]
            name = rng.choice(sorted(open_)) if open_ else "q0"
            open_.pop(name, None)
            return Access(self._sample(known, 0, 3) if rng.random() < 0.5 else (), ends=name)
        if roll < 0.62:  # a plain read
            if not known:
                return Alloc(self._new_id())
            return Access(self._sample(resident if resident and rng.random() < 0.8 else known, 1, 4))
        if roll < 0.68:  # a plain allocation
            if known and rng.random() < 0.2:
                return Alloc(rng.choice(known), reuse=True)
            return Alloc(self._new_id())
        if roll < 0.73 and known:
            return Release(self._sample(known, 1, 3))
        if roll < 0.79 and known:
            gone = self._sample(known, 1, 3)
            self.freed.extend(gone)
            return Free(gone)
        if roll < 0.795:
            self.requests[client].clear()
            return Clear()
        if not self.valid and roll < 0.83:  # invalid events: nothing may change
            kind = rng.randrange(4)
            if kind == 0:
                return Access(("nope", *self._sample(known, 0, 2)), self._request(client) if self.scoped else "", ())
            if kind == 1 and self.scoped:
                return Access(self._sample(resident, 1, 3), self._request(client), ())  # positions missing
            if kind == 2 and known:
                return Alloc(rng.choice(known), self._request(client) if self.scoped else "", 5)  # maybe a duplicate
            return Evict(len(resident) + rng.randint(1, 3))
        protected = self._sample(known, 0, 4) + (("ghost",) if rng.random() < 0.2 else ())
        available = len(set(resident) - set(protected))
        count = rng.randint(0, min(available, 6)) if self.valid or rng.random() < 0.9 else available + 1
        return Evict(count, protected)


def play_seed(seed: int, steps: int, model: Model, scoped: bool = True) -> None:
    rng = random.Random(seed)
    h = Harness("lru")
    gen = StreamGen(rng, h, scoped=scoped)
    for n in range(steps):
        client, ops = gen.batch()
        step(h, model, client, ops, f"seed {seed} batch {n} {client} {ops}")


@pytest.mark.parametrize("reader", ["native", "reference"])
@pytest.mark.parametrize("seed", [1, 20261126, 4_000_000_007, 99])
def test_long_seeded_streams_match_the_reference(seed: int, reader: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if reader == "reference":
        monkeypatch.setattr(wire, "use_reference", True)
    play_seed(seed, 5_000, ScopedLRU())


def test_a_long_plain_stream_is_plain_lru() -> None:
    play_seed(7, 5_000, PlainLRU(), scoped=False)


# ---- other policies: the scoped fields are accepted and count as plain uses ----------------


def strip(op: Op) -> Op | None:
    """The event without its scoped fields (None: nothing left to send)."""
    if isinstance(op, Alloc):
        return dataclasses.replace(op, scope="")
    if isinstance(op, Access):
        return Access(op.blocks) if op.blocks else None
    return op


@pytest.mark.parametrize("policy", ["fifo", "s3fifo", "sieve", "arc", "lfu", "two_queue", "priority_lru"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_other_policies_accept_scoped_fields_as_plain_uses(policy: str, seed: int) -> None:
    """A valid stream with scoped fields is applied with no rejection; victims are exactly
    ``count`` distinct resident unprotected blocks; and the run equals a twin core's fed the
    same stream with the scoped fields stripped (step by step: directives and order)."""
    rng = random.Random(seed)
    scoped, plain = Harness(policy), Harness(policy)
    gen = StreamGen(rng, scoped, valid=True)
    for n in range(250):
        client, ops = gen.batch()
        where = f"{policy} seed {seed} batch {n} {client} {ops}"
        before = scoped.resident()
        out = scoped.send(client, ops)
        assert out.rejections == [], where
        victims = [d.block_id for d in out.directives]
        assert all(d.kind == DirectiveKind.EVICT for d in out.directives), where
        for op in ops:
            if isinstance(op, Evict):
                assert len(victims) == len(set(victims)) == op.count, where
                assert not set(victims) & set(op.protected), where
                assert set(victims) <= before, where
        stripped = [p for p in map(strip, ops) if p is not None]
        plain.ts = scoped.ts - len(stripped)  # the same event times (one event a batch)
        twin = plain.send(client, stripped) if stripped else None
        if twin is None:  # a scope's first use or end, with no block: nothing for the twin
            assert victims == [], where
        else:
            assert twin.rejections == [], where
            assert [d.block_id for d in twin.directives] == victims, where
        assert scoped.order() == plain.order(), where
        assert scoped.known() == plain.known(), where
        scoped.check_consistent()


# ---- by example ------------------------------------------------------------------------------


def test_scoped_ranks_by_example() -> None:
    """The semantics, step by step (each order is also the reference model's)."""
    h, model = Harness("lru"), ScopedLRU()

    def send(client: str, *ops: Op) -> list[str]:
        step(h, model, client, ops, f"{client} {ops}")
        return h.order()

    # c0's request q stores its head (q takes its rank), then c1 uses x and y.
    assert send("c0", Alloc("h0", "q", 0)) == ["h0"]
    assert send("c1", Alloc("x"), Alloc("y")) == ["h0", "x", "y"]
    # q stores more chunks: they rank with q, below x and y, tails first.
    assert send("c0", Alloc("t1", "q", 16), Alloc("t2", "q", 32)) == ["t2", "t1", "h0", "x", "y"]
    # q reads x: x was used since q began, it stays where it is.
    assert send("c0", Access(("x",), "q", (48,))) == ["t2", "t1", "h0", "x", "y"]
    # q reads t2 nearer the head (raised within q) and t1 nearer the tail (stays).
    assert send("c0", Access(("t2", "t1"), "q", (8, 40))) == ["t1", "t2", "h0", "x", "y"]
    # c1's request of the same name is another scope, ranked now: h0 goes up to it.
    assert send("c1", Access((), "q"), Alloc("z")) == ["t1", "t2", "h0", "x", "y", "z"]
    assert send("c1", Access(("h0",), "q", (0,))) == ["t1", "t2", "x", "y", "h0", "z"]
    # c0 clears: its blocks go and its q ends; c1's q keeps its rank (x joins it, under h0's
    # place: h0 is gone), and c0's q, used again, is ranked anew (above z).
    assert send("c0", Clear()) == ["x", "y", "z"]
    assert send("c1", Access(("x",), "q", (1,))) == ["y", "x", "z"]
    assert send("c0", Access(("y",), "q", (0,))) == ["x", "z", "y"]
    # c1's q ends (no block named); used again it ranks anew, above y.
    assert send("c1", Access((), ends="q"), Access(("x",), "q", (3,))) == ["z", "y", "x"]
    # Two victims, z protected; then two asked with one left: rejected, nothing changes.
    out = h.send("c1", [Evict(2, ("z",))])
    assert [d.block_id for d in out.directives] == ["y", "x"] and out.rejections == []
    out = h.send("c1", [Evict(2)])
    assert out.directives == [] and [r.field for r in out.rejections] == ["eviction_requested.count"]
    assert h.order() == ["z"] and h.known() == {"x", "y", "z"}


# ---- validation ----------------------------------------------------------------------------


def test_token_positions_and_empty_block_ids_are_validated_and_rejections_change_nothing() -> None:
    h = Harness("lru")
    assert h.send("c0", [Alloc("a"), Alloc("b"), Alloc("c")]).rejections == []
    cases: list[tuple[Access, str]] = [
        (Access(("a", "b"), "r", (1,)), "accessed.token_positions"),  # too few
        (Access(("a",), "r", (1, 2)), "accessed.token_positions"),  # too many
        (Access((), "r", (3,)), "accessed.token_positions"),  # positions for no block
        (Access(("a",), "", (1,), ends="r"), "accessed.token_positions"),  # without a scope
        (Access(("a", "zz"), "r", (1, 2)), "accessed.block_ids[1]"),  # unknown id: checked first
        (Access((), "", (), ends=""), "accessed.block_ids"),  # neither scope nor ends_scope
    ]
    for access, field in cases:
        out = h.send("c0", [access])
        assert [r.field for r in out.rejections] == [field], access
        assert h.order() == ["a", "b", "c"], f"{access} changed the order"
    # None of the rejected events opened scope r: it takes its rank now, above d.
    assert h.send("c0", [Alloc("d")]).rejections == []
    assert h.send("c0", [Access(("a",), "r", (0,))]).rejections == []
    assert h.order() == ["b", "c", "d", "a"]
    # Empty block_ids are accepted with a scope (it takes its rank) or an ends_scope.
    out = h.send("c0", [Access((), "s"), Alloc("e"), Access(("b",), "s", (9,)), Access((), ends="s")])
    assert out.rejections == []
    # s ranked when it was opened, below e: b goes there.
    assert h.order() == ["c", "d", "a", "b", "e"]
    # s ended: its next use takes a new rank, above e.
    assert h.send("c0", [Access(("c",), "s", (0,))]).rejections == []
    assert h.order() == ["d", "a", "b", "e", "c"]
    # A rejected ends_scope (an unknown id) does not end the scope: r keeps its rank, so d
    # joins a there (same position: by id), not the newest end.
    out = h.send("c0", [Access(("zz",), ends="r"), Access(("d",), "r", (0,))])
    assert [r.field for r in out.rejections] == ["accessed.block_ids[0]"]
    assert h.order() == ["a", "d", "b", "e", "c"]


def test_token_positions_without_any_scope_are_rejected() -> None:
    h = Harness("lru")
    h.send("c0", [Alloc("a"), Alloc("b")])
    out = h.send("c0", [Access(("a",), "", (1,))])
    assert [r.field for r in out.rejections] == ["accessed.token_positions"]
    assert h.order() == ["a", "b"]


def test_past_the_cap_of_open_scopes_the_oldest_ends() -> None:
    """A client that never ends its scopes cannot grow the order without bound: past
    MAX_OPEN_SCOPES open scopes, the oldest ends (its blocks keep their place, and its next
    scoped use takes a new rank: the newest)."""
    from broker.model.core import MAX_OPEN_SCOPES

    h = Harness("lru")
    h.send("c0", [Alloc("a", "first", 5), Alloc("b")])
    assert h.order() == ["a", "b"]  # a ranks with "first", older than b
    for n in range(MAX_OPEN_SCOPES):  # "first" plus these: one more than the cap
        h.core.open_scope(("c0", f"r{n}"))
    assert len(h.core.scopes) == MAX_OPEN_SCOPES
    assert ("c0", "first") not in h.core.scopes
    h.send("c0", [Alloc("c", "first", 9)])  # "first" again: a new rank, above b
    assert h.order() == ["a", "b", "c"]


def test_scopes_rank_in_any_tier_as_in_the_top_one() -> None:
    """A broker deciding for several vLLM ranks keeps each rank's chunks in a tier of its
    own (sidecar mode: allowed_tiers = [cpuN]). The core opens a scope for every tier's
    policy, so the smallest case (a running request stores k after another request
    touched b) ranks alike in the second tier: k, then a, then b."""
    from broker.config import parse_config

    tiers = "".join(f'[[tiers]]\nname = "cpu{r}"\ncapacity = 8\nhigh_watermark = 1.0\nlow_watermark = 1.0\n' for r in (0, 1))
    core = Core(parse_config(f'[policy]\nname = "lru"\n{tiers}').core)

    def alloc(block_id: str, scope: str = "", start: int = 0) -> pb.Event:
        intent = pb.MemoryIntent(block_id=block_id, size_bytes=1, token_start=start, allowed_tiers=["cpu1"])
        return pb.Event(allocated=pb.BlockAllocated(intent=intent, tier="cpu1", scope=scope))

    def access(*ids: str, scope: str = "", at: Sequence[int] = ()) -> pb.Event:
        return pb.Event(accessed=pb.BlocksAccessed(block_ids=ids, scope=scope, token_positions=at))

    batches = [
        [alloc("a"), alloc("b")],
        [access("a", scope="A", at=[16])],
        [access("b")],
        [alloc("k", scope="A", start=32)],
    ]
    for seq, events in enumerate(batches, 1):
        for ts, event in enumerate(events, 1):
            event.ts_us = seq * 10 + ts
        out = apply_batch(core, pb.IntentBatch(client_id="rank1", batch_seq=seq, events=events).SerializeToString())
        assert out.rejections == []
    policy = core.tiers[1].policy
    assert [b.block_id for b in policy.choose_victims(3, frozenset()) or []] == ["k", "a", "b"]
    ask = pb.Event(ts_us=99, eviction_requested=pb.EvictionRequested(tier="cpu1", count=1))
    out = apply_batch(core, pb.IntentBatch(client_id="rank1", batch_seq=5, events=[ask]).SerializeToString())
    assert [d.block_id for d in out.directives if d.kind == DirectiveKind.EVICT] == ["k"]
