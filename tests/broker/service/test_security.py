"""TLS, mutual TLS, bearer tokens and tenant isolation, on a real broker over loopback.

Narrated: two tenants ("acme", "globex") each with a token, one admin token; every refusal
is checked for its status code and for saying what was wrong without echoing a secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from broker.config import ConfigError, JournalConfig, parse_config
from broker.config.security import parse_tokens
from broker.journal import JournalSource
from broker.replay.replay import replay_source
from broker.service.security import Identity, Tokens, bearer_token, stream_tenant, tenant_field
from broker.service.server import RunningBroker, start_broker
from clients.broker_client import BrokerClient, BrokerError, ClientSecurity
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc
from kvbroker.v1 import intent_pb2 as pb
from tests.builders import access, alloc, free, update
from tests.certs import Authority
from tests.conftest import small_config

ACME = "acme-token-0123456789abcdef"
GLOBEX = "globex-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
SECRETS = (ACME, GLOBEX, ADMIN)
TOKENS = f"# tenant tokens\n{ACME} acme\n{GLOBEX} globex\n{ADMIN} * admin\n"


def tokens_file(tmp_path: Path, text: str = TOKENS) -> Path:
    path = tmp_path / "tokens"
    path.write_text(text)
    return path


def secured_config(tmp_path: Path, security: str = "", limits: str = "", journal_url: str = "none"):  # type: ignore[no-untyped-def]
    extra = ""
    if security:
        extra += f"\n[security]\n{security}\n"
    if limits:
        extra += f"\n[limits]\n{limits}\n"
    return small_config(journal_url=journal_url, extra=extra)


@pytest.fixture
async def token_broker(tmp_path: Path) -> AsyncIterator[RunningBroker]:
    config = secured_config(tmp_path, f'tokens_file = "{tokens_file(tmp_path)}"', journal_url=f"file://{tmp_path}/j.journal")
    broker = await start_broker(config)
    try:
        yield broker
    finally:
        await broker.stop(grace=1)


def target(broker: RunningBroker) -> str:
    return f"127.0.0.1:{broker.port}"


def auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def batch(client: str, seq: int, *events: pb.Event, tenant: str = "") -> pb.IntentBatch:
    return pb.IntentBatch(client_id=client, batch_seq=seq, events=list(events), tenant=tenant)


async def submit(channel: grpc.aio.Channel, token: str | None, b: pb.IntentBatch, *, hello_tenant: str = "") -> spb.SubmitResponse:
    stub = spb_grpc.BrokerServiceStub(channel)
    hello = spb.Hello(schema_major=1, client_id=b.client_id, tenant=hello_tenant)
    metadata = auth(token) if token is not None else None
    response: spb.SubmitResponse = await stub.Submit(spb.SubmitRequest(hello=hello, batch=b), metadata=metadata, timeout=10)
    return response


async def rpc_code(call: object) -> grpc.StatusCode:
    """The status a refused call ends with (and its details must name no secret)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    details = info.value.details() or ""
    assert not any(secret in details for secret in SECRETS), details
    return info.value.code()


# ---- tokens ----------------------------------------------------------------------------------


async def test_a_call_without_a_token_or_with_an_unknown_one_is_unauthenticated(token_broker: RunningBroker, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.DEBUG)
    async with grpc.aio.insecure_channel(target(token_broker)) as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        # No token at all: the unary and the streaming RPC are both refused before the servicer.
        assert await rpc_code(submit(channel, None, batch("e", 1, alloc("x")))) == grpc.StatusCode.UNAUTHENTICATED
        stream = stub.Stream(metadata=None)
        # The refusal may end the call before the hello is written (the write then raises)
        # or after: either way the call's status is the check.
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await stream.write(spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id="e")))
        assert await rpc_code(stream.read()) == grpc.StatusCode.UNAUTHENTICATED
        # A token the broker does not know, and a malformed header.
        wrong = "wrong-token-0123456789abcdef"
        assert await rpc_code(submit(channel, wrong, batch("e", 1, alloc("x")))) == grpc.StatusCode.UNAUTHENTICATED
        basic = stub.GetResidency(spb.GetResidencyRequest(block_id="x"), metadata=(("authorization", f"Basic {ACME}"),))
        assert await rpc_code(basic) == grpc.StatusCode.UNAUTHENTICATED
        # Nothing of it reached the state.
        assert not token_broker.service.core.blocks
        # Health stays open for probes, token or not.
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="kvbroker.v1.BrokerService"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # The right token works.
        ok = await submit(channel, ACME, batch("e", 1, alloc("x")))
        assert ok.directives.accepted_events == 1 and not ok.directives.rejections
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "refused" in logged
    assert not any(secret in logged for secret in (*SECRETS, wrong))


