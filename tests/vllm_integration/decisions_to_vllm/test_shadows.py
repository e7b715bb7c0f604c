"""Shadow policies and what-if sizes (vllm_integration/decisions_to_vllm/shadows.py), without vLLM: settings,
the spatial sample, and shadows fed by the emulated manager equal to the policy deciding
there. The same against vLLM's real manager: test_shadows_vllm.py."""

from __future__ import annotations

import collections
import random

import pytest

from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.manager_model import EmulatedManager
from vllm_integration.decisions_to_vllm.policy_calls import RequestIntent, Translator
from vllm_integration.decisions_to_vllm.settings import OffloadSettings, SettingsError, load_settings
from vllm_integration.decisions_to_vllm.shadows import SAMPLE_SPACE, ShadowSet, key_hash, sampled
from vllm_integration.manager_replay.engine import _Request, chunk_key


def test_shadow_settings_are_read_and_checked() -> None:
    got = load_settings({"kvbroker_shadows": "arc, lru", "kvbroker_whatif": "0.5,2,4", "kvbroker_whatif_sample": "0.05"}, {})
    assert (got.shadows, got.whatif, got.whatif_sample) == (("arc", "lru"), (0.5, 2.0, 4.0), 0.05)
    assert load_settings({"kvbroker_shadows": ["s3fifo"], "kvbroker_whatif": [2]}, {}).whatif == (2.0,)
    env = load_settings({}, {"KVBROKER_VLLM_SHADOWS": "heavy_hitter", "KVBROKER_VLLM_WHATIF": "2"})
    assert (env.shadows, env.whatif) == (("heavy_hitter",), (2.0,))
    assert OffloadSettings().shadows == () and OffloadSettings().whatif == ()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kvbroker_shadows": "arc,nope"}, "kv_connector_extra_config.kvbroker_shadows[1]: "),
        ({"kvbroker_shadows": "belady"}, "runs in replay only"),
        ({"kvbroker_shadows": "arc,,lru"}, "kvbroker_shadows[1]: expected a policy name"),
        ({"kvbroker_shadows": "arc,arc"}, "kvbroker_shadows[1]: 'arc' is named twice"),
        ({"kvbroker_shadows": 3}, "kvbroker_shadows: expected policy names"),
        ({"kvbroker_whatif": "2,zero"}, "kvbroker_whatif[1]: expected a number"),
        ({"kvbroker_whatif": "-1"}, "kvbroker_whatif[0]: expected a finite number > 0"),
        ({"kvbroker_whatif": "100"}, "kvbroker_whatif[0]: at most 64 times the tier"),
        ({"kvbroker_whatif": "2,2.0"}, "kvbroker_whatif[1]: 2 is named twice"),
        ({"kvbroker_whatif_sample": "1.5"}, "kvbroker_whatif_sample: a sampling rate is in (0, 1]"),
        ({"kvbroker_whatif_sample": 0}, "kvbroker_whatif_sample: expected a finite number > 0"),
    ],
)
def test_a_bad_shadow_setting_is_refused_naming_it(extra: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(extra, {})
    assert message in str(caught.value)


@pytest.mark.parametrize("rate", [0.1, 0.05, 0.02])
def test_the_spatial_sample_takes_its_rate_of_keys_and_the_same_keys_every_time(rate: float) -> None:
    keys = [chunk_key(n) for n in range(200_000)]  # counters: the hash must spread them
    threshold = round(rate * SAMPLE_SPACE)
    taken = [k for k in keys if sampled(k, threshold)]
    assert abs(len(taken) / len(keys) - rate) < 0.05 * rate
    assert taken == [k for k in keys if sampled(k, threshold)]
    # Buckets are spread: consecutive keys land far apart.
    buckets = collections.Counter(key_hash(k) % 16 for k in keys[:16_000])
    assert max(buckets.values()) < 1.1 * 1000


def requests(seed: int, count: int, docs: int = 300) -> list[list[bytes]]:
    """Prefix-sharing requests: documents read again with growing suffixes, and fresh ones."""
    rng = random.Random(seed)
    out = []
    fresh = 1_000_000
    for _ in range(count):
        doc = int(rng.paretovariate(1.2) * 10) % docs
        shared = rng.randint(1, 30)
        blocks = [doc * 1000 + i for i in range(shared)]
        for _ in range(rng.randint(0, 5)):
            fresh += 1
            blocks.append(fresh)
        out.append([chunk_key(b) for b in blocks])
    return out


def run_decider(policy: str, capacity: int, stream: list[list[bytes]], shadows: ShadowSet | None = None) -> int:
    """The emulated manager with ``policy`` deciding; the shadows fed at each finish, as
    KvbrokerCachePolicy feeds them. The decider's lookup hits."""
    settings = OffloadSettings(policy=policy)
    local = EmbeddedCore(settings, capacity, journal=False)
    translator = Translator(local)
    finished = translator.on_request_finished

    def finish(groups, inserted, reused, req):  # type: ignore[no-untyped-def]
        order, positions = finished(groups, inserted, reused, req)
        if shadows is not None:
            shadows.request(order, reused, req, req.get_state(RequestIntent), translator._ts_ms, positions)
        return order, positions

    translator.on_request_finished = finish  # type: ignore[method-assign]
    manager = EmulatedManager(translator, capacity)
    hits = 0
    for n, keys in enumerate(stream):
        hits += manager.run(keys, _Request(f"r{n}", {k: (i + 1) * 16 for i, k in enumerate(keys)}))
    return hits


@pytest.mark.parametrize("seed", [1, 2])
def test_a_shadow_hits_what_its_policy_hits_deciding_and_the_decider_counts_its_own(seed: int) -> None:
    stream = requests(seed, 3000)
    capacity = 400
    shadows = ShadowSet(OffloadSettings(policy="lru", shadows=("arc", "history_arc", "s3fifo")), capacity)
    lru_hits = run_decider("lru", capacity, stream, shadows)
    rows = {(r["role"], r["policy"]): r for r in shadows.rows()}
    asked = sum(len(keys) for keys in stream)
    assert rows[("decider", "lru")]["hits"] == lru_hits > 0
    assert rows[("decider", "lru")]["asked"] == asked
    for policy in ("arc", "history_arc", "s3fifo"):
        assert rows[("shadow", policy)]["hits"] == run_decider(policy, capacity, stream), policy
    # The policies differ on this stream (so equality above is not a coincidence of alike policies).
    assert len({rows[("shadow", p)]["hits"] for p in ("arc", "history_arc", "s3fifo")} | {lru_hits}) > 1


def test_a_whatif_size_is_the_deciding_policy_at_that_capacity() -> None:
    stream = requests(3, 2000)
    shadows = ShadowSet(OffloadSettings(policy="arc", whatif=(0.5, 2.0), whatif_sample=1.0), 300)
    run_decider("arc", 300, stream, shadows)
    rows = {r["capacity"]: r for r in shadows.rows() if r["role"] == "whatif"}
    assert set(rows) == {150, 600}
    assert rows[150]["hits"] == run_decider("arc", 150, stream)
    assert rows[600]["hits"] == run_decider("arc", 600, stream)
    assert rows[150]["hits"] < rows[600]["hits"]


def test_a_sampled_size_runs_a_smaller_cache_on_its_share_of_the_keys() -> None:
    stream = requests(4, 6000, docs=3000)
    shadows = ShadowSet(OffloadSettings(policy="lru", whatif=(4.0,), whatif_sample=0.25), 1000)
    run_decider("lru", 1000, stream, shadows)
    (shadow,) = shadows.sampled
    assert shadow.chunks == 1000 and shadow.figure.sample_rate == 0.25
    row = shadows.rows()[-1]
    asked = sum(len(keys) for keys in stream)
    # The counts are the sample's, scaled back to the whole stream (a sample by key: a
    # popular key is in it or not at all, so the share of uses varies more than the rate's).
    assert row["asked"] == round(shadow.figure.asked / 0.25) and 0 < shadow.figure.asked < asked
    exact = run_decider("lru", 4000, stream) / asked
    # A small skewed stream is a hard case for a sample by key (a hot document is in it or
    # not); the Mooncake trace at 10k+ chunks holds 0.02 (test_shadows_vllm.py).
    assert abs(row["hit_ratio"] - exact) < 0.03, (row, exact)
    assert abs(row["hit_ratio"] - exact) < abs(row["hit_ratio"] - shadows.decider.hit_ratio) / 3
    # A size whose sample would be small is sampled at the rate that keeps 128 chunks, and a
    # size of fewer runs whole.
    small = ShadowSet(OffloadSettings(policy="lru", whatif=(0.5, 0.1), whatif_sample=0.1), 1000)
    assert [(s.figure.sample_rate, s.chunks) for s in small.sampled] == [(0.256, 128)]
    assert [(s.figure.capacity, s.chunks) for s in small.full] == [(100, 100)]


def test_reconfiguring_keeps_the_shadows_that_stay_and_their_counts() -> None:
    stream = requests(5, 500)
    shadows = ShadowSet(OffloadSettings(policy="lru", shadows=("arc", "s3fifo")), 200)
    run_decider("lru", 200, stream, shadows)
    arc = shadows.full[0]
    before = arc.figure.hits
    shadows.configure(OffloadSettings(policy="lru", shadows=("arc", "lru"), whatif=(2.0,), whatif_sample=1.0))
    assert shadows.full[0] is arc and arc.figure.hits == before
    assert [(f.role, f.policy, f.capacity) for f in shadows.figures()] == [
        ("decider", "lru", 200),
        ("shadow", "arc", 200),
        ("shadow", "lru", 200),
        ("whatif", "lru", 400),
    ]
    # A new deciding policy starts its own figure.
    shadows.configure(OffloadSettings(policy="arc"))
    assert shadows.decider.policy == "arc" and shadows.decider.hits == 0 and not shadows.active
