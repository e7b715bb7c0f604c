"""Random settings files written live into kvbroker's policy inside vLLM 0.33's real
CPUOffloadingManager (marker ``vllm``; issue 41's acceptance): every key, values of every
JSON type, extreme numbers, long and invalid strings. Whatever the file holds, nothing
raises into vLLM's calls, each file is either applied (the settings in force become the
file's) or refused with one WARNING line, the watcher thread stays alive, and
``replay --verify`` reproduces the journal across every switch. CI-sized: a bounded number
of examples, files and steps."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from broker.journal import JournalSource
from broker.replay.replay import replay_source
from policies.registry import BUILTIN, policy_class
from vllm_integration.decisions_to_vllm.reload import with_file
from vllm_integration.decisions_to_vllm.settings import READERS, OffloadSettings, SettingsError

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNKS = 48
STEPS = 120
LIVE = sorted(name for name in BUILTIN if not policy_class(name).offline)
PARAMS = sorted({f.name for name in BUILTIN for f in dataclasses.fields(policy_class(name).Params)})

NUMBERS = st.one_of(
    st.integers(min_value=-(10**6), max_value=10**6),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**13, 10**30, 10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-9, 1e-300, 0.5, 1.0, 64.0, 1024.0, 1e10, 1e308, float("nan"), float("inf")]),
)
TEXTS = st.one_of(
    st.sampled_from([*LIVE, "belady", "nope", "", "lru,arc", "0.5,2,4", "evil:Cls", "os:system", "none", "file:///x"]),
    st.text(max_size=40),
    st.sampled_from(["acme\ud800", "\x1b[2J", "t" * 300, "x" * 5000, "\udfff\ud800"]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXTS)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=10),
    st.dictionaries(st.sampled_from([*PARAMS, "bogus"]), SCALARS, max_size=3),
)
KEYS = st.sampled_from(["kvbroker_" + name for name in READERS if name != "settings_file"] + ["kvbroker_polcy", "cpu_bytes_to_use"])


@st.composite
def settings_files(draw: st.DrawFn) -> str:
    """A settings file's text: mostly objects of real keys (a policy and its parameters
    likelier), sometimes no JSON object at all."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.sampled_from(["", "[]", '"lru"', "{", "null", "{}"]))
    keys: dict[str, Any] = {}
    if kind <= 6:
        keys["kvbroker_policy"] = draw(st.sampled_from(LIVE))
        keys["kvbroker_policy_params"] = draw(st.dictionaries(st.sampled_from(PARAMS), NUMBERS, max_size=2))
    keys.update(draw(st.dictionaries(KEYS, VALUES, max_size=3)))
    return json.dumps(keys)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def driver() -> Any:
    from tests.vllm_integration.decisions_to_vllm import manager_driver

    return manager_driver


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, errors="surrogatepass")
    os.replace(tmp, path)


def wait_for(done: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert done(), what


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
# The round-4 findings, always tried: each raised into vLLM's calls or killed the watcher.
@example(['{"kvbroker_tenant": "acme\\ud800"}', '{"kvbroker_policy": "arc"}'], 1)
@example(['{"kvbroker_policy": "lru_k", "kvbroker_policy_params": {"retained_ratio": 1e308}}'], 2)
@example(['{"kvbroker_policy": "lru_k", "kvbroker_policy_params": {"k": 1000000000000000000000000000000}}'], 3)
@example(['{"kvbroker_policy": "s3fifo", "kvbroker_policy_params": {"ghost_ratio": NaN}}'], 4)
@example(['{"kvbroker_settings_poll_s": 1e10}', '{"kvbroker_policy": "arc"}'], 5)
@example(["", "", '{"kvbroker_policy": "arc"}', '{"kvbroker_policy": "arc"}'], 6)  # the same content twice: no change
@given(st.lists(settings_files(), min_size=1, max_size=4), st.integers(0, 2**32))
def test_random_settings_files_live_inside_vllms_manager(files: list[str], seed: int) -> None:
    lines = Lines()
    logger = logging.getLogger("vllm.kvbroker")
    logger.addHandler(lines)
    previous_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with tempfile.TemporaryDirectory() as folder:
            run(Path(folder), files, seed, lines)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(previous_level)


def run(folder: Path, files: list[str], seed: int, lines: Lines) -> None:
    url = f"file://{folder}/vllm.journal"
    path = folder / "kvbroker.json"
    path.write_text("{}")
    manager = driver().kvbroker_manager("lru", CHUNKS, journal=url, settings_file=str(path), settings_poll_s=0.01)
    policy = manager._policy
    live = policy.live
    extra = dict(live._extra)
    previous = path.read_bytes()
    for n, text in enumerate(files):
        before_refused, before = live.refused, live.settings
        write(path, text)
        data = path.read_bytes()
        # What the file should come to: new settings, or a refusal (the reason is the test's
        # own reading; the property is that one of the two happens, in one line). The same
        # content again is no change: judged once, not warned about at every poll.
        same, previous = data == previous, data
        try:
            expected: OffloadSettings | None = with_file(extra, str(path), data, {}, rank=before.rank)
            live._check_frozen(before, expected)
        except SettingsError:
            expected = None
        if same:
            time.sleep(0.05)  # a few polls
            expected = before
        elif expected is None:
            wait_for(lambda count=before_refused + 1: live.refused == count, f"file {n} not refused: {text[:200]!r}")
        else:
            wait_for(lambda new=expected: live._latest == new, f"file {n} not handed over: {text[:200]!r}")
        # vLLM's calls go on; the switch applies at the next one.
        driver().random_stream(manager, seed + n, STEPS, positions=True, docs=6)
        refusals = [r for r in lines.records[:] if r.levelno == logging.WARNING and "refused" in r.getMessage()]
        if expected is None or live.refused > before_refused:
            assert live.refused == before_refused + 1 and live.settings == before
            assert len(refusals) == 1 and "\n" not in refusals[0].getMessage()
        else:
            assert live.settings == expected and refusals == []
        lines.records.clear()
        assert live._thread is not None and live._thread.is_alive()
    translator = policy.translator
    assert translator.stats.errors == 0 and policy.shadow_errors == 0
    policy.close()
    assert not [r for r in lines.records if r.levelno >= logging.ERROR]
    (result,) = replay_source(JournalSource(url), ["lru"], verify=True)
    assert result.mismatches == 0
