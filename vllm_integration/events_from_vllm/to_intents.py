"""vLLM KV-cache events as broker events: one ``EngineTranslator`` per engine (per data-parallel rank).

Shared by the live bridge (``vllm_integration.events_from_vllm.bridge``) and the capture importer
(``vllm_integration.trace_import``), so a capture replays into exactly the events the bridge sent.
The wire format and block ids are ``vllm_integration.events_from_vllm.zmq_events``.

**Copies and reference counts.** vLLM announces every copy of a block it makes in a medium
(GPU, CPU, STORAGE) with BlockStored, and every copy it drops with BlockRemoved. One hash can
be announced several times in one medium while vLLM holds it: the GPU prefix cache does not
deduplicate blocks (two requests that computed the same prefix each cache a block under its
hash, and each is removed on its own), and the offloading connector re-announces the shared
hashes of chunks that overlap a shared prefix, saying that consumers must reference-count them
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py). So the translator counts
announcements per (block, medium) and drops a copy when its count reaches zero.

**Mapping.**

- BlockStored: each hash, in chain order, becomes ``allocated`` in the medium's tier the first
  time any medium holds it; the previous block of the chain (``parent_block_hash`` for the
  first) is ``parent_block_id``. A copy in a lower medium than one already holding the block
  sends nothing; a copy in a higher one moves the block up (``freed`` then ``allocated``).
- Sizes: ``clients.kvsize`` for the model, the event's ``block_size`` and the block's KV-cache
  group (a hybrid model's group holds only its share of the layers: ``cache_group_layers``).
  A store with ``block_size`` 0 (vLLM's offloading connector announcing a CPU/STORAGE copy by
  its chunk's last hash) takes the size of the block's other copy; with none, it is sized for
  ``offload_block_size`` tokens, else for the last block size the engine announced for that
  group, else 16.
- Intent: ``session_id`` is the block's ``request_id`` (the request context that stored it;
  blocks of one session group together); ``lookahead_token_ids`` (lookahead hashing for
  speculative decoding: the drafter reads the block again while the next tokens are decoded)
  is ``expected_reuse_window_tokens`` = the lookahead's length; the position in the chain is
  ``token_start``; with ``prefill_tokens_per_s`` set, ``recompute_cost_us`` is the time to
  prefill what recomputing the block needs: its tokens and its prefix, or only the window
  before it for a sliding-window group (``kv_cache_spec_kind`` / ``_sliding_window``, learned
  per group from any event that carries them, as vLLM's GPU events do not).
- BlockRemoved: one announcement of the copy in that medium fewer; at zero the copy goes.
  ``freed`` when no medium holds the block any more; when only a lower one does, the block
  moves down there (``freed`` then ``allocated``). Removing a block the bridge never saw
  stored (it joined late, or a loss could not be replayed) is skipped and counted.
- AllBlocksCleared, and an engine restart: ``cleared`` (the broker drops every block of that
  engine's client id).

Dropped (the schema has no field for them): ``extra_keys`` (the block hash already covers
them: LoRA name, multimodal hashes, cache salt), ``ownership`` (which secondary tier made a
copy: copies of one medium are counted together), ``token_ids`` (only their count is kept),
the sessions that reuse a block after the one that stored it, and the attention kind beyond
sliding windows (a Mamba group's state is sized as attention KV).

**Tiers.** Media map to tiers by an ordered table, top tier first: ``GPU=hbm,CPU=dram,
STORAGE=nvme`` by default; an event without a medium is the GPU prefix cache. An entry
``MEDIUM@LOCALITY`` (``STORAGE@REMOTE=remote``) maps the copies vLLM marks with that
``locality`` and wins over the plain ``MEDIUM`` entry. A medium the table lacks maps to the
``*`` entry if there is one, else the event is skipped and counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from clients import kvsize
from kvbroker.v1 import intent_pb2 as pb
from vllm_integration.events_from_vllm.zmq_events import (
    DEFAULT_BLOCK_SIZE,
    MAX_BLOCK_SIZE,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    block_id,
)

DEFAULT_TIER_MAP: tuple[tuple[str, str], ...] = (("GPU", "hbm"), ("CPU", "dram"), ("STORAGE", "nvme"))


# ---- tiers -----------------------------------------------------------------------------------


def parse_tier_map(text: str) -> tuple[tuple[str, str], ...]:
    """``GPU=hbm,CPU=dram`` (top tier first) -> ((GPU, hbm), (CPU, dram)); ``*`` matches any
    other medium; ``MEDIUM@LOCALITY`` the copies of that locality (LOCAL, REMOTE) only."""
    pairs: list[tuple[str, str]] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        medium, sep, tier = item.partition("=")
        medium, tier = medium.strip().upper(), tier.strip()
        if not sep or not medium or not tier:
            raise ValueError(f"tier map entry {item!r}: expected MEDIUM=TIER (e.g. GPU=hbm)")
        name, at, locality = medium.partition("@")
        if at and (not name or not locality):
            raise ValueError(f"tier map entry {item!r}: expected MEDIUM@LOCALITY=TIER (e.g. STORAGE@REMOTE=remote)")
        if medium in (m for m, _ in pairs):
            raise ValueError(f"tier map: medium {medium!r} given twice")
        pairs.append((medium, tier))
    if not pairs:
        raise ValueError("tier map is empty: give at least GPU=<top tier>")
    return tuple(pairs)


def format_tier_map(pairs: Iterable[tuple[str, str]]) -> str:
    return ",".join(f"{m}={t}" for m, t in pairs)


# ---- options and counters --------------------------------------------------------------------


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
    # Tokens of an offloaded copy announced with block_size 0 that the bridge holds no other
    # copy of (vLLM's kv_connector_extra_config "block_size", tokens per offloaded chunk).
    offload_block_size: int | None = None
    # The engine's prefill rate: with it, blocks carry recompute_cost_us.
    prefill_tokens_per_s: float | None = None
    # Requests use kv_cache_report_mode "full": vLLM re-announces the GPU blocks a request
    # reuses, with no removal to match; a GPU store of a block the GPU holds is then a reuse
    # report, not another copy (but two GPU copies of one hash are then freed by the first
    # removal).
    gpu_reuse_reports: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in kvsize.DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(kvsize.DTYPE_BYTES)}, got {self.dtype!r}")
        if self.block_bytes is not None and self.block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {self.block_bytes}")
        if not self.tier_map:
            raise ValueError("tier_map is empty")
        if self.offload_block_size is not None and not 0 < self.offload_block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"offload_block_size must be in 1..{MAX_BLOCK_SIZE}, got {self.offload_block_size}")
        rate = self.prefill_tokens_per_s
        if rate is not None and not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"prefill_tokens_per_s must be a finite number > 0, got {rate}")


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
    # BlockStored of a copy already held in that medium (counted: it takes one more removal).
    duplicate_stored: int = 0
    # BlockRemoved of a copy announced more than once: counted down, the copy stays.
    shared_removed: int = 0
    # Under gpu_reuse_reports: GPU stores of a block the GPU holds, taken as reuse reports.
    reuse_reports: int = 0
    # BlockStored with block_size 0 (offloaded copies that name no size).
    unsized_stored: int = 0
    # BlockRemoved of a copy never stored in that medium.
    unknown_removed: int = 0
    unknown_medium: int = 0
    unknown_events: int = 0
    malformed_events: int = 0
    bad_batches: int = 0
    # Per name, what this decoder does not know (a newer vLLM): keys, and event types.
    unknown_keys: dict[str, int] = dataclasses.field(default_factory=dict)
    unknown_event_types: dict[str, int] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Held:
    """What the translator knows of a block it told the broker about."""

    __slots__ = ("mask", "refs", "size", "parent", "tokens", "start", "request", "reuse", "cost")

    def __init__(self, mask: int, size: int, parent: str, tokens: int, start: int, request: str, reuse: int, cost: int) -> None:
        self.mask = mask  # bit s: tier-map entry s (a medium) holds a copy
        # Announcements beyond the first, per entry with more than one (None: none).
        self.refs: dict[int, int] | None = None
        self.size = size
        self.parent = parent
        self.tokens = tokens
        self.start = start  # first token's position in its sequence; -1: unknown
        self.request = request
        self.reuse = reuse  # expected_reuse_window_tokens; 0: none
        self.cost = cost  # recompute_cost_us; -1: none


# ---- the translator --------------------------------------------------------------------------


class EngineTranslator:
    """One engine's (one data-parallel rank's) vLLM events as broker events.

    Keeps, per block it has told the broker about, which media hold a copy (a bit per tier-map
    entry) and how many times each was announced, its size and parent, so removals free
    exactly what was allocated and a block moves when its best copy goes. O(1) per block of
    an event. Deterministic: the same batches give the same events.
    """

    def __init__(self, options: MappingOptions, shape: kvsize.ModelShape | None = None) -> None:
        self.options = options
        self.shape = shape if shape is not None or options.block_bytes is not None else resolve_model(options.model)
        self.held: dict[str, _Held] = {}
        self.stats = TranslatorStats()
        tiers: list[str] = []
        self._slot_of: dict[str, int] = {}
        slot_rank: list[int] = []
        for medium, tier in options.tier_map:
            if tier not in tiers:
                tiers.append(tier)
            self._slot_of[medium.upper()] = len(slot_rank)
            slot_rank.append(tiers.index(tier))
        self.tiers = tuple(tiers)
        self._slot_rank = tuple(slot_rank)
        # An event without a medium is the first entry's (the GPU prefix cache).
        self._gpu = options.tier_map[0][0].upper().partition("@")[0]
        self._gpu_slot = self.medium_slot(None, None)
        self._best: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        # Per KV-cache group: the last block size announced, and (kind, sliding window).
        self._group_block_size: dict[int, int] = {}
        self._group_spec: dict[int, tuple[str, int | None]] = {}
        # Adapter identity of stored hashes, so a BlockRemoved (which names no adapter)
        # finds the block: key without adapter -> id with it.
        self._adapter_ids: dict[str, str] = {}

    # ---- sizes and tiers -----------------------------------------------------------------

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of ``block_size`` tokens of one KV-cache group."""
        if self.options.block_bytes is not None:
            return self.options.block_bytes
        size = self._sizes.get(block_size)
        if size is None:
            assert self.shape is not None
            size = kvsize.bytes_per_group_block(self.shape, block_size, kvsize.DTYPE_BYTES[self.options.dtype])
            self._sizes[block_size] = size
        return size

    def medium_slot(self, medium: str | None, locality: str | None) -> int | None:
        """The tier-map entry of a copy: MEDIUM@LOCALITY, MEDIUM, then ``*``; None if none."""
        key = self._gpu if medium is None else medium.upper()
        slot = None
        if locality:
            slot = self._slot_of.get(f"{key}@{locality.upper()}")
        if slot is None:
            slot = self._slot_of.get(key)
        if slot is None and locality:
            slot = self._slot_of.get(f"*@{locality.upper()}")
        if slot is None:
            slot = self._slot_of.get("*")
        return slot

    def medium_rank(self, medium: str | None, locality: str | None = None) -> int | None:
        """The tier rank (0 = top) a copy in ``medium`` lives in, or None."""
        slot = self.medium_slot(medium, locality)
        return None if slot is None else self._slot_rank[slot]

    def _best_rank(self, mask: int) -> int:
        best = self._best.get(mask)
        if best is None:
            best = min(rank for slot, rank in enumerate(self._slot_rank) if mask >> slot & 1)
            self._best[mask] = best
        return best

    def tier_of(self, block_id_: str) -> str | None:
        """The tier the engine really holds a block in (its best copy), or None."""
        held = self.held.get(block_id_)
        return None if held is None else self.tiers[self._best_rank(held.mask)]

    def copies(self, block_id_: str) -> dict[str, int]:
        """Announcements outstanding per tier-map entry (medium) of a block."""
        held = self.held.get(block_id_)
        if held is None:
            return {}
        names = [m for m, _ in self.options.tier_map]
        refs = held.refs or {}
        return {names[s]: refs.get(s, 1) for s in range(len(names)) if held.mask >> s & 1}

    def _window(self, group: int, event: BlockStored) -> int | None:
        """The sliding window of a group, if it slides (from the event, what was learned, or a
        model whose every layer slides)."""
        kind, window = event.kv_cache_spec_kind, event.sliding_window
        if kind is None:
            kind, window = self._group_spec.get(group, ("", None))
        if kind:
            return window if "sliding" in kind and window else None
        shape = self.shape
        if shape is not None and shape.sliding_window and not shape.full_layers:
            return shape.sliding_window
        return None

    def _recompute_cost_us(self, start: int, tokens: int, window: int | None) -> int:
        """Prefill time of the block's tokens and what they attend to before them: the whole
        prefix, or only the window for a sliding-window group. -1: not known."""
        rate = self.options.prefill_tokens_per_s
        if rate is None or start < 0:
            return -1
        context = start if window is None else min(start, window)
        return math.ceil((context + tokens) * 1_000_000 / rate)

    # ---- events --------------------------------------------------------------------------

    def _id(self, value: BlockHash, lora_name: str | None, lora_id: int | None, group_idx: int | None) -> str:
        return block_id(value, namespace=self.options.namespace, lora_name=lora_name, lora_id=lora_id, group_idx=group_idx)

    def _allocated(self, ts_us: int, bid: str, held: _Held, rank: int) -> pb.Event:
        intent = pb.MemoryIntent(
            block_id=bid,
            request_id=held.request,
            size_bytes=held.size,
            parent_block_id=held.parent,
            token_start=max(held.start, 0),
            token_count=held.tokens,
            tenant=self.options.tenant,
            # A prefix-cache block can always be recomputed from its tokens.
            recompute_ok=True,
        )
        if held.reuse:
            intent.expected_reuse_window_tokens = held.reuse
        if held.cost >= 0:
            intent.recompute_cost_us = held.cost
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
        for key, n in batch.unknown_keys.items():
            stats.unknown_keys[key] = stats.unknown_keys.get(key, 0) + n
        for key, n in batch.unknown_types.items():
            stats.unknown_event_types[key] = stats.unknown_event_types.get(key, 0) + n
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
        slot = self.medium_slot(event.medium, event.locality)
        if slot is None:
            self.stats.unknown_medium += 1
            return
        rank, bit = self._slot_rank[slot], 1 << slot
        group = event.group_idx or 0
        if event.kv_cache_spec_kind:
            self._group_spec[group] = (event.kv_cache_spec_kind, event.sliding_window)
        tokens = event.block_size
        if tokens:
            self._group_block_size[group] = tokens
        else:
            self.stats.unsized_stored += 1
            tokens = self.options.offload_block_size or self._group_block_size.get(group, DEFAULT_BLOCK_SIZE)
        size = self.block_bytes(tokens)
        window = self._window(group, event)
        adapter = bool(event.lora_name) or event.lora_id is not None
        parent = (
            "" if event.parent_block_hash is None else self._id(event.parent_block_hash, event.lora_name, event.lora_id, event.group_idx)
        )
        # Position in the sequence: 0 for a chain's first block, after its parent when the
        # bridge knows where that one is; an offloaded copy that names no size says nothing.
        if not event.block_size:
            start = -1
        elif not parent:
            start = 0
        else:
            before = self.held.get(parent)
            start = before.start + before.tokens if before is not None and before.start >= 0 else -1
        lookahead = event.lookahead_tokens or ()
        for i, value in enumerate(event.block_hashes):
            bid = self._id(value, event.lora_name, event.lora_id, event.group_idx)
            self.stats.stored_blocks += 1
            if adapter:
                self._adapter_ids[self._id(value, None, None, event.group_idx)] = bid
            held = self.held.get(bid)
            if held is None:
                reuse = lookahead[i] if i < len(lookahead) else 0
                cost = self._recompute_cost_us(start, tokens, window)
                held = _Held(bit, size, parent, tokens, start, event.session_id or "", reuse, cost)
                self.held[bid] = held
                out.append(self._allocated(ts_us, bid, held, rank))
            elif held.mask & bit:
                if self.options.gpu_reuse_reports and slot == self._gpu_slot:
                    self.stats.reuse_reports += 1
                else:
                    refs = held.refs if held.refs is not None else {}
                    refs[slot] = refs.get(slot, 1) + 1
                    held.refs = refs
                    self.stats.duplicate_stored += 1
            else:
                before_rank = self._best_rank(held.mask)
                held.mask |= bit
                if rank < before_rank:  # a copy in a higher tier: the block moves up
                    self.stats.moves += 1
                    out.append(self._freed(ts_us, bid))
                    out.append(self._allocated(ts_us, bid, held, rank))
            parent = bid
            if start >= 0:
                start += tokens

    def _removed(self, event: BlockRemoved, ts_us: int, out: list[pb.Event]) -> None:
        slot = self.medium_slot(event.medium, event.locality)
        if slot is None:
            self.stats.unknown_medium += 1
            return
        bit = 1 << slot
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
            refs = held.refs
            if refs is not None and slot in refs:
                # Another announcement of this copy is outstanding: vLLM still holds it.
                left = refs[slot] - 1
                if left > 1:
                    refs[slot] = left
                else:
                    del refs[slot]
                    if not refs:
                        held.refs = None
                self.stats.shared_removed += 1
                continue
            before = self._best_rank(held.mask)
            held.mask &= ~bit
            if not held.mask:
                del self.held[bid]
                out.append(self._freed(ts_us, bid))
                continue
            after = self._best_rank(held.mask)
            if after != before:  # the best copy went: the block moves down
                self.stats.moves += 1
                out.append(self._freed(ts_us, bid))
                out.append(self._allocated(ts_us, bid, held, after))
        if len(self._adapter_ids) > 2 * len(self.held) + 1024:
            self._adapter_ids = {k: v for k, v in self._adapter_ids.items() if v in self.held}