async def test_admin_rpcs_need_an_admin_token(token_broker: RunningBroker) -> None:
    async with grpc.aio.insecure_channel(target(token_broker)) as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        for call in (
            lambda md: stub.GetStats(spb.GetStatsRequest(), metadata=md),
            lambda md: stub.GetConfig(spb.GetConfigRequest(), metadata=md),
            lambda md: stub.Reload(spb.ReloadRequest(), metadata=md),
            # Tier totals are broker-wide: a tenant may not see them either.
            lambda md: stub.GetResidency(spb.GetResidencyRequest(totals=True), metadata=md),
        ):
            assert await rpc_code(call(auth(ACME))) == grpc.StatusCode.PERMISSION_DENIED
        stats = await stub.GetStats(spb.GetStatsRequest(), metadata=auth(ADMIN))
        assert stats.policy == "lru"
        config = await stub.GetConfig(spb.GetConfigRequest(), metadata=auth(ADMIN))
        assert config.config_generation == 1
        # The config the broker shows holds the tokens file's path, never a token.
        assert "tokens_file" in config.config_toml and not any(secret in config.config_toml for secret in SECRETS)
        totals = await stub.GetResidency(spb.GetResidencyRequest(totals=True), metadata=auth(ADMIN))
        assert [t.name for t in totals.tiers] == ["hbm", "dram", "nvme"]


async def test_tokens_rotate_when_the_file_changes(tmp_path: Path) -> None:
    path = tokens_file(tmp_path)
    broker = await start_broker(secured_config(tmp_path, f'tokens_file = "{path}"'))
    try:
        async with grpc.aio.insecure_channel(target(broker)) as channel:
            assert (await submit(channel, ACME, batch("e", 1, alloc("a")))).directives.accepted_events == 1
            fresh = "acme-rotated-0123456789abcdef"
            path.write_text(f"{fresh} acme\n{ADMIN} * admin\n")
            # The file is looked at again at most once a second, on the next call.
            seq = 1
            for _ in range(40):
                await asyncio.sleep(0.1)
                try:
                    await submit(channel, ACME, batch("e", seq + 1, alloc(f"b{seq}")))
                    seq += 1
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    break
            else:
                pytest.fail("the old token still works 4 s after the tokens file changed")
            assert (await submit(channel, fresh, batch("e", seq + 1, alloc("new")))).directives.accepted_events == 1
            # A tokens file that no longer parses keeps the table in force.
            path.write_text("this line is not TOKEN TENANT [admin] at all\n")
            await asyncio.sleep(1.2)
            assert (await submit(channel, fresh, batch("e", seq + 2, alloc("newer")))).directives.accepted_events == 1
    finally:
        await broker.stop(grace=1)


# ---- tenants ---------------------------------------------------------------------------------


def codes(response: spb.SubmitResponse) -> list[tuple[int, str, str]]:
    return [(r.event_index, r.field, r.code) for r in response.directives.rejections]


