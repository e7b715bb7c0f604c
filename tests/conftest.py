"""Shared fixtures: configs, an in-process broker on a free loopback port, Redis keys."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from broker import native
from broker.config import BrokerConfig, JournalConfig, parse_config
from broker.service.server import RunningBroker, start_broker
from tests.redis_server import RedisServer, free_port


def pytest_configure(config: pytest.Config) -> None:
    """Compiled modules built from older sources would be tested instead of the code in
    the tree (broker/native.py): refuse to run, saying how to rebuild."""
    problem = native.suite_problem()
    if problem:
        raise pytest.UsageError(problem)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``ray`` need Ray, an optional extra the main venv does not install:
    where it is not importable they are deselected (counted as such in the summary, not
    skipped); .ci/run runs them in a venv with Ray and fails unless they ran."""
    if importlib.util.find_spec("ray") is not None:
        return
    deselected = [item for item in items if item.get_closest_marker("ray") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker("ray") is None]


# Tests marked for an optional extra: what the summary says was not run for want of it.
EXTRA_MARKERS = {
    "vllm": "run by .ci/run's vLLM step, in a venv of their own",
    "ray": "run by .ci/run's Ray step",
    # Not an extra, minutes long: the README's commands on a fresh clone.
    "readme_run": "run by .ci/run's README commands step",
}
DESELECTED = pytest.StashKey[dict[str, int]]()


def _left_out(config: pytest.Config, marker: str) -> bool:
    """Whether this run leaves the extra's tests out: ``-m 'not vllm'`` (the default), or
    Ray not importable. Not ``-k`` choosing other tests, nor the vLLM step's ``-m vllm``."""
    expression = " ".join(str(config.option.markexpr or "").split())
    return f"not {marker}" in expression or (marker == "ray" and importlib.util.find_spec("ray") is None)


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Count the deselected tests of each extra this run leaves out."""
    for item in items:
        counts = item.config.stash.setdefault(DESELECTED, {})
        marker = next((name for name in EXTRA_MARKERS if item.get_closest_marker(name) is not None), None)
        if marker is not None and _left_out(item.config, marker):
            counts[marker] = counts.get(marker, 0) + 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its counts to the controller, which collects nothing itself
    (and so its summary, unlike a run without -n, never said "deselected")."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["kvbroker_deselected"] = session.config.stash.get(DESELECTED, {})


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """xdist: a worker's counts; every worker collects every test, so the largest is the run's."""
    counts = getattr(node, "workeroutput", {}).get("kvbroker_deselected", {})
    config: pytest.Config = node.config  # type: ignore[attr-defined]
    mine = config.stash.setdefault(DESELECTED, {})
    for marker, count in counts.items():
        mine[marker] = max(mine.get(marker, 0), count)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Say what was not run: "1846 passed" read as the whole suite while 127 vLLM and Ray
    tests were deselected, a count the summary of a run with -n does not show."""
    counts = config.stash.get(DESELECTED, {})
    for marker, why in EXTRA_MARKERS.items():
        count = counts.get(marker, 0)
        if count:
            terminalreporter.write_line(f"not run here: {count} {marker}-marked test{'s' if count != 1 else ''} deselected ({why})")


REDIS_URL = os.environ.get("KVBROKER_TEST_REDIS", "redis://127.0.0.1:6379/0")

SMALL_TIERS = """
[[tiers]]
name = "hbm"
capacity = 1000
[[tiers]]
name = "dram"
capacity = 2000
[[tiers]]
name = "nvme"
capacity = 4000
"""


def small_config(policy: str = "lru", journal_url: str = "none", extra: str = "") -> BrokerConfig:
    """Three tiers of 1000/2000/4000 bytes (watermarks 0.95/0.90) on a free port."""
    text = f'[broker]\nlisten = "127.0.0.1:0"\n[policy]\nname = "{policy}"\n{extra}\n{SMALL_TIERS}'
    config = parse_config(text)
    return dataclasses.replace(config, journal=JournalConfig(url=journal_url))


@pytest.fixture
def redis_stream_key() -> Iterator[str]:
    """A fresh stream key on the test Redis, deleted afterwards (with its directives stream)."""
    key = f"kvbroker-test:{uuid.uuid4().hex}"
    yield key
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(key, f"{key}:directives")
    client.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of the test's own on a free port (one it may stop), stopped by pid."""
    server = RedisServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def running_broker(request: pytest.FixtureRequest) -> AsyncIterator[RunningBroker]:
    """A broker on the small tiers; parametrize indirectly with a BrokerConfig to change it."""
    config = getattr(request, "param", None) or small_config()
    broker = await start_broker(config)
    try:
        yield broker
    finally:
        await broker.stop(grace=1)
