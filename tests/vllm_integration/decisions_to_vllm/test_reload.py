"""Switching live (vllm_integration/decisions_to_vllm/reload.py): the settings file, read at start and watched;
a bad one refused while the settings in force keep running; a good one applied on the
translator's thread at its next call, as the next config generation, journaled where it
happened so that replay --verify reproduces every eviction across the switch. Without vLLM
(stand-ins); through vLLM's real manager: test_reload_vllm.py (marker ``vllm``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker.journal import JournalSource
from broker.journal.records import RecordKind
from broker.model.core import Directive
from broker.replay.replay import journal_batches, journal_config, replay, replay_source
from tests.vllm_integration.decisions_to_vllm.fakes import Chunk, Ctx, k
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.policy_calls import Translator
from vllm_integration.decisions_to_vllm.reload import FROZEN, LiveSettings, settings_at_start
from vllm_integration.decisions_to_vllm.settings import OffloadSettings, SettingsError

CAPACITY = 16


class Engine:
    """What KvbrokerCachePolicy builds (without vLLM): settings with the file on top, the
    embedded core, the translator, the live settings."""

    def __init__(self, tmp_path: Path, file: dict[str, Any] | str | None = None, **extra: Any) -> None:
        self.path = tmp_path / "kvbroker.json"
        if file is not None:
            self.write(file)
        self.extra = {"kvbroker_policy": "lru", "kvbroker_settings_file": str(self.path), **{f"kvbroker_{k}": v for k, v in extra.items()}}
        settings, seen = settings_at_start(self.extra, {})
        self.local = EmbeddedCore(settings, CAPACITY)
        self.translator = Translator(self.local, tenant=settings.tenant)
        self.live = LiveSettings(
            settings, self.extra, local=self.local, translator=self.translator, capacity=CAPACITY, seen=seen, environ={}
        )

    def write(self, file: dict[str, Any] | str) -> None:
        self.path.write_text(file if isinstance(file, str) else json.dumps(file))

    def switch(self, file: dict[str, Any] | str) -> bool:
        self.write(file)
        return self.live.check()

    @property
    def policy(self) -> str:
        return self.local.core.policy_name


def stream(t: Translator, seed: int, steps: int, at: dict[int, Callable[[], Any]] | None = None) -> list[bytes]:
    """A closed loop as vLLM's manager makes it: stores (evicting one chunk when the tier is
    full), re-uses of stored keys, finished requests. ``at[step]`` runs before that step.
    Returns every victim, in order."""
    rng = random.Random(seed)
    chunks: dict[bytes, Chunk] = {}
    victims: list[bytes] = []
    ctxs = [Ctx(f"r{i}") for i in range(4)]
    for step in range(steps):
        if at and step in at:
            at[step]()
        ctx = rng.choice(ctxs)
        if rng.random() < 0.6 or not chunks:
            # Skewed: some keys come back often (frequency matters to arc, not to lru).
            x = k(int(rng.paretovariate(1.0) * 3) % (CAPACITY * 8))
            if x in chunks:
                t.touch([x], ctx)
                continue
            if len(chunks) >= CAPACITY:
                got = t.evict(1, {x})
                assert got is not None
                for victim, _ in got:
                    del chunks[victim]
                    victims.append(victim)
            chunks[x] = Chunk(0)
            t.insert(x, chunks[x], ctx)
        else:
            keys = rng.sample(sorted(chunks), min(3, len(chunks)))
            t.on_request_finished([keys], set(), set(keys[:1]), ctx)
    return victims


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "settings file refused" in r.getMessage()]


# ---- at start ------------------------------------------------------------------------------


def test_the_file_overrides_the_startup_settings_at_start(tmp_path: Path) -> None:
    engine = Engine(tmp_path, {"kvbroker_policy": "arc", "kvbroker_tenant": "t1"})
    assert (engine.live.settings.policy, engine.live.settings.tenant, engine.policy) == ("arc", "t1", "arc")
    # A key the file leaves out keeps its startup value (here the default).
    assert engine.live.settings.settings_poll_s == 1.0


def test_a_file_not_there_yet_starts_with_the_startup_settings_and_is_watched(tmp_path: Path) -> None:
    engine = Engine(tmp_path)
    assert engine.policy == "lru" and not engine.live.check()  # still nothing there: no warning, no switch
    assert engine.switch({"kvbroker_policy": "arc"})
    engine.translator.evict(1, set())  # nothing to evict, but a decision boundary: the switch applies
    assert engine.policy == "arc"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "not valid JSON"),
        ('["kvbroker_policy", "arc"]', "expected a JSON object of kvbroker_* keys, got list"),
        ('{"kvbroker_polcy": "arc"}', "kvbroker_polcy: unknown key"),
        ('{"cpu_bytes_to_use": 1}', "cpu_bytes_to_use: unknown key"),
        ('{"kvbroker_policy": "nope"}', "kvbroker_policy: "),
        ('{"kvbroker_settings_poll_s": 0}', "kvbroker_settings_poll_s: expected a finite number > 0"),
        ('{"kvbroker_settings_file": "/x.json"}', "kvbroker_settings_file: cannot be set in the settings file itself"),
    ],
)
def test_a_bad_file_at_start_stops_the_start_naming_the_file_and_the_key(tmp_path: Path, content: str, reason: str) -> None:
    with pytest.raises(SettingsError) as caught:
        Engine(tmp_path, content)
    assert str(caught.value).startswith(f"settings file {tmp_path / 'kvbroker.json'}: ")
    assert reason in str(caught.value)


def test_the_poll_interval_is_a_validated_setting() -> None:
    with pytest.raises(SettingsError, match=r"kv_connector_extra_config\.kvbroker_settings_poll_s: expected a number"):
        settings_at_start({"kvbroker_settings_poll_s": "never"}, {})


# ---- live: refused -------------------------------------------------------------------------


def unreadable(engine: Engine) -> None:
    engine.path.unlink()
    engine.path.mkdir()  # open() fails: a directory


BAD: list[tuple[str, Callable[[Engine], None], str]] = [
    ("deleted", lambda e: e.path.unlink(), "unreadable (No such file or directory)"),
    ("unreadable", unreadable, "unreadable (a folder, not a regular file)"),
    ("not JSON", lambda e: e.write('{"kvbroker_policy": "arc"'), "not valid JSON"),
    ("not an object", lambda e: e.write('"arc"'), "expected a JSON object of kvbroker_* keys, got str"),
    ("unknown key", lambda e: e.write({"kvbroker_policy": "arc", "kvbroker_polcy": "s3fifo"}), "kvbroker_polcy: unknown key"),
    ("bad value", lambda e: e.write({"kvbroker_policy": "arc", "kvbroker_policy_params": {"bogus": 1}}), "kvbroker_policy_params: "),
    ("offline policy", lambda e: e.write({"kvbroker_policy": "belady"}), "kvbroker_policy: "),
]


@pytest.mark.parametrize(("spoil", "reason"), [(spoil, reason) for _, spoil, reason in BAD], ids=[name for name, _, _ in BAD])
def test_a_bad_file_is_refused_in_one_line_and_the_settings_in_force_keep_running(
    tmp_path: Path, spoil: Callable[[Engine], None], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(tmp_path, {"kvbroker_policy": "adaptive"})
    before = engine.live.settings
    caplog.set_level(logging.WARNING, logger="vllm.kvbroker")

    def refuse() -> None:
        spoil(engine)
        assert not engine.live.check()
        (line,) = refusals(caplog)
        assert str(engine.path) in line and reason in line and "policy adaptive" in line
        assert not engine.translator.reload_due and engine.live.refused == 1

    # Mid-stream; the run goes on under the settings in force.
    victims = stream(engine.translator, 1, 1200, {600: refuse})
    assert len(victims) > 100 and engine.live.refused == 1
    assert engine.live.settings is before and engine.policy == "adaptive" and engine.local.generation == 1
    # The same bad content is judged once: no warning at every poll.
    assert not engine.live.check() and len(refusals(caplog)) == 1
    # Fixed, it applies.
    if engine.path.is_dir():
        engine.path.rmdir()
    assert engine.switch({"kvbroker_policy": "arc"})
    engine.translator.evict(1, set())
    assert engine.policy == "arc" and engine.local.generation == 2


FROZEN_CHANGES: dict[str, Any] = {
    "mode": "sidecar",
    "journal": "file:///tmp/elsewhere.journal",
    "journal_stream": "other:{client}",
    "journal_flush_ms": 10,
    "journal_exit_s": 1,
    "client_id": "engine-2",
    "broker": "127.0.0.1:1",
    "broker_tier": "cpu1",
    "history_ghosts": 2,
    "report_s": 30,
    "metrics_port": 9,
    "metrics_host": "0.0.0.0",
    "status_file": "/tmp/elsewhere-status.json",
    "status_s": 2,
}


@pytest.mark.parametrize("name", sorted(FROZEN_CHANGES))
def test_a_key_that_cannot_change_while_vllm_runs_is_refused_naming_it(tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(tmp_path, {"kvbroker_policy": "lru"})
    caplog.set_level(logging.WARNING, logger="vllm.kvbroker")
    change = {f"kvbroker_{name}": FROZEN_CHANGES[name], "kvbroker_policy": "arc"}
    if name == "mode":
        change["kvbroker_broker"] = "127.0.0.1:1"  # valid sidecar settings: refused for the mode alone
    assert not engine.switch(change)
    (line,) = refusals(caplog)
    assert f"kvbroker_{name}: cannot change while vLLM runs" in line and str(engine.path) in line
    assert engine.live.settings.policy == "lru" and not engine.translator.reload_due


def test_every_frozen_key_is_a_setting_and_is_tested() -> None:
    names = set(OffloadSettings.__dataclass_fields__)
    assert set(FROZEN) <= names
    assert set(FROZEN) - {"settings_file"} == set(FROZEN_CHANGES)


# ---- live: applied -------------------------------------------------------------------------


def test_a_good_file_switches_the_policy_at_the_next_call_as_the_next_generation(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(tmp_path)
    heard: list[tuple[str, str]] = []
    engine.live.on_reload.append(lambda old, new: heard.append((old.policy, new.policy)))
    stream(engine.translator, 3, 200)
    caplog.set_level(logging.INFO, logger="vllm.kvbroker")
    assert engine.switch({"kvbroker_policy": "adaptive", "kvbroker_tenant": "t9"})
    # Handed over, not applied: the watcher's thread never touches the core.
    assert engine.translator.reload_due and engine.policy == "lru" and engine.live.settings.policy == "lru"
    time.sleep(0.002)  # a new millisecond: the next call's timestamp is a boundary
    engine.translator.touch([next(iter(engine.translator.entries))], Ctx("r"))
    assert engine.policy == "adaptive" and engine.local.generation == 2 and engine.live.settings.policy == "adaptive"
    assert engine.live.settings.tenant == "t9" and engine.translator.tenant == "t9"
    assert heard == [("lru", "adaptive")]
    (line,) = [r.getMessage() for r in caplog.records if "settings reloaded" in r.getMessage()]
    assert line == f"kvbroker: settings reloaded from {engine.path}: policy lru -> adaptive, tenant '' -> t9 (config generation 2)"
    # An unchanged file (rewritten alike) is no switch.
    assert not engine.switch({"kvbroker_policy": "adaptive", "kvbroker_tenant": "t9"})
    # Two changes before a call: the newest wins, one generation.
    assert engine.switch({"kvbroker_policy": "s3fifo"}) and engine.switch({"kvbroker_policy": "arc"})
    engine.translator.evict(1, set())
    assert engine.policy == "arc" and engine.local.generation == 3 and heard[-1] == ("adaptive", "arc")
    # Only the tenant: settings switch, the core's config does not (no new generation).
    assert engine.switch({"kvbroker_policy": "arc", "kvbroker_tenant": "t2"})
    engine.translator.evict(1, set())
    assert engine.translator.tenant == "t2" and engine.local.generation == 3 and len(heard) == 3


def test_sidecar_mode_switches_the_local_fallback_and_the_bound_not_the_tenant(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(tmp_path, None, mode="sidecar", broker="127.0.0.1:1", fallback_policy="lru")

    class Remote:  # the sidecar decider's bound (the link is not built here)
        deadline_s = 0.005

        def evict(self, count: int, protected: list[str]) -> list[str] | None:
            return None

    remote = Remote()
    engine.translator.decider = remote
    assert engine.switch({"kvbroker_policy": "s3fifo", "kvbroker_fallback_policy": "arc", "kvbroker_deadline_ms": 20})
    engine.translator.evict(1, set())
    # The local core runs the fallback; the broker's policy is the broker's (a serve reload).
    assert engine.policy == "arc" and remote.deadline_s == 0.02 and engine.local.generation == 2
    caplog.set_level(logging.WARNING, logger="vllm.kvbroker")
    assert not engine.switch({"kvbroker_fallback_policy": "arc", "kvbroker_tenant": "t1"})
    assert "kvbroker_tenant: cannot change while vLLM runs" in caplog.text


def test_a_listener_that_raises_does_not_reach_vllms_call(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(tmp_path)
    engine.live.on_reload.append(lambda old, new: 1 / 0)
    assert engine.switch({"kvbroker_policy": "arc"})
    assert engine.translator.evict(1, set()) is None  # an empty tier: refused, as before; no exception
    assert engine.policy == "arc" and "a listener of the settings reload failed" in caplog.text


def test_the_watcher_thread_hands_a_change_over(tmp_path: Path) -> None:
    engine = Engine(tmp_path, {"kvbroker_policy": "lru", "kvbroker_settings_poll_s": 0.02})
    engine.live.start()
    try:
        tmp = engine.path.with_suffix(".tmp")  # whole (a rename): never seen half written
        tmp.write_text(json.dumps({"kvbroker_policy": "arc", "kvbroker_settings_poll_s": 0.02}))
        tmp.replace(engine.path)
        deadline = time.monotonic() + 5
        while not engine.translator.reload_due and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.translator.reload_due and engine.policy == "lru"
        engine.translator.evict(1, set())
        assert engine.policy == "arc"
    finally:
        engine.live.close()
    assert engine.live._thread is not None and not engine.live._thread.is_alive() and engine.live.refused == 0


# ---- the journal ---------------------------------------------------------------------------


def test_the_switches_are_journaled_where_they_happened_and_replay_verifies_every_eviction(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/vllm.journal"
    engine = Engine(tmp_path, None, journal=url)
    at = {1500: lambda: engine.switch({"kvbroker_policy": "adaptive"}), 3000: lambda: engine.switch({"kvbroker_policy": "arc"})}
    victims = stream(engine.translator, 7, 4500, at)
    engine.translator.flush()
    engine.local.close()
    assert engine.local.generation == 3 and engine.policy == "arc"
    source = JournalSource(url)
    records = list(source.ordered())
    configs = [(i, r.generation, json.loads(r.payload)["policy"]["name"]) for i, r in enumerate(records) if r.kind == RecordKind.CONFIG]
    assert [(g, name) for _, g, name in configs] == [(1, "lru"), (2, "adaptive"), (3, "arc")]
    # Mid-stream, between batches; each batch carries the generation it was applied under.
    batches = [r.generation for r in records if r.kind == RecordKind.BATCH]
    assert batches == sorted(batches) and set(batches) == {1, 2, 3}
    (result, arc) = replay_source(source, ["lru", "arc"], verify=True)
    # The verified run follows the journal, and is named by the policies it followed.
    assert result.policy == "lru->adaptive->arc" and arc.policy == "arc" and arc.mismatches is None
    assert result.mismatches == 0 and result.metrics["evictions"] == len(victims) > 400
    sink: list[Directive] = []
    first = journal_config(source)
    assert first is not None
    replay(journal_batches(source), first, None, sink=sink)
    assert [d.block_id for d in sink] == [x.hex() for x in victims]
    # The switch really happened: lru alone, on the same stream, evicts otherwise after it.
    (tmp_path / "alone").mkdir()
    lru_victims = stream(Engine(tmp_path / "alone").translator, 7, 4500)
    cut = len([d for d in sink if d.generation == 1])
    assert cut > 100 and lru_victims[:cut] == victims[:cut] and lru_victims[cut:] != victims[cut:]


# ---- issue 41: a setting either applies or is refused in one line, at start and live -------

# Values that passed validation and then raised in vLLM's calls (prepare_store / prepare_load),
# for every new request until the file changed.
RAISED_WHEN_APPLIED: list[tuple[str, str]] = [
    ('{"kvbroker_tenant": "acme\\ud800"}', "kvbroker_tenant: not valid UTF-8 (a lone surrogate at character 4)"),
    ('{"kvbroker_policy": "lru_k", "kvbroker_policy_params": {"retained_ratio": 1e308}}', "retained_ratio must be a number in [0, 1024]"),
    (
        '{"kvbroker_policy": "lru_k", "kvbroker_policy_params": {"retained_ratio": NaN}}',
        "retained_ratio must be a number in [0, 1024], got nan",
    ),
    (
        '{"kvbroker_policy": "lru_k", "kvbroker_policy_params": {"retained_ratio": Infinity}}',
        "retained_ratio must be a number in [0, 1024], got inf",
    ),
    ('{"kvbroker_policy": "s3fifo", "kvbroker_policy_params": {"ghost_ratio": 1e308}}', "ghost_ratio must be a number in [0, 1024]"),
    ('{"kvbroker_policy": "lru_k", "kvbroker_policy_params": {"k": 1000000000000000000000000000000}}', "k must be an integer in [1, 64]"),
    # Timers past what a thread can wait, or so short they spin (issue 41 item 4).
    ('{"kvbroker_settings_poll_s": 1e10}', "kvbroker_settings_poll_s: expected a number in 0.01..3600 (s), got 1e+10"),
    ('{"kvbroker_deadline_ms": 1e13}', "kvbroker_deadline_ms: expected a number in 0.01..60000 (ms)"),
    # What-if sizes: a bounded count, and a bounded sum of simulated chunks (item 5).
    ('{"kvbroker_whatif": "' + ",".join(str(i + 1) for i in range(9)) + '"}', "kvbroker_whatif: at most 8 sizes"),
    ('{"kvbroker_whatif": "64,32", "kvbroker_whatif_sample": 1}', "kvbroker_whatif: the sizes simulate 96 times the tier's chunks"),
    # A tenant's length, as a hint's (item 6).
    ('{"kvbroker_tenant": "' + "t" * 257 + '"}', "kvbroker_tenant: longer than 256 bytes of UTF-8 (257)"),
]


@pytest.mark.parametrize(("content", "reason"), RAISED_WHEN_APPLIED)
def test_a_value_that_would_raise_when_applied_is_refused_at_start_and_live(
    tmp_path: Path, content: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    # At start: one SettingsError naming the file and the key, not a traceback later.
    with pytest.raises(SettingsError) as caught:
        Engine(tmp_path, content)
    assert str(caught.value).startswith(f"settings file {tmp_path / 'kvbroker.json'}: ") and reason in str(caught.value)
    assert "\n" not in str(caught.value)
    # Live: one WARNING line, the settings in force keep running, every call goes on.
    engine = Engine(tmp_path, {"kvbroker_policy": "lru"})
    caplog.set_level(logging.WARNING, logger="vllm.kvbroker")
    victims = stream(engine.translator, 3, 800, {400: lambda: engine.switch(content)})
    (line,) = refusals(caplog)
    assert reason in line and len(victims) > 100
    assert engine.live.settings.policy == "lru" and engine.local.generation == 1


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"kvbroker_report_s": 1e10}, "kv_connector_extra_config.kvbroker_report_s: expected a number in 0.1..86400 (s)"),
        ({"kvbroker_report_s": 1e-9}, "kv_connector_extra_config.kvbroker_report_s: expected a number in 0.1..86400 (s), got 1e-09"),
        ({"kvbroker_journal_flush_ms": 9e12}, "kv_connector_extra_config.kvbroker_journal_flush_ms: expected a number in 1..60000 (ms)"),
        ({"kvbroker_journal_exit_s": 1e300}, "kv_connector_extra_config.kvbroker_journal_exit_s: expected a number in 0.1..3600 (s)"),
        ({"kvbroker_status_s": 1e-9}, "kv_connector_extra_config.kvbroker_status_s: expected a number in 0.01..86400 (s)"),
    ],
)
def test_every_timer_is_bounded_at_start(extra: dict[str, Any], reason: str) -> None:
    with pytest.raises(SettingsError) as caught:
        settings_at_start(extra, {})
    assert str(caught.value).startswith(reason)


def test_a_settings_file_that_is_a_fifo_is_refused_at_start_and_live_without_blocking(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fifo = tmp_path / "kvbroker.json"
    os.mkfifo(fifo)
    # At start: open() on a FIFO waited for a writer forever (vLLM's start hung).
    with pytest.raises(SettingsError, match=r"kvbroker\.json: unreadable \(a FIFO \(named pipe\), not a regular file\)"):
        Engine(tmp_path)
    # Live: the watcher refuses it in one line and stays alive; a good file written after applies.
    fifo.unlink()
    engine = Engine(tmp_path, {"kvbroker_policy": "lru", "kvbroker_settings_poll_s": 0.02})
    caplog.set_level(logging.WARNING, logger="vllm.kvbroker")
    engine.live.start()
    try:
        engine.path.unlink()
        os.mkfifo(engine.path)
        deadline = time.monotonic() + 10
        while not refusals(caplog) and time.monotonic() < deadline:
            time.sleep(0.01)
        (line,) = refusals(caplog)
        assert "a FIFO (named pipe), not a regular file" in line
        engine.path.unlink()
        engine.write({"kvbroker_policy": "arc", "kvbroker_settings_poll_s": 0.02})
        while not engine.translator.reload_due and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.translator.evict(1, set())
        assert engine.policy == "arc"
        assert engine.live._thread is not None and engine.live._thread.is_alive()
    finally:
        engine.live.close()


def test_a_module_policy_named_only_in_the_settings_file_is_refused_before_it_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A module whose import leaves a mark: the settings file must not run its code.
    package = tmp_path / "pkg"
    package.mkdir()
    mark = tmp_path / "imported"
    (package / "evil_policy_41.py").write_text(f"open({str(mark)!r}, 'w').close()\nfrom policies.lru import LRUPolicy as Evil\n")
    monkeypatch.syspath_prepend(str(package))
    for key in ("kvbroker_policy", "kvbroker_fallback_policy", "kvbroker_shadows"):
        content = {key: "evil_policy_41:Evil"}
        with pytest.raises(SettingsError, match="a module:Class policy is loaded only from the start-up configuration"):
            Engine(tmp_path, content)
        engine = Engine(tmp_path, {"kvbroker_policy": "lru"})
        caplog.clear()
        caplog.set_level(logging.WARNING, logger="vllm.kvbroker")
        assert not engine.switch(content)
        (line,) = refusals(caplog)
        assert f"{key}" in line and "not a built-in policy" in line
    assert not mark.exists()
    # Named by the start-up settings (the operator's), it is imported and may be switched to.
    engine = Engine(tmp_path, {"kvbroker_policy": "lru"}, shadows="evil_policy_41:Evil")
    assert mark.exists()
    assert engine.switch({"kvbroker_policy": "evil_policy_41:Evil"})