async def test_a_tenant_sees_and_touches_only_its_own_blocks(token_broker: RunningBroker) -> None:
    async with grpc.aio.insecure_channel(target(token_broker)) as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        # acme allocates x and y; the broker records them as acme's.
        first = await submit(channel, ACME, batch("engine", 1, alloc("x", request_id="r"), alloc("y", request_id="r")))
        assert first.directives.accepted_events == 2
        assert token_broker.service.core.blocks["x"].tenant == "acme"
        # globex uses the same client id: tenants have separate client id spaces, so its
        # batch_seq 1 is not a duplicate of acme's.
        mine = await submit(channel, GLOBEX, batch("engine", 1, alloc("g")))
        assert mine.directives.accepted_events == 1 and not mine.directives.duplicate
        # Every way for globex to touch acme's block is refused, event by event.
        refused = await submit(
            channel,
            GLOBEX,
            batch(
                "engine",
                2,
                access("x", ts=1),
                update("x", ts=1, priority=pb.PRIORITY_HOT),
                free("y", ts=1),
                alloc("x", ts=1),  # prefix reuse of another tenant's block
                access("g", ts=2),  # its own block: fine
            ),
        )
        assert codes(refused) == [
            (0, "accessed.block_ids[0]", "PERMISSION_DENIED"),
            (1, "intent_updated.block_id", "PERMISSION_DENIED"),
            (2, "freed.block_ids[0]", "PERMISSION_DENIED"),
            (3, "allocated.intent.block_id", "PERMISSION_DENIED"),
        ]
        assert refused.directives.accepted_events == 1
        assert all("another tenant" in r.reason and "acme" not in r.reason for r in refused.directives.rejections)
        assert set(token_broker.service.core.blocks) == {"x", "y", "g"}
        # Queries: another tenant's block is as unknown as a block that does not exist.
        assert await rpc_code(stub.GetResidency(spb.GetResidencyRequest(block_id="x"), metadata=auth(GLOBEX))) == grpc.StatusCode.NOT_FOUND
        seen = await stub.GetResidency(spb.GetResidencyRequest(block_id="x"), metadata=auth(ACME))
        assert [(b.block_id, b.tenant) for b in seen.blocks] == [("x", "acme")]
        by_request = await stub.GetResidency(spb.GetResidencyRequest(request_id="r"), metadata=auth(GLOBEX))
        assert list(by_request.blocks) == []
        # A tenant cannot claim another tenant, in the hello or in the batch.
        wrong_hello = submit(channel, GLOBEX, batch("engine", 3, alloc("h")), hello_tenant="acme")
        assert await rpc_code(wrong_hello) == grpc.StatusCode.PERMISSION_DENIED
        wrong_batch = await submit(channel, GLOBEX, batch("engine", 3, alloc("h"), tenant="acme"))
        assert codes(wrong_batch) == [(-1, "tenant", "PERMISSION_DENIED")]
        # The admin token, bound to no tenant, may act for a tenant it names.
        admin = await submit(channel, ADMIN, batch("ops", 1, free("x")), hello_tenant="acme")
        assert admin.directives.accepted_events == 1 and "x" not in token_broker.service.core.blocks


