"""belady: the block used farthest in the future leaves first; refused without the future."""

from __future__ import annotations

import pytest

from broker.config import parse_config
from broker.model.core import Core
from broker.replay.replay import replay
from kvbroker.v1 import intent_pb2 as pb
from policies.base import PolicyError
from tests.builders import access, alloc
from tests.conftest import SMALL_TIERS


def test_belady_is_refused_by_a_live_core_and_by_a_broker_config() -> None:
    import dataclasses

    from broker.config import ConfigError, PolicyConfig

    with pytest.raises(ConfigError, match=r"policy\.name: belady .*replay only"):
        parse_config('[policy]\nname = "belady"\n' + SMALL_TIERS)
    core = dataclasses.replace(parse_config(SMALL_TIERS).core, policy=PolicyConfig("belady"))
    with pytest.raises(PolicyError, match="replay only"):
        Core(core)


def test_belady_evicts_the_block_whose_next_use_is_farthest() -> None:
    config = parse_config("[[tiers]]\nname = 'hbm'\ncapacity = 300\nhigh_watermark = 1.0\nlow_watermark = 1.0\n").core
    # a, b, c fill the tier; d needs room. Next uses: a at step 5, b never, c at step 4.
    events = [alloc("a", ts=0), alloc("b", ts=1), alloc("c", ts=2), alloc("d", ts=3), access("c", ts=4), access("a", ts=5)]
    batches = [pb.IntentBatch(client_id="t", batch_seq=i + 1, events=[e]) for i, e in enumerate(events)]
    sink: list = []
    result = replay(lambda: ((1, b) for b in batches), config, "belady", sink=sink)
    # b is never used again: it goes; a and c are then hits.
    assert [x.block_id for x in sink] == ["b"]
    assert result.metrics["accesses_by_tier"]["hbm"] == 2
    # LRU evicts a (the oldest) and then misses it at step 5.
    lru_sink: list = []
    replay(lambda: ((1, b) for b in batches), config, "lru", sink=lru_sink)
    assert lru_sink[0].block_id == "a"
