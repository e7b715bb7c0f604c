"""Bad input: each invalid event is rejected with its index, field and reason; the rest of
the batch applies."""

from __future__ import annotations

import pytest

from broker.model.apply import apply_batch
from broker.model.core import Core
from kvbroker.v1 import intent_pb2 as pb
from tests.builders import Driver, access, alloc, clear, evict_request, free, release, update
from tests.conftest import small_config


@pytest.mark.parametrize(
    ("bad", "field", "code", "words"),
    [
        (alloc("", ts=1), "allocated.intent.block_id", "INVALID_ARGUMENT", "required"),
        (alloc("z", size=0, ts=1), "allocated.intent.size_bytes", "INVALID_ARGUMENT", "> 0"),
        (alloc("z", ts=1, deadline_us=-5), "allocated.intent.deadline_us", "INVALID_ARGUMENT", ">= 0"),
        (alloc("z", ts=1, slack_us=-1), "allocated.intent.slack_us", "INVALID_ARGUMENT", ">= 0"),
        (alloc("z", ts=1, phase=42), "allocated.intent.phase", "INVALID_ARGUMENT", "unknown enum value 42"),
        (alloc("z", ts=1, priority=9), "allocated.intent.priority", "INVALID_ARGUMENT", "unknown enum value 9"),
        (alloc("z", ts=1, request_priority=101), "allocated.intent.request_priority", "INVALID_ARGUMENT", "0..100"),
        (alloc("z", ts=1, tier="gpu9"), "allocated.tier", "INVALID_ARGUMENT", "unknown tier 'gpu9'"),
        (alloc("z", ts=1, allowed_tiers=["dram", "tape"]), "allocated.intent.allowed_tiers[1]", "INVALID_ARGUMENT", "tape"),
        (alloc("z", ts=1, tier="hbm", allowed_tiers=["dram"]), "allocated.tier", "INVALID_ARGUMENT", "allowed_tiers"),
        (alloc("a", ts=1), "allocated.intent.block_id", "ALREADY_EXISTS", "already allocated"),
        (access("a", "ghost", ts=1), "accessed.block_ids[1]", "FAILED_PRECONDITION", "unknown block 'ghost'"),
        (access(ts=1), "accessed.block_ids", "INVALID_ARGUMENT", "empty"),
        (update("ghost", ts=1, phase=pb.PHASE_DECODE), "intent_updated.block_id", "FAILED_PRECONDITION", "unknown block"),
        (update("a", ts=1, priority=77), "intent_updated.priority", "INVALID_ARGUMENT", "unknown enum value 77"),
        (update("a", ts=1, deadline_us=-1), "intent_updated.deadline_us", "INVALID_ARGUMENT", ">= 0"),
        (release("ghost", ts=1), "released.block_ids[0]", "FAILED_PRECONDITION", "unknown block"),
        (free("ghost", ts=1), "freed.block_ids[0]", "FAILED_PRECONDITION", "unknown block"),
        (pb.Event(ts_us=1), "kind", "INVALID_ARGUMENT", "no kind"),
        (pb.Event(ts_us=-3, accessed=pb.BlocksAccessed(block_ids=["a"])), "ts_us", "INVALID_ARGUMENT", ">= 0"),
        (pb.Event(ts_us=1, acked=pb.DirectiveAcked(directive_id=1)), "acked.status", "INVALID_ARGUMENT", "ACK_STATUS_DONE"),
        (evict_request(1, tier="tape", ts=1), "eviction_requested.tier", "INVALID_ARGUMENT", "unknown tier 'tape'"),
        (evict_request(3, "a", ts=1), "eviction_requested.count", "RESOURCE_EXHAUSTED", "only 1 can be chosen"),
    ],
)
def test_a_bad_event_is_rejected_with_index_field_reason_and_the_rest_applies(bad: pb.Event, field: str, code: str, words: str) -> None:
    d = Driver(small_config("lru"))
    d.send(alloc("a", ts=0))
    # The bad event sits between two good ones.
    out = d.send(alloc("before", ts=1), bad, alloc("after", ts=2))
    assert len(out.rejections) == 1
    rejection = out.rejections[0]
    assert (rejection.index, rejection.field, rejection.code) == (1, field, code)
    assert words in rejection.reason
    assert {"before", "after"} <= set(d.core.blocks)
    assert out.accepted == 2
    assert d.core.stats.rejected_events == 1


def test_stats_count_the_applied_events_of_each_kind_and_not_the_rejected_ones() -> None:
    d = Driver(small_config("lru"))
    d.send(
        alloc("a", ts=0),
        alloc("b", ts=0),
        alloc("a", ts=0),  # rejected: already allocated
        access("a", ts=1),
        access("a", "b", ts=1),
        access("ghost", ts=1),  # rejected
        update("b", ts=2, phase=pb.PHASE_DECODE),
        pb.Event(ts_us=2),  # rejected: no kind
        release("b", ts=3),
    )
    expected = {"allocated": 2, "accessed": 2, "intent_updated": 1, "released": 1, "freed": 0, "cleared": 0, "acked": 0}
    expected["eviction_requested"] = 0
    assert d.core.stats.events == expected and d.core.stats.rejected_events == 3
    d.send(free("a", ts=4), free("ghost", ts=4), clear(ts=5), access("b", ts=5))  # the clear drops b: the access is rejected
    expected.update(freed=1, cleared=1)
    assert d.core.stats.events == expected and d.core.stats.rejected_events == 5


def test_an_event_naming_several_blocks_is_all_or_nothing() -> None:
    d = Driver(small_config("lru"))
    d.send(alloc("a", ts=0), alloc("b", ts=0))
    out = d.send(free("a", "ghost", ts=1))
    assert out.rejections[0].field == "freed.block_ids[1]"
    assert "a" in d.core.blocks  # nothing of the rejected event applied


def test_batch_level_checks_refuse_without_applying_anything() -> None:
    core = Core(small_config("lru").core)
    no_client = apply_batch(core, pb.IntentBatch(batch_seq=1, events=[alloc("a")]))
    assert (no_client.applied, no_client.rejections[0].field, no_client.rejections[0].index) == (False, "client_id", -1)
    zero = apply_batch(core, pb.IntentBatch(client_id="c", batch_seq=0, events=[alloc("a")]))
    assert (zero.applied, zero.rejections[0].field) == (False, "batch_seq")
    assert core.blocks == {}


def test_a_batch_seq_already_applied_is_a_duplicate_and_is_not_applied_again() -> None:
    core = Core(small_config("lru").core)
    first = apply_batch(core, pb.IntentBatch(client_id="c", batch_seq=1, events=[alloc("a")]))
    again = apply_batch(core, pb.IntentBatch(client_id="c", batch_seq=1, events=[alloc("a")]))
    assert first.applied and not again.applied and again.duplicate
    assert again.rejections == []  # a resend is not an error: it was applied once
    assert core.stats.duplicate_batches == 1 and core.stats.events["allocated"] == 1
    # Another client has its own sequence.
    other = apply_batch(core, pb.IntentBatch(client_id="d", batch_seq=1, events=[alloc("b")]))
    assert other.applied
