"""The block sequence of a prompt-only replay, as a plain cache simulator (libCacheSim) sees it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def block_sequence(batches: Iterable[Any]) -> tuple[list[int], int]:
    """The block ids the batches allocate, in order, as ints from 0 (one per distinct id),
    and the bytes of a block (the first allocation's; the importers' blocks are uniform)."""
    ids: dict[str, int] = {}
    seq: list[int] = []
    size = 0
    for batch in batches:
        for event in batch.events:
            if event.WhichOneof("kind") == "allocated":
                intent = event.allocated.intent
                seq.append(ids.setdefault(intent.block_id, len(ids)))
                size = size or intent.size_bytes
    return seq, size
