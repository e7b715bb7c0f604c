"""vLLM KV-cache events: the wire format, block ids, the mapping to broker events, captures.

Shared by the live bridge (``clients.vllm_bridge``) and the capture importer
(``broker.replay.traces.vllm``), so a capture replays into exactly the events the bridge sent.
Nothing here does network I/O.

**Wire format** (vllm/distributed/kv_events.py). A batch is three frames on the PUB socket,
``[topic, seq, payload]``; ``seq`` is 8-byte big-endian, +1 per batch, back to 0 when the
engine restarts. ``payload`` is msgpack of a KVEventBatch: ``[ts, events, dp_rank]`` (or a
map with those keys). An event is either a positional array whose first element is its type
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]``,
``["BlockRemoved", block_hashes, medium, group_idx]``, ``["AllBlocksCleared"]``; trailing
defaults may be missing) or a map with ``"type"`` and the same field names. Unknown event
types and unknown keys are skipped and counted, never fatal.

**Block ids.** A hash is bytes (e.g. a 32-byte SHA-256) or an int that may be negative or
exceed 2^63. Its key is ``0x`` + lowercase hex for bytes, the decimal digits for an int (a
str hash is used as it is); the two never collide (decimal has no ``x``). The id is the key
prefixed by, in this order: the bridge's namespace (``dp<rank>/`` when a bridge serves
several data-parallel ranks: the broker keys blocks globally, and two ranks cache the same
prefix in different GPUs), ``lora:<lora_name>/`` (or ``lora#<lora_id>/`` when only the id is
known), and ``g<group_idx>/`` for a KV-cache group other than 0 (hybrid models cache one
block per group under the same hash). Examples: ``0x9f86d0…``, ``18446744073709551557``,
``dp1/lora:sql/g1/-42``. The medium is not part of the id: a block is one broker block that
lives in the highest tier holding a copy of it.

**Mapping** (``EngineTranslator``, one per engine, i.e. per data-parallel rank):

- BlockStored: each hash, in chain order, becomes ``allocated`` in the medium's tier, sized
  by ``clients.kvsize`` for the model and the event's ``block_size``; the previous block of
  the chain (``parent_block_hash`` for the first) is ``parent_block_id``. A copy stored in a
  lower medium than one already holding the block sends nothing; a copy in a higher one
  moves the block up (``freed`` then ``allocated``).
- BlockRemoved: ``freed`` when no medium holds the block any more; when only a lower one
  does, the block moves down there (``freed`` then ``allocated``). Removing a block the
  bridge never saw stored (it joined late, or a loss could not be replayed) is skipped.
- AllBlocksCleared, and an engine restart (its seq goes backwards): ``cleared`` (the broker
  drops every block of that engine's client id).

Media map to tiers by an ordered table, top tier first: ``GPU=hbm,CPU=dram`` by default; an
event without a medium is the GPU prefix cache. A medium the table lacks maps to the ``*``
entry if there is one, else the event is skipped and counted.

**Capture file** (``kvbroker vllm-bridge --capture PATH``, read by ``kvbroker replay
--format vllm-events``): msgpack objects written back to back, no other framing (msgpack is
self-delimiting). The first is a header map ``{"format": "kvbroker-vllm-events", "version":
1, "created": <unix s>, "model": str, "tier_map": [[medium, tier], ...], "client_id":
prefix, "dp_size": n, "topic": str}``. Each later one is a record ``[rank, seq, ts,
payload]``: the data-parallel rank, the engine's seq, the bridge's receive time (unix
seconds, float) and the KVEventBatch payload exactly as received. Records are in the order
the bridge applied them (replayed batches in their place, duplicates never), so per rank
the seq rises by one, except across an engine restart (it goes back) or a loss the replay
socket could not fill (it jumps). A torn last record (the bridge was killed mid-write) is
detected and ignored.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import IO, Any

import msgpack

from clients import kvsize
from kvbroker.v1 import intent_pb2 as pb

log = logging.getLogger("kvbroker.vllm_events")

BlockHash = bytes | int | str

DEFAULT_BLOCK_SIZE = 16
# Tokens per block: MemoryIntent.token_count is a uint32.
MAX_BLOCK_SIZE = 2**32 - 1
# Event times (µs) stay inside int64: later than this many seconds is not a timestamp.
MAX_TS_S = 2**62 / 1e6
SEQ_BYTES = 8
END_OF_REPLAY = -1
CAPTURE_FORMAT = "kvbroker-vllm-events"
CAPTURE_VERSION = 1
DEFAULT_TIER_MAP: tuple[tuple[str, str], ...] = (("GPU", "hbm"), ("CPU", "dram"))

# Positional fields of the array encoding, after the type name.
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class DecodeError(ValueError):
    """A frame or payload is not what the vLLM format says."""


# ---- decoded events --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    token_count: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    # Not on the wire: BlockRemoved carries no adapter; ids of adapter blocks are resolved
    # through the translator's memory of what it stored (see EngineTranslator).
    lora_id: int | None = None
    lora_name: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclasses.dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float | None
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    # Events of an unknown type, and events of a known type that could not be read.
    unknown: int = 0
    malformed: int = 0
    problems: tuple[str, ...] = ()


# ---- frames ----------------------------------------------------------------------------------


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=seq < 0)


def decode_seq(frame: bytes) -> int:
    """A seq frame: 8-byte big-endian unsigned, except the replay end marker -1."""
    if len(frame) != SEQ_BYTES:
        raise DecodeError(f"seq frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    if frame == b"\xff" * SEQ_BYTES:
        return END_OF_REPLAY
    return int.from_bytes(frame, "big")


def split_live(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of a PUB message ``[topic, seq, payload]``."""
    if len(frames) == 3:
        return frames[0], decode_seq(frames[1]), frames[2]
    if len(frames) == 2:  # a publisher without a topic frame
        return b"", decode_seq(frames[0]), frames[1]
    raise DecodeError(f"expected [topic, seq, payload], got {len(frames)} frames")