async def test_the_journal_keeps_each_batch_tenant_so_recovery_and_replay_decide_the_same(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/tenants.journal"
    config = secured_config(tmp_path, f'tokens_file = "{tokens_file(tmp_path)}"', journal_url=url)
    broker = await start_broker(config)
    try:
        async with grpc.aio.insecure_channel(target(broker)) as channel:
            await submit(channel, ACME, batch("engine", 1, *(alloc(f"a{i}", ts=i) for i in range(12))))
            refused = await submit(channel, GLOBEX, batch("engine", 1, access("a0", ts=20), alloc("a1", ts=20), alloc("g0", ts=20)))
            assert len(refused.directives.rejections) == 2
            residency_before = {b.block_id: (b.tier, b.tenant) for b in broker.service.core.blocks.values()}
    finally:
        await broker.stop(grace=1)
    # Recovery rebuilds the tenants of every block and each tenant's batch_seq.
    again = await start_broker(config)
    try:
        core = again.service.core
        assert {b.block_id: (b.tier, b.tenant) for b in core.blocks.values()} == residency_before
        assert core.blocks["g0"].tenant == "globex" and core.blocks["a1"].tenant == "acme"
        async with grpc.aio.insecure_channel(target(again)) as channel:
            duplicate = await submit(channel, GLOBEX, batch("engine", 1, alloc("g9")))
            assert duplicate.directives.duplicate
    finally:
        await again.stop(grace=1)
    # Replay of the journal gives the directives the live broker sent.
    [result] = replay_source(JournalSource(url), ["lru"], verify=True)
    assert result.mismatches == 0 and result.batches == 2


async def test_a_tenant_client_streams_with_its_token(token_broker: RunningBroker) -> None:
    acme = ClientSecurity(token=ACME)
    async with BrokerClient(target(token_broker), "engine", security=acme, max_batch_events=4) as client:
        for i in range(10):
            await client.allocate(f"s{i}", 50, ts_us=i)
        result = await client.flush()
        assert result is not None
    assert {b.tenant for b in token_broker.service.core.blocks.values()} == {"acme"}
    assert ACME not in repr(acme)
    # A wrong token is final: the client fails instead of retrying for ever.
    client = BrokerClient(target(token_broker), "engine", security=ClientSecurity(token="nope-0123456789abcdefgh"))
    with pytest.raises(BrokerError):
        await asyncio.wait_for(client.connect(), 10)
    await client.close(timeout=1)


# ---- TLS and mutual TLS ------------------------------------------------------------------------


async def tls_broker(tmp_path: Path, *, mutual: bool) -> tuple[RunningBroker, Authority, Authority]:
    ca = Authority(tmp_path, "ca")
    rogue = Authority(tmp_path, "rogue")
    server = ca.issue("broker", server=True)
    security = f'tls_cert = "{server.cert}"\ntls_key = "{server.key}"'
    if mutual:
        security += f'\ntls_client_ca = "{ca.ca_path}"'
    broker = await start_broker(secured_config(tmp_path, security))
    return broker, ca, rogue


async def tls_submit(broker: RunningBroker, security: ClientSecurity, seq: int) -> spb.SubmitResponse:
    async with security.aio_channel(f"localhost:{broker.port}") as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        hello = spb.Hello(schema_major=1, client_id="e")
        request = spb.SubmitRequest(hello=hello, batch=batch("e", seq, alloc(f"t{seq}")))
        response: spb.SubmitResponse = await stub.Submit(request, timeout=5)
        return response


async def test_tls_serves_clients_that_trust_its_ca_and_no_one_else(tmp_path: Path) -> None:
    broker, ca, rogue = await tls_broker(tmp_path, mutual=False)
    try:
        ok = await tls_submit(broker, ClientSecurity(tls_ca=str(ca.ca_path)), 1)
        assert ok.directives.accepted_events == 1
        # A client that trusts another CA rejects the broker's certificate.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await tls_submit(broker, ClientSecurity(tls_ca=str(rogue.ca_path)), 2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # Plaintext to a TLS port gets no answer either.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as channel:
            assert await rpc_code(submit(channel, None, batch("e", 3, alloc("p")))) == grpc.StatusCode.UNAVAILABLE
        assert set(broker.service.core.blocks) == {"t1"}
    finally:
        await broker.stop(grace=1)


async def test_mutual_tls_needs_a_client_certificate_from_the_configured_ca(tmp_path: Path) -> None:
    broker, ca, rogue = await tls_broker(tmp_path, mutual=True)
    try:
        good = ca.issue("engine", server=False)
        ok = await tls_submit(broker, ClientSecurity(tls_ca=str(ca.ca_path), tls_cert=str(good.cert), tls_key=str(good.key)), 1)
        assert ok.directives.accepted_events == 1
        # No client certificate: the handshake fails.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await tls_submit(broker, ClientSecurity(tls_ca=str(ca.ca_path)), 2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # A certificate from a CA the broker does not trust: refused the same way.
        stranger = rogue.issue("engine", server=False)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await tls_submit(broker, ClientSecurity(tls_ca=str(ca.ca_path), tls_cert=str(stranger.cert), tls_key=str(stranger.key)), 3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert set(broker.service.core.blocks) == {"t1"}
    finally:
        await broker.stop(grace=1)


def test_tls_config_errors_name_the_key(tmp_path: Path) -> None:
    ca = Authority(tmp_path, "ca")
    server = ca.issue("broker", server=True)
    other = ca.issue("other", server=True)
    cases = {
        f'tls_key = "{server.key}"': "security.tls_key: given without security.tls_cert",
        f'tls_cert = "{server.cert}"': "security.tls_cert: given without security.tls_key",
        f'tls_client_ca = "{ca.ca_path}"': "security.tls_client_ca: mutual TLS needs TLS",
        f'tls_cert = "{tmp_path}/missing.crt"\ntls_key = "{server.key}"': "security.tls_cert: cannot read",
        f'tls_cert = "{server.key}"\ntls_key = "{server.key}"': "security.tls_cert: ",
        f'tls_cert = "{server.cert}"\ntls_key = "{other.key}"': "security.tls_key: does not match",
        f'tls_cert = "{server.cert}"\ntls_key = "{server.key}"\ntls_client_ca = "{server.key}"': "security.tls_client_ca: ",
        "tls_cert = 3": "security.tls_cert: expected a string",
        'tls_certificate = "x"': "unknown key(s) security.tls_certificate",
    }
    for text, message in cases.items():
        with pytest.raises(ConfigError, match=None) as info:
            parse_config(f"[security]\n{text}\n")
        assert message in str(info.value), (text, str(info.value))


def test_token_errors_name_the_entry_and_never_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    short = "short-token"
    cases = {
        f"{short} acme\n": "line 1: the token is shorter than 16 characters",
        f"{ACME} acme\n{ACME} globex\n": "line 2: the same token is given twice",
        f"{ACME}\n": "line 1: expected TOKEN TENANT [admin]",
        f"{ACME} * \n": 'line 1: a tenant token needs a tenant ("*" or none only for admin tokens)',
        f'{{"{ACME}": 3}}': "entry 1: expected a tenant name or a table",
        f'{{"{ACME}": "acme",': "malformed JSON",
        "# nothing here\n": "security.tokens_file: holds no token",
        f"{ACME}é acme\n": "characters a bearer token cannot have",
    }
    for text, message in cases.items():
        path = tokens_file(tmp_path, text)
        with pytest.raises(ConfigError) as info:
            parse_config(f'[security]\ntokens_file = "{path}"\n')
        assert message in str(info.value), (text, str(info.value))
        assert ACME not in str(info.value) and short not in str(info.value)
    with pytest.raises(ConfigError, match=r"security\.tokens_env: the environment variable KVB_TEST_TOKENS is not set"):
        parse_config('[security]\ntokens_env = "KVB_TEST_TOKENS"\n')
    # From the environment, the same token table (';' separates entries on one line).
    monkeypatch.setenv("KVB_TEST_TOKENS", f"{ACME} acme; {ADMIN} * admin")
    config = parse_config('[security]\ntokens_env = "KVB_TEST_TOKENS"\n')
    table = Tokens(config.security).table
    assert sorted((i.tenant, i.admin) for i in table.values()) == [("", True), ("acme", False)]
    assert not any(secret in key for key in table for secret in SECRETS)  # digests only


def test_stream_tenant_and_header_parsing() -> None:
    tenant_token = Identity("acme", False, "t")
    admin = Identity("", True, "t")
    assert stream_tenant(None, "whatever", auth=False) == ""
    assert stream_tenant(tenant_token, "", auth=True) == "acme"
    assert stream_tenant(tenant_token, "acme", auth=True) == "acme"
    assert stream_tenant(admin, "globex", auth=True) == "globex"
    assert stream_tenant(admin, "", auth=True) == ""
    assert bearer_token([("authorization", "Bearer  abc ")]) == "abc"
    assert bearer_token([("authorization", "bearer abc")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("x-other", "Bearer abc")]) is None
    assert bearer_token(None) is None
    # Appending the tenant field to serialized batch bytes sets it (last value wins).
    raw = batch("e", 1, alloc("x"), tenant="spoof").SerializeToString() + tenant_field("t" * 200)
    assert pb.IntentBatch.FromString(raw).tenant == "t" * 200
    assert parse_tokens(f'{{"{ACME}": {{"tenant": "acme", "admin": true}}}}', "w")
    with pytest.raises(ConfigError, match="unknown key"):
        parse_tokens(f'{{"{ACME}": {{"tenant": "acme", "role": "x"}}}}', "w")


# ---- limits ------------------------------------------------------------------------------------


async def test_limits_refuse_with_the_limit_named_and_the_stream_lives(tmp_path: Path) -> None:
    limits = "max_events_per_batch = 3\nmax_streams_per_client = 1\nmax_message_bytes = 4096"
    broker = await start_broker(secured_config(tmp_path, limits=limits))
    try:
        async with grpc.aio.insecure_channel(target(broker)) as channel:
            stub = spb_grpc.BrokerServiceStub(channel)
            # Events per batch: the batch is refused whole, applied and journaled not at all...
            big = await submit(channel, None, batch("e", 1, *(alloc(f"b{i}") for i in range(4))))
            assert codes(big) == [(-1, "events", "INVALID_ARGUMENT")]
            assert "limits.max_events_per_batch = 3" in big.directives.rejections[0].reason
            assert not broker.service.core.blocks
            # ...and the same batch_seq may come again, split.
            ok = await submit(channel, None, batch("e", 1, *(alloc(f"b{i}") for i in range(3))))
            assert ok.directives.accepted_events == 3 and not ok.directives.duplicate
            # Streams per client: the second open stream of "e" is refused, another client is not.
            first = stub.Stream()
            await first.write(spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id="e")))
            assert (await first.read()).HasField("hello")
            second = stub.Stream()
            await second.write(spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id="e")))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await second.read()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limits.max_streams_per_client = 1" in (info.value.details() or "")
            other = stub.Stream()
            await other.write(spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id="f")))
            assert (await other.read()).HasField("hello")
            # Message size: gRPC refuses it before it is read; the open stream goes on.
            huge = batch("g", 1, alloc("z" * 8000))
            assert await rpc_code(submit(channel, None, huge)) == grpc.StatusCode.RESOURCE_EXHAUSTED
            await first.write(spb.StreamRequest(batch=batch("e", 2, access("b0", ts=5))))
            answer = await first.read()
            assert answer.directives.accepted_events == 1
            first.cancel()
            other.cancel()
            # Once the stream is closed, the client may open one again.
            await asyncio.sleep(0.2)
            again = stub.Stream()
            await again.write(spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id="e")))
            assert (await again.read()).HasField("hello")
            again.cancel()
    finally:
        await broker.stop(grace=1)


