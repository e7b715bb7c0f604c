"""One writer per Redis journal stream (issue 41 item 9): a second broker on the same stream
is refused while the first holds the lease, naming the stream and the holder; a lease is
taken over only once it expired (or its holder is a dead process of this host); a writer
whose lease was taken over writes nothing more to the stream."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.cli.checks import BadInput
from broker.cli.serve_checks import check_journal
from broker.config import ConfigError, parse_config
from broker.config.settings import JournalConfig
from broker.journal import JournalRecord, RecordKind
from broker.journal.lease import LeaseLost, lease_key, lease_value, token_key
from broker.journal.redis_stream import RedisJournal
from broker.service.server import start_broker
from tests.conftest import REDIS_URL, small_config
from tests.e2e.test_cli import KVBROKER, start_serve


@pytest.fixture
def stream(redis_stream_key: str) -> Iterator[str]:
    yield redis_stream_key
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(lease_key(redis_stream_key), token_key(redis_stream_key))
    client.close()


def lease_config(stream: str, lease_s: float = 10.0) -> object:
    config = small_config()
    return dataclasses.replace(config, journal=JournalConfig(url=REDIS_URL, stream=stream, spool_dir="", lease_s=lease_s))


def record(n: int) -> JournalRecord:
    return JournalRecord(RecordKind.CONFIG, 1, 1, b"%d" % n)


async def test_a_second_broker_on_the_same_stream_is_refused_naming_stream_and_holder(stream: str) -> None:
    first = await start_broker(lease_config(stream))  # type: ignore[arg-type]
    try:
        with pytest.raises(LeaseLost) as info:
            await start_broker(lease_config(stream))  # type: ignore[arg-type]
        message = str(info.value)
        assert f"journal stream {stream!r} is in use by another broker: broker kvbroker (pid {os.getpid()} on " in message
        assert "lease runs" in message and "\n" not in message
        # What `serve` says before it starts (the preflight), one line naming --journal.
        with pytest.raises(BadInput) as said:
            check_journal(lease_config(stream), "--journal")  # type: ignore[arg-type]
        assert said.value.field == "--journal" and f"journal stream {stream!r} is in use" in str(said.value)
    finally:
        await first.stop(grace=0.5)
    # Let go at a clean stop: the next broker starts at once.
    assert not redis.Redis.from_url(REDIS_URL).exists(lease_key(stream))
    second = await start_broker(lease_config(stream))  # type: ignore[arg-type]
    await second.stop(grace=0.5)


async def test_a_lease_whose_holder_is_gone_elsewhere_is_taken_only_once_it_expired(stream: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    other = json.dumps({"token": 1, "holder": "broker kvbroker (pid 4242 on elsewhere)", "host": "elsewhere", "boot": "x", "pid": 4242})
    client.set(lease_key(stream), other, px=1500)
    with pytest.raises(LeaseLost, match="broker kvbroker \\(pid 4242 on elsewhere\\) holds"):
        await start_broker(lease_config(stream))  # type: ignore[arg-type]
    while client.exists(lease_key(stream)):
        await asyncio.sleep(0.1)
    broker = await start_broker(lease_config(stream))  # type: ignore[arg-type]
    await broker.stop(grace=0.5)
    client.close()


async def test_the_lease_of_a_dead_process_of_this_host_is_taken_over_at_once(stream: str) -> None:
    """A broker killed with SIGKILL and restarted at once need not wait for its lease."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    client = redis.Redis.from_url(REDIS_URL)
    value = json.loads(lease_value(1, "broker kvbroker (a killed one)"))
    value["pid"] = dead.pid
    client.set(lease_key(stream), json.dumps(value), px=600_000)
    broker = await start_broker(lease_config(stream))  # type: ignore[arg-type]
    try:
        held = json.loads(client.get(lease_key(stream)) or b"{}")
        assert held["pid"] == os.getpid() and f"pid {os.getpid()}" in held["holder"]
    finally:
        await broker.stop(grace=0.5)
        client.close()


async def test_a_writer_paused_past_its_lease_writes_nothing_once_another_took_the_stream(stream: str) -> None:
    first = RedisJournal(REDIS_URL, stream, maxlen=1000, lease_s=1.0, holder="broker first")
    await first.start()
    first.append(record(1))
    await first.flush()
    assert first.lease is not None
    # Paused (SIGSTOP, swapping): no renewal while the lease runs out.
    task = first.lease._task
    assert task is not None
    task.cancel()
    client = redis.Redis.from_url(REDIS_URL)
    while client.exists(lease_key(stream)):
        await asyncio.sleep(0.1)
    second = RedisJournal(REDIS_URL, stream, maxlen=1000, lease_s=1.0, holder="broker second")
    await second.start()
    second.append(record(2))
    await second.flush()
    # The first one wakes up and writes: its lease is confirmed first, and found taken.
    first.append(record(3))
    for _ in range(100):
        if first.lease.lost:
            break
        await asyncio.sleep(0.05)
    assert "was taken over by another broker: broker second holds" in first.lease.lost
    refusal = first.refusal(10)
    assert refusal is not None and f"journal stream {stream!r}" in refusal and "batch not applied" in refusal
    await asyncio.sleep(0.3)
    payloads = [fields[b"d"] for _, fields in client.xrange(stream)]
    assert payloads == [b"1", b"2"]  # nothing of the first one's after the takeover
    await first.abort()
    await second.close()
    client.close()


async def test_a_lapsed_lease_nobody_took_is_taken_back_before_the_next_write(stream: str) -> None:
    journal = RedisJournal(REDIS_URL, stream, maxlen=1000, lease_s=1.0, holder="broker one")
    await journal.start()
    assert journal.lease is not None and journal.lease._task is not None
    journal.lease._task.cancel()
    client = redis.Redis.from_url(REDIS_URL)
    while client.exists(lease_key(stream)):
        await asyncio.sleep(0.1)
    journal.append(record(1))
    await journal.flush()
    assert not journal.lease.lost
    assert [fields[b"d"] for _, fields in client.xrange(stream)] == [b"1"]
    assert b"broker one" in (client.get(lease_key(stream)) or b"")
    await journal.close()
    assert not client.exists(lease_key(stream))
    client.close()


@pytest.mark.parametrize("value", ["-1", "0.5", "nan", "1e9", '"10"'])
def test_lease_s_is_0_or_a_bounded_number_of_seconds(value: str) -> None:
    with pytest.raises(ConfigError, match=r"journal\.lease_s"):
        parse_config(f"[journal]\nlease_s = {value}\n")


def test_lease_s_defaults_to_10_and_0_turns_it_off() -> None:
    assert parse_config("").journal.lease_s == 10.0
    assert parse_config("[journal]\nlease_s = 0\n").journal.lease_s == 0.0


@pytest.mark.e2e
def test_two_serve_on_one_stream_the_second_is_refused_in_one_line_and_the_default_id_warned(tmp_path: Path, stream: str) -> None:
    url = f"{REDIS_URL}?stream={stream}"
    first, _ = start_serve(tmp_path, "--journal", url)
    try:
        second = subprocess.run(
            [str(KVBROKER), "serve", "--listen", "127.0.0.1:0", "--journal", url],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).parents[3],
        )
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert f"journal stream {stream!r} is in use by another broker: broker kvbroker (pid {first.pid} on " in lines[0]
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=30)
    err = first.stderr.read() if first.stderr else ""
    assert "broker.id is left at its default 'kvbroker'" in err
