"""A tenant's first event is held to the least clock anchor of any tenant, read in O(1)
(``Core.least_anchor``; issue 33, item 9: 100,000 tenants made each new tenant's check
walk every anchor, 4,601 -> 981 batches/s and a 48.5 s restart)."""

from __future__ import annotations

import random

from broker.model.apply import apply_batch
from broker.model.core import Core
from kvbroker.v1 import intent_pb2 as pb
from tests.builders import alloc
from tests.conftest import small_config


def test_the_least_anchor_is_the_least_of_every_tenants_and_decides_as_before() -> None:
    """Random tenants, leads and receive times: ``least_anchor`` is always the least of
    ``time_anchor``, and a new tenant's far event is rejected against it (ts_us)."""
    rng = random.Random(7)
    core = Core(small_config().core)
    seqs: dict[str, int] = {}
    now = 1_000_000
    for i in range(400):
        tenant = f"t{rng.randrange(60)}"
        seqs[tenant] = seqs.get(tenant, 0) + 1
        now += rng.randrange(1_000)
        ts = now + rng.randrange(-500_000, 500_000)
        batch = pb.IntentBatch(client_id="c", batch_seq=seqs[tenant], tenant=tenant, broker_received_us=now, events=[alloc(f"b{i}", ts=ts)])
        apply_batch(core, batch.SerializeToString())
        assert core.least_anchor == min(core.time_anchor.values())
    far = core.least_anchor + core.config.max_clock_skew_us + now + 1
    batch = pb.IntentBatch(client_id="c", batch_seq=1, tenant="new", broker_received_us=now, events=[alloc("x", ts=far)])
    out = apply_batch(core, batch.SerializeToString())
    assert [r.field for r in out.rejections] == ["ts_us"]
    assert core.tenant_clients["new"] == 1 and "new" not in core.time_anchor
