"""vLLM KV-cache events: the wire format, block ids, the seq tracker, captures.

Shared by the live bridge (``vllm_integration.events_from_vllm.bridge``) and the capture importer
(``vllm_integration.trace_import``); the mapping to broker events is ``vllm_integration.events_from_vllm.to_intents``.
Nothing here does network I/O. Checked against vLLM 0.33.0 (vllm/distributed/kv_events.py).

**Frames.** A batch is three frames on the PUB socket, ``[topic, seq, payload]``; ``seq`` is
8-byte big-endian, from 0 per publisher (so back to 0 when the engine restarts), +1 per
batch. The replay ROUTER takes ``[b"", start_seq]`` from a DEALER and answers ``[b"", topic,
seq, payload]`` for every buffered batch from ``start_seq`` on (10,000 batches by default),
then ``[b"", b"", -1, b""]``.

**Payload.** msgpack of a KVEventBatch, a positional array ``[ts, events,
data_parallel_rank]`` (a map with those keys is accepted too). vLLM 0.33 writes each event as
a map: ``"type"`` first, then the fields in declaration order, fields with a default left out
when they hold it:

- BlockStored: ``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name`` (always present, nil allowed), then ``extra_keys, group_idx,
  kv_cache_spec_kind, kv_cache_spec_sliding_window, locality, ownership, session_id,
  lookahead_token_ids`` (when set). ``block_size`` 0 is an offloaded copy (CPU/STORAGE) that
  names no size: vLLM's offloading connector announces a chunk by its last hash alone.
- BlockRemoved: ``block_hashes, medium``, then ``group_idx, locality, ownership``.
- AllBlocksCleared: no field.

Older releases wrote events as positional arrays whose first element is the type
(``["BlockStored", block_hashes, ...]`` in the order above, trailing defaults missing); both
decode alike. Unknown event types and unknown keys are skipped and counted per name (a newer
vLLM), never fatal; a malformed known event is skipped and counted.

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

**Capture file** (``kvbroker vllm-bridge --capture PATH``, read by ``kvbroker replay
--format vllm-events``): msgpack objects written back to back, no other framing (msgpack is
self-delimiting). The first is a header map ``{"format": "kvbroker-vllm-events", "version":
1, "created": <unix s>, "model": str, "tier_map": [[medium, tier], ...], "client_id":
prefix, "dp_size": n, "topic": str, ...}`` (the bridge's mapping options: see
``vllm_integration.events_from_vllm.bridge``). Each later one is a record ``[rank, seq, ts, payload]``: the
data-parallel rank, the engine's seq, the bridge's receive time (unix seconds, float) and the
KVEventBatch payload exactly as received. Records are in the order the bridge applied them
(replayed batches in their place, duplicates never), so per rank the seq rises by one, except
across an engine restart or a loss the replay socket could not fill (it jumps). A restart the
bridge detected is written as a record ``[rank, -1, ts, b""]`` before the new engine's first
batch (older captures have none: there the seq going back is the restart). A torn last
record (the bridge was killed mid-write) is detected and ignored.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

import msgpack

from clients.regular_file import open_regular

log = logging.getLogger("kvbroker.vllm_events")

BlockHash = bytes | int | str

DEFAULT_BLOCK_SIZE = 16
# Tokens per block: MemoryIntent.token_count is a uint32.
MAX_BLOCK_SIZE = 2**32 - 1
# Event times (µs) stay inside int64: later than this many seconds is not a timestamp.
MAX_TS_S = 2**62 / 1e6
SEQ_BYTES = 8
END_OF_REPLAY = -1
# The seq of a capture record that says "the engine restarted here" (payload b"").
RESTART_RECORD_SEQ = -1
CAPTURE_FORMAT = "kvbroker-vllm-events"
CAPTURE_VERSION = 1

# The fields of each event type in vLLM 0.33's declaration order (the positional encoding's
# order, after the type name).
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
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
CLEARED_FIELDS: tuple[str, ...] = ()
BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
_FIELDS = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS, "AllBlocksCleared": CLEARED_FIELDS}


class DecodeError(ValueError):
    """A frame or payload is not what the vLLM format says."""


# ---- decoded events --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None = None
    # Tokens per block; 0: an offloaded copy that names no size (see the module docstring).
    block_size: int = DEFAULT_BLOCK_SIZE
    token_count: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    # The group's attention kind ("full_attention", "sliding_window", ...) and window.
    kv_cache_spec_kind: str | None = None
    sliding_window: int | None = None
    # "LOCAL" or "REMOTE" relative to the engine; the secondary tier that made the copy.
    locality: str | None = None
    ownership: str | None = None
    # The request context (session) that stored or reused the blocks.
    session_id: str | None = None
    # Per block of block_hashes: the tokens past it that its hash covers (lookahead hashing
    # for speculative decoding); None when lookahead hashing is off.
    lookahead_tokens: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    # Not on the wire: BlockRemoved carries no adapter; ids of adapter blocks are resolved
    # through the translator's memory of what it stored (see EngineTranslator).
    lora_id: int | None = None
    lora_name: str | None = None
    locality: str | None = None
    ownership: str | None = None


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
    # Per name: keys this decoder does not know ("BlockStored.<key>", "batch.<key>"; a
    # positional field past the known ones is "BlockStored[<index>]"), and event types.
    unknown_keys: Mapping[str, int] = dataclasses.field(default_factory=dict)
    unknown_types: Mapping[str, int] = dataclasses.field(default_factory=dict)


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


def _lookahead(fields: Mapping[str, Any]) -> tuple[int, ...] | None:
    value = fields.get("lookahead_token_ids")
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(tokens, (list, tuple)) for tokens in value):
        raise DecodeError(f"lookahead_token_ids: expected a list of token lists or nil, got {str(value)[:60]}")
    return tuple(len(tokens) for tokens in value)


def _fields(raw: Any, kind: str, unknown_keys: collections.Counter[str]) -> dict[str, Any]:
    """The fields of a known event in either encoding; keys past the known ones are counted."""
    names = _FIELDS[kind]
    if isinstance(raw, (list, tuple)):
        # Extra trailing fields (a newer vLLM) are unknown and skipped.
        for index in range(len(names) + 1, len(raw)):
            unknown_keys[f"{kind}[{index}]"] += 1
        return dict(zip(names, raw[1:], strict=False))
    fields = {_text(k): v for k, v in raw.items()}
    for key in fields:
        if key != "type" and key not in names:
            unknown_keys[f"{kind}.{key}"] += 1
    return fields


def decode_event(raw: Any, unknown_keys: collections.Counter[str] | None = None) -> KVEvent | None:
    """One event; None for an unknown type. Raises DecodeError for a malformed known one.
    Keys it does not know are counted in ``unknown_keys`` per name."""
    if isinstance(raw, (list, tuple)) and raw:
        kind = _text(raw[0])
    elif isinstance(raw, dict):
        kind = _text(raw.get("type", raw.get(b"type")))
    else:
        raise DecodeError(f"an event must be an array or a map, got {type(raw).__name__}")
    if not isinstance(kind, str) or kind not in _FIELDS:
        return None
    f = _fields(raw, kind, unknown_keys if unknown_keys is not None else collections.Counter())
    if kind == "BlockStored":
        block_size = _opt_int(f, "block_size")
        if block_size is not None and not 0 <= block_size <= MAX_BLOCK_SIZE:
            raise DecodeError(f"block_size: must be in 0..{MAX_BLOCK_SIZE}, got {block_size}")
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
            kv_cache_spec_kind=_opt_str(f, "kv_cache_spec_kind"),
            sliding_window=_opt_int(f, "kv_cache_spec_sliding_window"),
            locality=_opt_str(f, "locality"),
            ownership=_opt_str(f, "ownership"),
            session_id=_opt_str(f, "session_id"),
            lookahead_tokens=_lookahead(f),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(f),
            medium=_opt_str(f, "medium"),
            group_idx=_opt_int(f, "group_idx"),
            locality=_opt_str(f, "locality"),
            ownership=_opt_str(f, "ownership"),
        )
    return AllBlocksCleared()


def _event_type(raw: Any) -> str:
    kind = _text(raw[0]) if isinstance(raw, (list, tuple)) and raw else _text(raw.get("type", raw.get(b"type")))
    return kind if isinstance(kind, str) else repr(kind)[:40]


def decode_batch(payload: bytes) -> EventBatch:
    """A KVEventBatch; raises DecodeError if the batch itself is unreadable (bad events are counted)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, unicode_errors="replace")
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise DecodeError(f"payload is not msgpack: {exc}") from exc
    unknown_keys: collections.Counter[str] = collections.Counter()
    if isinstance(obj, (list, tuple)):
        if len(obj) < 2:
            raise DecodeError(f"a batch array needs [ts, events], got {len(obj)} elements")
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
        for index in range(len(BATCH_FIELDS), len(obj)):
            unknown_keys[f"batch[{index}]"] += 1
    elif isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
        for key in obj:
            if key not in BATCH_FIELDS:
                unknown_keys[f"batch.{_text(key)}"] += 1
    else:
        raise DecodeError(f"a batch must be an array or a map, got {type(obj).__name__}")
    if not isinstance(events, (list, tuple)):
        raise DecodeError(f"events: expected a list, got {type(events).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        ts = None
    if isinstance(rank, bool) or not isinstance(rank, int):
        rank = None
    out: list[KVEvent] = []
    unknown_types: collections.Counter[str] = collections.Counter()
    malformed = 0
    problems: list[str] = []
    for i, raw in enumerate(events):
        try:
            event = decode_event(raw, unknown_keys)
        except DecodeError as exc:
            malformed += 1
            problems.append(f"events[{i}]: {exc}")
            continue
        if event is None:
            unknown_types[_event_type(raw)] += 1
        else:
            out.append(event)
    return EventBatch(
        None if ts is None else float(ts),
        tuple(out),
        rank,
        sum(unknown_types.values()),
        malformed,
        tuple(problems),
        dict(unknown_keys),
        dict(unknown_types),
    )


def ts_to_us(ts: float | None, fallback_s: float) -> int:
    """Event time in microseconds: the batch's ts (unix seconds) if it is one (finite, in
    0..MAX_TS_S), else the fallback, else 0."""
    seconds = ts if ts is not None and 0 <= ts <= MAX_TS_S else fallback_s
    if not 0 <= seconds <= MAX_TS_S:  # NaN too
        return 0
    return int(seconds * 1_000_000)


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

    def restarted(self, rank: int, ts: float) -> None:
        """The bridge found that rank's engine restarted: its next records are the new engine's."""
        self.write(rank, RESTART_RECORD_SEQ, ts, b"")

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

    def __reduce__(self) -> tuple[type[CaptureError], tuple[str, int, str]]:
        # Survives pickling with its fields (a replay job's error comes back from its worker process).
        return (type(self), (self.path, self.index, self.reason))


def read_capture(path: str) -> tuple[dict[str, Any], Iterator[CaptureRecord | CaptureError]]:
    """(header, records): a bad record is yielded as a CaptureError for the caller to raise or
    count; a torn tail ends the records (logged). Raises CaptureError if the header is bad."""
    try:
        f = open_regular(path)  # handed to the generator, which closes it
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