def split_replay(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of a reply on the DEALER socket; seq END_OF_REPLAY ends the replay.

    The ROUTER's empty delimiter frame comes first; then ``[seq, payload]`` (older releases)
    or ``[topic, seq, payload]`` (newer ones). Some releases end with a bare empty frame.
    """
    rest = list(frames)
    if rest and rest[0] == b"":
        rest = rest[1:]
    if len(rest) < 2:
        if all(f == b"" for f in rest):
            return END_OF_REPLAY, b""
        raise DecodeError(f"replay reply of {len(frames)} frames")
    if len(rest) > 3:
        raise DecodeError(f"replay reply of {len(frames)} frames")
    return decode_seq(rest[-2]), rest[-1]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to vLLM's ROUTER: the empty delimiter, then the first wanted seq."""
    return [b"", encode_seq(start_seq)]


# ---- payload ---------------------------------------------------------------------------------


def _text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _opt_int(fields: Mapping[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"{name}: expected an integer or nil, got {value!r}")
    return value


def _opt_str(fields: Mapping[str, Any], name: str) -> str | None:
    value = _text(fields.get(name))
    if value is None:
        return None
    if not isinstance(value, str):
        raise DecodeError(f"{name}: expected a string or nil, got {value!r}")
    return value


def _hash(value: Any, name: str) -> BlockHash:
    if isinstance(value, bool) or not isinstance(value, (bytes, int, str)):
        raise DecodeError(f"{name}: a hash must be bytes or an integer, got {type(value).__name__}")
    return value


def _hashes(fields: Mapping[str, Any]) -> tuple[BlockHash, ...]:
    value = fields.get("block_hashes")
    if not isinstance(value, (list, tuple)):
        raise DecodeError(f"block_hashes: expected a list, got {value!r}")
    return tuple(_hash(h, f"block_hashes[{i}]") for i, h in enumerate(value))


def _fields(raw: Any, names: tuple[str, ...]) -> tuple[str | None, dict[str, Any]]:
    """(type name, fields) of an event in either encoding."""
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise DecodeError("empty event array")
        # Extra trailing fields (a newer vLLM) are unknown and skipped.
        return _text(raw[0]), dict(zip(names, raw[1:], strict=False))
    if isinstance(raw, dict):
        fields = {_text(k): v for k, v in raw.items()}
        return _text(fields.get("type")), fields
    raise DecodeError(f"an event must be an array or a map, got {type(raw).__name__}")


def decode_event(raw: Any) -> KVEvent | None:
    """One event; None for an unknown type. Raises DecodeError for a malformed known one."""
    if isinstance(raw, (list, tuple)) and raw:
        kind = _text(raw[0])
    elif isinstance(raw, dict):
        kind = _text(raw.get("type", raw.get(b"type")))
    else:
        raise DecodeError(f"an event must be an array or a map, got {type(raw).__name__}")
    if kind == "BlockStored":
        _, f = _fields(raw, STORED_FIELDS)
        block_size = _opt_int(f, "block_size")
        if block_size is not None and not 0 < block_size <= MAX_BLOCK_SIZE:
            raise DecodeError(f"block_size: must be in 1..{MAX_BLOCK_SIZE}, got {block_size}")
        parent = f.get("parent_block_hash")
        tokens = f.get("token_ids")
        return BlockStored(
            block_hashes=_hashes(f),
            parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
            block_size=DEFAULT_BLOCK_SIZE if block_size is None else block_size,
            token_count=len(tokens) if isinstance(tokens, (list, tuple)) else 0,
            lora_id=_opt_int(f, "lora_id"),
            medium=_opt_str(f, "medium"),
            lora_name=_opt_str(f, "lora_name"),
            group_idx=_opt_int(f, "group_idx"),
        )
    if kind == "BlockRemoved":
        _, f = _fields(raw, REMOVED_FIELDS)
        return BlockRemoved(block_hashes=_hashes(f), medium=_opt_str(f, "medium"), group_idx=_opt_int(f, "group_idx"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """A KVEventBatch; raises DecodeError if the batch itself is unreadable (bad events are counted)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, unicode_errors="replace")
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise DecodeError(f"payload is not msgpack: {exc}") from exc
    if isinstance(obj, (list, tuple)):
        if len(obj) < 2:
            raise DecodeError(f"a batch array needs [ts, events], got {len(obj)} elements")
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    else:
        raise DecodeError(f"a batch must be an array or a map, got {type(obj).__name__}")
    if not isinstance(events, (list, tuple)):
        raise DecodeError(f"events: expected a list, got {type(events).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        ts = None
    if isinstance(rank, bool) or not isinstance(rank, int):
        rank = None
    out: list[KVEvent] = []
    unknown = malformed = 0
    problems: list[str] = []
    for i, raw in enumerate(events):
        try:
            event = decode_event(raw)
        except DecodeError as exc:
            malformed += 1
            problems.append(f"events[{i}]: {exc}")
            continue
        if event is None:
            unknown += 1
        else:
            out.append(event)
    return EventBatch(None if ts is None else float(ts), tuple(out), rank, unknown, malformed, tuple(problems))


# ---- block ids -------------------------------------------------------------------------------


def hash_key(value: BlockHash) -> str:
    """``0x`` + hex for bytes, decimal for an int (any size, any sign), a str as it is."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "0x" + bytes(value).hex()
    if isinstance(value, bool):
        raise TypeError("a block hash cannot be a bool")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value
    raise TypeError(f"a block hash must be bytes, int or str, got {type(value).__name__}")


def identity_prefix(*, namespace: str = "", lora_name: str | None = None, lora_id: int | None = None, group_idx: int | None = None) -> str:
    """What comes before the hash key in a block id (see the module docstring)."""
    prefix = namespace
    if lora_name:
        prefix += f"lora:{lora_name}/"
    elif lora_id is not None:
        prefix += f"lora#{lora_id}/"
    if group_idx:
        prefix += f"g{group_idx}/"
    return prefix


def block_id(
    value: BlockHash, *, namespace: str = "", lora_name: str | None = None, lora_id: int | None = None, group_idx: int | None = None
) -> str:
    """The broker block id of a vLLM block hash: stable across processes and restarts."""
    return identity_prefix(namespace=namespace, lora_name=lora_name, lora_id=lora_id, group_idx=group_idx) + hash_key(value)


def rank_namespace(rank: int, dp_size: int) -> str:
    """``dp<rank>/`` when several ranks share one broker, else nothing."""
    return f"dp{rank}/" if dp_size > 1 else ""


# ---- tiers -----------------------------------------------------------------------------------


def parse_tier_map(text: str) -> tuple[tuple[str, str], ...]:
    """``GPU=hbm,CPU=dram`` (top tier first) -> ((GPU, hbm), (CPU, dram)); ``*`` matches any other medium."""
    pairs: list[tuple[str, str]] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        medium, sep, tier = item.partition("=")
        medium, tier = medium.strip().upper(), tier.strip()
        if not sep or not medium or not tier:
            raise ValueError(f"tier map entry {item!r}: expected MEDIUM=TIER (e.g. GPU=hbm)")
        if medium in (m for m, _ in pairs):
            raise ValueError(f"tier map: medium {medium!r} given twice")
        pairs.append((medium, tier))
    if not pairs:
        raise ValueError("tier map is empty: give at least GPU=<top tier>")
    return tuple(pairs)


def format_tier_map(pairs: Iterable[tuple[str, str]]) -> str:
    return ",".join(f"{m}={t}" for m, t in pairs)


# ---- mapping to broker events ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MappingOptions:
    """How one engine's events become broker events."""

    model: str = "llama-3-8b"
    # KV-cache scalar type (clients.kvsize.DTYPE_BYTES key).
    dtype: str = "fp16"
    # Bytes of one block, overriding the model's figure (all block sizes alike).
    block_bytes: int | None = None
    tier_map: tuple[tuple[str, str], ...] = DEFAULT_TIER_MAP
    namespace: str = ""
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in kvsize.DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(kvsize.DTYPE_BYTES)}, got {self.dtype!r}")
        if self.block_bytes is not None and self.block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {self.block_bytes}")
        if not self.tier_map:
            raise ValueError("tier_map is empty")


def resolve_model(model: str) -> kvsize.ModelShape:
    """A known model name or a config.json path (as ``kvbroker size`` takes it)."""
    return kvsize.resolve_shape(model)


@dataclasses.dataclass
class TranslatorStats:
    batches: int = 0
    events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    restarts: int = 0
    # Blocks that changed tier because a copy in another medium appeared or went.
    moves: int = 0
    # BlockStored of a block already held in that medium; BlockRemoved of one never stored there.
    duplicate_stored: int = 0
    unknown_removed: int = 0
    unknown_medium: int = 0
    unknown_events: int = 0
    malformed_events: int = 0
    bad_batches: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class _Held:
    """What the translator knows of a block it told the broker about."""

    __slots__ = ("mask", "parent", "size", "tokens")

    def __init__(self, mask: int, size: int, parent: str, tokens: int) -> None:
        self.mask = mask  # bit r: tier rank r (0 = top) holds a copy
        self.size = size
        self.parent = parent
        self.tokens = tokens


def _top(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class EngineTranslator:
    """One engine's (one data-parallel rank's) vLLM events as broker events.

    Keeps, per block it has told the broker about, which media hold a copy (a bit per tier),
    its size and parent, so removals free exactly what was allocated and a block moves when
    its best copy goes. Deterministic: the same batches give the same events.
    """

    def __init__(self, options: MappingOptions, shape: kvsize.ModelShape | None = None) -> None:
        self.options = options
        self.shape = shape if shape is not None or options.block_bytes is not None else resolve_model(options.model)
        self.held: dict[str, _Held] = {}
        self.stats = TranslatorStats()
        tiers: list[str] = []
        self._medium_rank: dict[str, int] = {}
        for medium, tier in options.tier_map:
            if tier not in tiers:
                tiers.append(tier)
            self._medium_rank[medium.upper()] = tiers.index(tier)
        self.tiers = tuple(tiers)
        self._gpu = options.tier_map[0][0].upper()
        self._sizes: dict[int, int] = {}
        # Adapter identity of stored hashes, so a BlockRemoved (which names no adapter)
        # finds the block: key without adapter -> id with it.
        self._adapter_ids: dict[str, str] = {}

    # ---- sizes and tiers -----------------------------------------------------------------

    def block_bytes(self, block_size: int) -> int:
        if self.options.block_bytes is not None:
            return self.options.block_bytes
        size = self._sizes.get(block_size)
        if size is None:
            assert self.shape is not None
            size = kvsize.bytes_per_block(self.shape, block_size, kvsize.DTYPE_BYTES[self.options.dtype])
            self._sizes[block_size] = size
        return size

    def medium_rank(self, medium: str | None) -> int | None:
        key = self._gpu if medium is None else medium.upper()
        rank = self._medium_rank.get(key)
        if rank is None:
            rank = self._medium_rank.get("*")
        return rank

    def tier_of(self, block_id_: str) -> str | None:
        """The tier the engine really holds a block in (its best copy), or None."""
        held = self.held.get(block_id_)
        return None if held is None else self.tiers[_top(held.mask)]

    # ---- events --------------------------------------------------------------------------

    def _id(self, value: BlockHash, lora_name: str | None, lora_id: int | None, group_idx: int | None) -> str:
        return block_id(value, namespace=self.options.namespace, lora_name=lora_name, lora_id=lora_id, group_idx=group_idx)

    def _allocated(self, ts_us: int, bid: str, held: _Held, rank: int) -> pb.Event:
        intent = pb.MemoryIntent(
            block_id=bid,
            size_bytes=held.size,
            parent_block_id=held.parent,
            token_count=held.tokens,
            tenant=self.options.tenant,
            # A prefix-cache block can always be recomputed from its tokens.
            recompute_ok=True,
        )
        return pb.Event(ts_us=ts_us, allocated=pb.BlockAllocated(intent=intent, tier=self.tiers[rank]))

    @staticmethod
    def _freed(ts_us: int, bid: str) -> pb.Event:
        return pb.Event(ts_us=ts_us, freed=pb.BlocksFreed(block_ids=[bid]))

    def clear(self, ts_us: int) -> list[pb.Event]:
        """The engine dropped everything (AllBlocksCleared or a restart)."""
        self.held.clear()
        self._adapter_ids.clear()
        self.stats.clears += 1
        return [pb.Event(ts_us=ts_us, cleared=pb.AllBlocksCleared())]

    def restart(self, ts_us: int) -> list[pb.Event]:
        self.stats.restarts += 1
        return self.clear(ts_us)

    def translate(self, batch: EventBatch, ts_us: int) -> list[pb.Event]:
        """The broker events of one batch, in order."""
        stats = self.stats
        stats.batches += 1
        stats.unknown_events += batch.unknown
        stats.malformed_events += batch.malformed
        out: list[pb.Event] = []
        for event in batch.events:
            stats.events += 1
            if isinstance(event, BlockStored):
                self._stored(event, ts_us, out)
            elif isinstance(event, BlockRemoved):
                self._removed(event, ts_us, out)
            else:
                out.extend(self.clear(ts_us))
        return out

    def _stored(self, event: BlockStored, ts_us: int, out: list[pb.Event]) -> None:
        rank = self.medium_rank(event.medium)
        if rank is None:
            self.stats.unknown_medium += 1
            return
        bit = 1 << rank
        size = self.block_bytes(event.block_size)
        adapter = bool(event.lora_name) or event.lora_id is not None
        parent = (
            "" if event.parent_block_hash is None else self._id(event.parent_block_hash, event.lora_name, event.lora_id, event.group_idx)
        )
        for value in event.block_hashes:
            bid = self._id(value, event.lora_name, event.lora_id, event.group_idx)
            self.stats.stored_blocks += 1
            if adapter:
                self._adapter_ids[self._id(value, None, None, event.group_idx)] = bid
            held = self.held.get(bid)
            if held is None:
                held = _Held(bit, size, parent, event.block_size)
                self.held[bid] = held
                out.append(self._allocated(ts_us, bid, held, rank))
            elif held.mask & bit:
                self.stats.duplicate_stored += 1
            else:
                before = _top(held.mask)
                held.mask |= bit
                if rank < before:  # a copy in a higher tier: the block moves up
                    self.stats.moves += 1
                    out.append(self._freed(ts_us, bid))
                    out.append(self._allocated(ts_us, bid, held, rank))
            parent = bid

    def _removed(self, event: BlockRemoved, ts_us: int, out: list[pb.Event]) -> None:
        rank = self.medium_rank(event.medium)
        if rank is None:
            self.stats.unknown_medium += 1
            return
        bit = 1 << rank
        for value in event.block_hashes:
            bid = self._id(value, event.lora_name, event.lora_id, event.group_idx)
            held = self.held.get(bid)
            if held is None:
                # BlockRemoved names no adapter: an adapter block is found by its plain key.
                bid = self._adapter_ids.get(bid, bid)
                held = self.held.get(bid)
            self.stats.removed_blocks += 1
            if held is None or not held.mask & bit:
                self.stats.unknown_removed += 1
                continue
            before = _top(held.mask)
            held.mask &= ~bit
            if not held.mask:
                del self.held[bid]
                out.append(self._freed(ts_us, bid))
            elif rank == before:  # the best copy went: the block moves down
                self.stats.moves += 1
                out.append(self._freed(ts_us, bid))
                out.append(self._allocated(ts_us, bid, held, _top(held.mask)))
        if len(self._adapter_ids) > 2 * len(self.held) + 1024:
            self._adapter_ids = {k: v for k, v in self._adapter_ids.items() if v in self.held}


def ts_to_us(ts: float | None, fallback_s: float) -> int:
    """Event time in microseconds: the batch's ts (unix seconds) if it is one (finite, in
    0..MAX_TS_S), else the fallback, else 0."""
    seconds = ts if ts is not None and 0 <= ts <= MAX_TS_S else fallback_s
    if not 0 <= seconds <= MAX_TS_S:  # NaN too
        return 0
    return int(seconds * 1_000_000)


# ---- sequence numbers ------------------------------------------------------------------------


class SeqTracker:
    """One engine's seq: in order, a gap to fill, a duplicate, or a restart.

    ``last`` is the last seq applied (-1 before the first; a restart sets it back to -1 so
    the engine's new seq 0 is next). After a gap was filled from the replay socket, live
    batches it already covered (``dup_from`` .. ``dup_upto``) are duplicates, not a restart.
    """

    NEXT = "next"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"

    def __init__(self) -> None:
        self.last = -1
        self.started = False
        self.dup_from = 0
        self.dup_upto = -1

    def classify(self, seq: int) -> str:
        if seq == self.last + 1:
            return self.NEXT
        if seq > self.last + 1:
            return self.GAP
        if self.dup_from <= seq <= self.dup_upto:
            return self.DUPLICATE
        return self.RESTART

    def applied(self, seq: int) -> None:
        self.last = seq
        self.started = True
        if seq > self.dup_upto:
            self.dup_upto = -1

    def filled(self, start: int) -> None:
        """A replay from ``start`` was applied up to ``last``."""
        self.dup_from, self.dup_upto = start, self.last

    def restarted(self) -> None:
        self.last = -1
        self.dup_from, self.dup_upto = 0, -1


# ---- capture files ---------------------------------------------------------------------------


class CaptureWriter:
    """Appends capture records (see the module docstring); flushes at most every ``flush_s``."""

    def __init__(self, path: str, header: Mapping[str, Any], *, flush_s: float = 1.0) -> None:
        self.path = path
        self.records = 0
        self._file: IO[bytes] = open(path, "wb")  # noqa: SIM115 - a long-lived writer, closed by close()
        self._packer = msgpack.Packer(use_bin_type=True)
        self._flush_s = flush_s
        self._flushed_at = time.monotonic()
        head = {"format": CAPTURE_FORMAT, "version": CAPTURE_VERSION, "created": time.time(), **header}
        self._file.write(self._packer.pack(head))
        self._file.flush()

    def write(self, rank: int, seq: int, ts: float, payload: bytes) -> None:
        self._file.write(self._packer.pack([rank, seq, ts, payload]))
        self.records += 1
        now = time.monotonic()
        if now - self._flushed_at >= self._flush_s:
            self._file.flush()
            self._flushed_at = now

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()


@dataclasses.dataclass(frozen=True, slots=True)
class CaptureRecord:
    index: int
    rank: int
    seq: int
    ts: float
    payload: bytes


class CaptureError(ValueError):
    def __init__(self, path: str, index: int, reason: str) -> None:
        super().__init__(f"{path}: record {index}: {reason}")
        self.path = path
        self.index = index
        self.reason = reason


def read_capture(path: str) -> tuple[dict[str, Any], Iterator[CaptureRecord | CaptureError]]:
    """(header, records): a bad record is yielded as a CaptureError for the caller to raise or
    count; a torn tail ends the records (logged). Raises CaptureError if the header is bad."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - handed to the generator, which closes it
    except OSError as exc:
        raise CaptureError(path, 0, exc.strerror or str(exc)) from exc
    unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False, max_buffer_size=256 * 2**20)
    try:
        header = next(unpacker)
    except StopIteration:
        f.close()
        raise CaptureError(path, 0, "empty file, not a vllm-events capture") from None
    except Exception as exc:
        f.close()
        raise CaptureError(path, 0, f"not a vllm-events capture: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != CAPTURE_FORMAT:
        f.close()
        raise CaptureError(path, 0, f"not a vllm-events capture (header {str(header)[:80]!r})")
    if header.get("version") != CAPTURE_VERSION:
        f.close()
        raise CaptureError(path, 0, f"capture version {header.get('version')!r} is not supported (this reader: {CAPTURE_VERSION})")

    def records() -> Iterator[CaptureRecord | CaptureError]:
        index = 0
        with f:
            while True:
                index += 1
                try:
                    obj = next(unpacker)
                except StopIteration:
                    if unpacker.tell() < f.seek(0, 2):
                        log.warning("%s: torn record %d at the end of the capture ignored", path, index)
                    return
                except Exception as exc:  # corrupt bytes: nothing after them can be trusted
                    yield CaptureError(path, index, f"unreadable: {exc}")
                    return
                ok = (
                    isinstance(obj, (list, tuple))
                    and len(obj) >= 4
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in obj[:2])
                    and isinstance(obj[2], (int, float))
                    and isinstance(obj[3], bytes)
                )
                if not ok:
                    yield CaptureError(path, index, f"expected [rank, seq, ts, payload], got {str(obj)[:80]}")
                    continue
                yield CaptureRecord(index, obj[0], obj[1], float(obj[2]), obj[3])

    return header, records()
