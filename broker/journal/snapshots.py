"""Snapshots in the journal (RecordKind.SNAPSHOT): where a restart can start instead of the
journal's first record (issue 41, item 14).

A snapshot is two records. The *mark* is appended when it is taken, between two batches:
nothing but its number. The broker then forks (broker.service.forked_copy); the child
pickles the driving cores (``broker.model.arms.Driving``: residency, policies, each client's
last batch_seq) as they were at the mark, compressed, and the broker appends that as the
*state* record, some batches later. The state is the state at its mark: a restart loads
the last state whose mark it has seen, then applies the batches and config changes that
follow the mark (those between the mark and the state too), exactly as it would have from
the start. ``replay --verify`` checks each state against the state its replay reaches at
the mark (``fingerprint``).

Payload: ``MAGIC | number u64 | part u8`` (0 mark, 1 state), then for a state the
zlib-compressed pickle. A state is read with an unpickler that builds only the kvbroker's
own classes and a few containers (``load_state``): a journal is not trusted code.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import struct
import zlib
from typing import Any

from broker.journal.records import JournalError, JournalRecord, RecordKind
from broker.model.arms import Driving

MAGIC = b"KVBSNAP1"
HEAD = struct.Struct("<8sQB")
MARK = 0
STATE = 1


def mark_record(number: int, schema_major: int, generation: int) -> JournalRecord:
    return JournalRecord(RecordKind.SNAPSHOT, schema_major, generation, HEAD.pack(MAGIC, number, MARK))


def state_record(number: int, schema_major: int, generation: int, state: bytes) -> JournalRecord:
    return JournalRecord(RecordKind.SNAPSHOT, schema_major, generation, HEAD.pack(MAGIC, number, STATE) + state)


def parse(payload: bytes) -> tuple[int, int]:
    """(number, part) of a SNAPSHOT payload; JournalError if it is none."""
    if len(payload) < HEAD.size:
        raise JournalError(f"its snapshot payload ({len(payload)} bytes) is shorter than its header")
    magic, number, part = HEAD.unpack_from(payload)
    if magic != MAGIC or part not in (MARK, STATE) or (part == MARK and len(payload) != HEAD.size):
        raise JournalError("its payload is not a snapshot mark or state")
    return number, part


def dump_state(driving: Driving) -> bytes:
    """What a state record holds after its header (run in the forked child)."""
    return zlib.compress(pickle.dumps(driving, protocol=pickle.HIGHEST_PROTOCOL), 1)


# Modules whose classes a state may build: the kvbroker's own, and these containers.
_OWN = ("broker.", "policies.")
_CONTAINERS = {
    ("collections", "OrderedDict"),
    ("collections", "deque"),
    ("collections", "defaultdict"),
    ("collections", "Counter"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "bytearray"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
}


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_OWN) or (module, name) in _CONTAINERS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a state may not build {module}.{name}")


def load_state(payload: bytes) -> Driving:
    """The driving cores a state record holds; JournalError (one line) if they cannot be
    read back (damaged, forged, or a policy this kvbroker does not have)."""
    try:
        data = zlib.decompress(payload[HEAD.size :])
        driving = _StateUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # anything a forged pickle can raise (RecursionError too), in one line
        raise JournalError(f"its snapshot state cannot be read back ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(driving, Driving):
        raise JournalError(f"its snapshot state is a {type(driving).__name__}, not the broker's cores")
    return driving


def fingerprint(driving: Driving) -> str:
    """A digest of what the cores hold that does not depend on the process (hash order):
    each core's policy, generation, clients' last batch_seq, tiers' usage and every block's
    placement and recency. Equal states give equal fingerprints."""
    h = hashlib.sha256()
    for name, core in sorted(driving.cores().items()):
        h.update(repr((name, core.policy_name, core.generation, sorted(core.client_seq.items()), core.tier_usage())).encode())
        for block in sorted(core.blocks.values(), key=lambda b: b.block_id):
            h.update(
                repr((block.block_id, block.tier, block.size, block.pinned, block.last_access_us, block.request_id, block.tenant)).encode()
            )
    return h.hexdigest()
