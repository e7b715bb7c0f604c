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