async def test_blocks_per_tenant_are_bounded_and_replay_refuses_the_same(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/limits.journal"
    config = secured_config(tmp_path, f'tokens_file = "{tokens_file(tmp_path)}"', "max_blocks_per_tenant = 2", journal_url=url)
    broker = await start_broker(config)
    try:
        async with grpc.aio.insecure_channel(target(broker)) as channel:
            full = await submit(channel, ACME, batch("e", 1, alloc("a0"), alloc("a1"), alloc("a2")))
            assert codes(full) == [(2, "allocated.intent.tenant", "RESOURCE_EXHAUSTED")]
            reason = full.directives.rejections[0].reason
            assert "limits.max_blocks_per_tenant = 2" in reason and "globex" not in reason
            # Another tenant has its own allowance.
            theirs = await submit(channel, GLOBEX, batch("e", 1, alloc("g0"), alloc("g1")))
            assert theirs.directives.accepted_events == 2
            # A free makes room again, and a block named twice in one free counts once.
            room = await submit(channel, ACME, batch("e", 2, free("a0", "a0"), alloc("a2", ts=1), alloc("a3", ts=1)))
            assert codes(room) == [(2, "allocated.intent.tenant", "RESOURCE_EXHAUSTED")]
            held = sorted(b.block_id for b in broker.service.core.blocks.values() if b.tenant == "acme")
            assert held == ["a1", "a2"]
    finally:
        await broker.stop(grace=1)
    # Replay counts and refuses exactly as the live broker did.
    [result] = replay_source(JournalSource(url), ["lru"], verify=True)
    assert result.mismatches == 0 and result.batches == 3


def test_limits_config_errors_name_the_key() -> None:
    for text, message in {
        "max_events_per_batch = -1": "limits.max_events_per_batch: must be >= 0",
        'max_streams_per_client = "4"': "limits.max_streams_per_client: expected int",
        "max_message_bytes = 10": "limits.max_message_bytes: must be in 1KiB..2GiB-1",
        "max_blocks = 3": "unknown key(s) limits.max_blocks",
    }.items():
        with pytest.raises(ConfigError) as info:
            parse_config(f"[limits]\n{text}\n")
        assert message in str(info.value), (text, str(info.value))
    config = parse_config('[limits]\nmax_message_bytes = "8MiB"\nmax_blocks_per_tenant = 7\n')
    assert config.limits.max_message_bytes == 8 * 2**20
    assert config.core.max_blocks_per_tenant == 7
    _ = dataclasses.replace(config, journal=JournalConfig(url="none"))


async def test_status_reaches_a_secured_broker_with_a_token_file(token_broker: RunningBroker, tmp_path: Path) -> None:
    async def status(*flags: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "broker.cli.main", "status", "--target", target(token_broker), "--json", *flags,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "KVBROKER_TOKEN": ""},
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    admin_file = tmp_path / "admin.token"
    admin_file.write_text(ADMIN + "\n")
    code, out, _ = await status("--token-file", str(admin_file))
    assert code == 0 and json.loads(out)["policy"] == "lru"
    tenant_file = tmp_path / "acme.token"
    tenant_file.write_text(ACME + "\n")
    code, _, err = await status("--token-file", str(tenant_file))
    assert code != 0 and "PERMISSION_DENIED" in err and ACME not in err
    code, _, err = await status()
    assert code != 0 and "UNAUTHENTICATED" in err
