"""The gRPC servicer and ``serve()``: grpc.aio on uvloop, graceful stop on SIGTERM/SIGINT.

The servicer converts between bytes/protobuf and the service and sets statuses; nothing
else. Requests that carry a batch are received as raw bytes, so the journal stores each
batch exactly as the client sent it; with bearer tokens, followed by the tenant the broker
set (``IntentBatch.tenant``, appended as one more field: broker.service.security.tenant_field).
Security (TLS, tokens, tenants) is broker.service.security; limits are broker.service.limits.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError

from broker.config import BrokerConfig, ConfigError
from broker.config.limits import DEFAULT_MAX_MESSAGE_BYTES
from broker.config.settings import check_listen
from broker.journal import Journal, JournalError, JournalRecord, JournalSource, file_path, is_file_url, open_journal
from broker.journal.base import NullJournal
from broker.journal.lease import holder_name
from broker.journal.payloads import BadRecord
from broker.journal.redis_stream import RedisJournal, stream_exists
from broker.journal.redis_urls import is_redis_url
from broker.journal.stream import last_snapshot
from broker.model.apply import client_key
from broker.model.pbwire import key, length_delimited, varint
from broker.model.wire import BatchReader, read_batch
from broker.service import health as broker_health
from broker.service import telemetry as broker_telemetry
from broker.service.broker_service import Answer, BrokerService, UnreadableSnapshot, VersionError
from broker.service.limits import StreamCounts, UnreadAnswers, batch_work, events_refusal, seq_refusal, tenant_refusal, work_refusal
from broker.service.security import (
    Access,
    AuthInterceptor,
    Grant,
    Identity,
    Revoked,
    TenantError,
    Tokens,
    describe_table,
    drain_requests,
    query_tenant,
    server_credentials,
    stream_tenant,
    tenant_field,
)
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as ipb

log = logging.getLogger("kvbroker.server")

SERVICE_NAME = "kvbroker.v1.BrokerService"
# Responses: never smaller than the default, whatever limits.max_message_bytes is.
MAX_MESSAGE_BYTES = DEFAULT_MAX_MESSAGE_BYTES
# Batches of one stream applied and not yet answered, at most (BrokerServicer._answers).
STREAM_PIPELINE = 64
# Keys of the fields the server writes by hand (broker.model.pbwire says why).
_RECEIVED = key(ipb.IntentBatch, "broker_received_us")
_STREAM_DIRECTIVES = key(spb.StreamResponse, "directives")
_SUBMIT_DIRECTIVES = key(spb.SubmitResponse, "directives")


def field_slice(raw: bytes, field_number: int) -> bytes | None:
    """The bytes of one length-delimited top-level field, exactly as on the wire.

    Returns None if the field is absent, repeated (protobuf merges repeats), or the message
    is not well formed; the caller then re-serializes instead.
    """
    pos, end, found = 0, len(raw), None
    try:
        while pos < end:
            key, pos = _varint(raw, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _varint(raw, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                length, pos = _varint(raw, pos)
                if number == field_number:
                    if found is not None:
                        return None
                    found = raw[pos : pos + length]
                pos += length
            else:
                return None
    except IndexError:
        return None
    return found if pos == end else None


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = raw[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def sole_batch(raw: bytes) -> bytes | None:
    """The IntentBatch of a StreamRequest that holds it and nothing else (field 2, what
    every client sends), without parsing it: the batch is read once, by broker.model.wire. None
    for any other shape (a hello, extra or repeated fields, a malformed message)."""
    if not raw or raw[0] != 0x12:  # field 2, length-delimited
        return None
    try:
        length, pos = _varint(raw, 1)
    except IndexError:
        return None
    return raw[pos:] if pos + length == len(raw) else None


def stamped(payload: bytes) -> tuple[bytes, int]:
    """The batch with the time the broker received it (IntentBatch.broker_received_us), as
    it is applied and journaled: the core bounds event time by it (max_clock_skew_us).
    Put in front, so that a malformed batch stays malformed (bytes after a cut-short field
    would be read as part of it); a client's own value would come later and win, so the
    caller refuses a batch whose read value is not the stamp."""
    now = time.time_ns() // 1000
    return _RECEIVED + varint(now) + payload, now


def _forged(batch: BatchReader, stamp: int) -> Answer | None:
    if batch.received_us != stamp:
        return _batch_error("broker_received_us", "set by the broker, not by clients: leave it unset", batch=batch)
    return None


async def _refuse(context: grpc.aio.ServicerContext, requests: AsyncIterator[bytes], code: grpc.StatusCode, details: str) -> NoReturn:
    """End a stream with ``code``, after taking what its client is still sending (bounded:
    broker.service.security.drain_requests says why). Raises, as ``abort`` does."""
    await drain_requests(requests)
    await context.abort(code, details)
    raise AssertionError("not reached: abort raises")


def _batch_error(field: str, reason: str, code: str = "INVALID_ARGUMENT", batch: BatchReader | None = None) -> Answer:
    out = dpb.DirectiveBatch(rejections=[dpb.EventRejection(event_index=-1, field=field, reason=reason, code=code)])
    if batch is not None:
        out.client_id = batch.client_id
        out.batch_seq = batch.batch_seq
    return Answer(out.SerializeToString(), 0, 1, False)


class BrokerServicer:
    def __init__(self, service: BrokerService, access: Access | None = None) -> None:
        """``access``: the bearer tokens in force (None: no authentication)."""
        self.service = service
        self.access = access
        self.stream_counts = StreamCounts()
        service.refused_streams = self.stream_counts.refused  # reported by GetStats

    def _identity(self, context: grpc.aio.ServicerContext) -> Identity | None:
        return self.access.identity(context) if self.access is not None else None

    async def _tenant(self, context: grpc.aio.ServicerContext, hello: spb.Hello) -> str:
        """The tenant the call acts for; a tenant its token does not allow: PERMISSION_DENIED."""
        try:
            return stream_tenant(self._identity(context), hello.tenant, self.access is not None)
        except TenantError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            raise  # not reached: abort raises

    async def Stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[spb.StreamResponse | Answer]:
        service = self.service
        first = await anext(aiter(requests), None)
        if first is None:
            return
        try:
            opening = spb.StreamRequest.FromString(first)
        except DecodeError as exc:
            await _refuse(context, requests, grpc.StatusCode.INVALID_ARGUMENT, f"malformed StreamRequest: {exc}")
        if opening.WhichOneof("kind") != "hello":
            await _refuse(context, requests, grpc.StatusCode.FAILED_PRECONDITION, "the first message of a stream must be a hello")
        try:
            tenant = stream_tenant(self._identity(context), opening.hello.tenant, self.access is not None)
        except TenantError as exc:
            await _refuse(context, requests, grpc.StatusCode.PERMISSION_DENIED, str(exc))
        try:
            reply = service.hello(opening.hello, self._resume_tenant(tenant, opening.hello))
        except VersionError as exc:
            await _refuse(context, requests, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        client_id = opening.hello.client_id
        key = (tenant, client_id)
        refusal = self.stream_counts.enter(key, service.config.limits)
        if refusal is not None:
            await _refuse(context, requests, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        try:
            yield spb.StreamResponse(hello=reply)
            service.streams += 1
            grant = self.access.grant(context) if self.access is not None else None
            try:
                async for answer in self._answers(requests, client_id, tenant, grant):
                    if isinstance(answer, Revoked):
                        service.revoked_streams += 1
                        await _refuse(context, requests, grpc.StatusCode.UNAUTHENTICATED, answer.reason)
                        return  # not reached: abort raises
                    yield answer  # a StreamResponse's directives (stream_response_bytes)
            finally:
                service.streams -= 1
        finally:
            self.stream_counts.leave(key)

    def _resume_tenant(self, tenant: str, hello: spb.Hello) -> str:
        """The tenant whose batch_seq the hello reply reports. Without authentication the
        broker applies batches with the tenant they carry, so the client's hello.tenant
        names it (with tokens, the stream's tenant does)."""
        return tenant if self.access is not None else hello.tenant

    async def _answers(
        self, requests: AsyncIterator[bytes], client_id: str, tenant: str, grant: Grant | None = None
    ) -> AsyncIterator[Answer | Revoked]:
        """The stream's batches, each applied as it arrives and answered in order once
        journaled.

        One task reads and applies, so apply order is arrival order and journal order is
        apply order, as before; this generator answers. The reader does not wait for a
        batch's journal write before applying the next: a client with several batches in
        flight has them written in one journal group, not one round trip each. An answer
        still leaves only when its batch is durable (ack_after = "journal"), so what a
        client saw acknowledged survives a crash. At most ``STREAM_PIPELINE`` batches wait
        for their answers, and answers of at most ``limits.max_unread_answer_bytes`` wait
        for the client to take them (``UnreadAnswers``; issue 33, item 10: 30 streams that
        never read held 441 MiB of answers and slowed everyone's calls); then the reader
        stops reading (gRPC flow control pushes back on the client).

        ``grant``: the stream's bearer token, checked again before each batch once the
        tokens change; a revoked one ends the stream (a ``Revoked`` comes out last, after
        the answers of the batches taken before).
        """
        journal = self.service.journal
        answers: asyncio.Queue[tuple[Answer, int] | BaseException | Revoked | None] = asyncio.Queue()
        room = asyncio.Semaphore(STREAM_PIPELINE)
        unread = UnreadAnswers(self.service.config.limits.max_unread_answer_bytes)

        async def read() -> None:
            try:
                async for raw in requests:
                    if grant is not None:
                        revoked = grant.revoked()
                        if revoked is not None:
                            answers.put_nowait(Revoked(revoked))
                            return
                    item = self._accept_streamed(raw, client_id, tenant)
                    unread.add(len(item[0].data))
                    answers.put_nowait(item)
                    await room.acquire()
                    await unread.room()
            except BaseException as exc:  # the client went away, or a bug: the answerer raises it
                answers.put_nowait(exc)
                raise
            answers.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read(), name=f"stream-reader {client_id}")
        try:
            while True:
                item = await answers.get()
                if item is None:
                    return
                if isinstance(item, Revoked):
                    yield item
                    return
                if isinstance(item, BaseException):
                    raise item
                answer, ordinal = item
                if ordinal:
                    await journal.durable(ordinal)
                room.release()
                yield answer  # resumes once gRPC took it: the client read, or had window
                unread.taken(len(answer.data))
        finally:
            reader.cancel()

    def _accept_streamed(self, raw: bytes, client_id: str, tenant: str) -> tuple[Answer, int]:
        payload = sole_batch(raw)
        if payload is None:  # not the shape clients send: protobuf says what it is
            try:
                request = spb.StreamRequest.FromString(raw)
            except DecodeError as exc:
                return self._refused(_batch_error("batch", f"malformed StreamRequest: {exc}"), "malformed")
            kind = request.WhichOneof("kind")
            if kind is None:
                return self._refused(
                    _batch_error("batch", "empty StreamRequest: neither hello nor batch is set; send a batch"), "malformed"
                )
            if kind != "batch":
                return self._refused(_batch_error("hello", "hello already received on this stream; send batches"), "malformed")
            payload = field_slice(raw, 2)
            if payload is None:
                payload = request.batch.SerializeToString()
        payload, stamp = stamped(payload)
        try:
            batch = read_batch(payload)
        except DecodeError as exc:
            return self._refused(_batch_error("batch", f"malformed StreamRequest: {exc}"), "malformed")
        forged = _forged(batch, stamp)
        if forged is not None:
            return self._refused(forged, "malformed")
        if batch.client_id != client_id:
            mismatch = f"{batch.client_id!r} does not match the stream's hello client_id {client_id!r}"
            return self._refused(_batch_error("client_id", mismatch, batch=batch), "client_id")
        return self._accept(batch, payload, tenant)

    def _refused(self, answer: Answer, reason: str) -> tuple[Answer, int]:
        """A batch refused whole (not applied, not journaled), counted by reason."""
        refused = self.service.refused_batches
        refused[reason] = refused.get(reason, 0) + 1
        return answer, 0

    def _accept(self, batch: BatchReader, payload: bytes, tenant: str) -> tuple[Answer, int]:
        """Limits and the tenant, then the service: a refused batch is not applied or
        journaled. ``batch`` is ``payload`` read (broker.model.wire), stamped with the time
        the broker received it. Returns the answer and the journal ordinal it must wait for
        (0: none)."""
        service = self.service
        limits = service.config.limits
        refusal = events_refusal(batch.count, limits)
        if refusal is not None:
            return self._refused(_batch_error("events", refusal, batch=batch), "events")
        if tenant and batch.tenant != tenant:
            if batch.tenant:
                wrong = f"{batch.tenant!r} is not the stream's tenant (leave it empty)"
                return self._refused(_batch_error("tenant", wrong, "PERMISSION_DENIED", batch), "tenant")
            payload += tenant_field(tenant)  # journaled with the batch: replay checks the same tenant
            batch = read_batch(payload)
        key = client_key(batch.tenant, batch.client_id)
        core = service.core_for(batch.client_id)
        last = core.client_seq.get(key, 0)
        if batch.batch_seq > last:  # (a duplicate is answered as one by the core)
            if not last and batch.tenant:  # the client id's first batch for this tenant
                refusal = tenant_refusal(core, batch.tenant, batch.client_id, limits, from_token=bool(tenant))
                if refusal is not None:
                    return self._refused(_batch_error("tenant", refusal, "RESOURCE_EXHAUSTED", batch), "tenants")
            refusal = seq_refusal(batch.batch_seq, last, limits)
            if refusal is not None:
                return self._refused(_batch_error("batch_seq", refusal, batch=batch), "batch_seq")
            if limits.max_batch_work:
                # Cheap bound first: every block id costs at least 2 bytes on the wire.
                owned = core.owned(key)
                if batch.count + len(payload) // 2 + owned > limits.max_batch_work:
                    refusal = work_refusal(batch_work(batch.events(None), owned), limits)
                    if refusal is not None:
                        return self._refused(_batch_error("events", refusal, "RESOURCE_EXHAUSTED", batch), "work")
        refusal = service.journal.refusal(len(payload))
        if refusal is not None:  # Redis down and the spool full (journal.spool_full = "refuse")
            return self._refused(_batch_error("journal", refusal, "UNAVAILABLE", batch), "journal")
        return service.submit(batch, payload)

    async def Submit(self, raw: bytes, context: grpc.aio.ServicerContext) -> Answer:
        try:
            request = spb.SubmitRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed SubmitRequest: {exc}")
        if not request.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hello: required in a SubmitRequest (schema_major and client_id)")
        tenant = await self._tenant(context, request.hello)
        try:
            self.service.hello(request.hello, tenant)
        except VersionError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if request.batch.client_id != request.hello.client_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "batch.client_id: must equal hello.client_id")
        payload = field_slice(raw, 2)
        if payload is None:
            payload = request.batch.SerializeToString()
        payload, stamp = stamped(payload)
        batch = read_batch(payload)
        forged = _forged(batch, stamp)
        if forged is not None:
            return forged
        result, ordinal = self._accept(batch, payload, tenant)
        if ordinal:
            await self.service.journal.durable(ordinal)
        return result  # a SubmitResponse's directives (submit_response_bytes)

    async def GetResidency(self, request: spb.GetResidencyRequest, context: grpc.aio.ServicerContext) -> spb.GetResidencyResponse:
        tenant = query_tenant(self._identity(context))
        if tenant is not None and request.WhichOneof("query") in (None, "totals"):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "GetResidency totals are broker-wide: they need an admin token")
        response = self.service.residency(request, tenant)
        if response is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"block {request.block_id!r} is not allocated")
        assert response is not None
        return response

    async def GetStats(self, request: spb.GetStatsRequest, context: grpc.aio.ServicerContext) -> spb.GetStatsResponse:
        return self.service.stats()

    async def Reload(self, request: spb.ReloadRequest, context: grpc.aio.ServicerContext) -> spb.ReloadResponse:
        return self.service.reload(request.config_toml or None)

    async def GetConfig(self, request: spb.GetConfigRequest, context: grpc.aio.ServicerContext) -> spb.GetConfigResponse:
        return self.service.get_config()


def stream_response_bytes(message: spb.StreamResponse | Answer) -> bytes:
    """A StreamResponse on the wire. An answer is its DirectiveBatch bytes, wrapped here as
    field 2 (``directives``): building a StreamResponse around it would copy every
    directive once more."""
    if isinstance(message, Answer):
        return length_delimited(_STREAM_DIRECTIVES, message.data)
    return message.SerializeToString()


def submit_response_bytes(answer: Answer) -> bytes:
    """A SubmitResponse on the wire: its one field (1, ``directives``) around the answer."""
    return length_delimited(_SUBMIT_DIRECTIVES, answer.data)


def add_servicer(servicer: BrokerServicer, server: grpc.aio.Server) -> None:
    """Register the service; Stream and Submit take raw bytes (journaled as received)."""
    handlers = {
        "Stream": grpc.stream_stream_rpc_method_handler(
            servicer.Stream, request_deserializer=None, response_serializer=stream_response_bytes
        ),
        "Submit": grpc.unary_unary_rpc_method_handler(
            servicer.Submit, request_deserializer=None, response_serializer=submit_response_bytes
        ),
        "GetResidency": grpc.unary_unary_rpc_method_handler(
            servicer.GetResidency,
            request_deserializer=spb.GetResidencyRequest.FromString,
            response_serializer=spb.GetResidencyResponse.SerializeToString,
        ),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats,
            request_deserializer=spb.GetStatsRequest.FromString,
            response_serializer=spb.GetStatsResponse.SerializeToString,
        ),
        "Reload": grpc.unary_unary_rpc_method_handler(
            servicer.Reload,
            request_deserializer=spb.ReloadRequest.FromString,
            response_serializer=spb.ReloadResponse.SerializeToString,
        ),
        "GetConfig": grpc.unary_unary_rpc_method_handler(
            servicer.GetConfig,
            request_deserializer=spb.GetConfigRequest.FromString,
            response_serializer=spb.GetConfigResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


class RunningBroker:
    """A started broker: its port, service and a way to stop it (used by serve and demo)."""

    def __init__(
        self,
        server: grpc.aio.Server,
        service: BrokerService,
        port: int,
        health: broker_health.Health | None = None,
        telemetry: broker_telemetry.Telemetry | None = None,
    ) -> None:
        self.server = server
        self.service = service
        self.port = port
        self.health = health
        self.telemetry = telemetry

    async def stop(self, grace: float = 5.0) -> None:
        """Stop taking calls, let running ones finish within ``grace``, write the trailers
        (what this process journaled, by client: replay --verify counts the journal's batches
        against them) and flush the journal."""
        if self.health is not None:
            await self.health.stop()  # NOT_SERVING first: probes and balancers stop sending
        await self.server.stop(grace)
        self.service.write_trailers()
        await self.service.journal.close()
        if self.telemetry is not None:
            await self.telemetry.stop()  # last: the final OTLP push sees the flushed journal


def journal_for(config: BrokerConfig) -> Journal:
    """The journal ``config`` names, with its spool, not yet started."""
    j = config.journal
    return open_journal(
        j.url,
        stream=config.stream_key(),
        maxlen=j.maxlen,
        fsync=j.fsync,
        max_group=j.max_group,
        spool_dir=j.spool_dir,
        spool_max_bytes=j.spool_max_bytes,
        spool_full=j.spool_full,
        wait_replicas=j.wait_replicas,
        redis_timeout_s=j.redis_timeout_s,
        lease_s=j.lease_s,
        holder=holder_name(config.broker_id),
    )


def _recoverable(config: BrokerConfig, journal: Journal) -> Iterator[JournalRecord]:
    """The batches and config changes already in the journal, in order (read once the
    writer has cut any torn tail), as a stream: BrokerService applies each as it is read."""
    if not config.journal.recover or isinstance(journal, NullJournal):
        return iter(())
    url = config.journal.url
    if isinstance(journal, RedisJournal):
        if journal.spool_records:  # the start could not drain a leftover spool
            raise JournalError(
                f"cannot recover: {journal.spool_records} spooled records are not yet in {journal.description} "
                f"({journal.last_error}); start again once Redis answers, or set journal.recover = false"
            )
        source = JournalSource(journal.url, journal.stream)
        return source.ordered() if stream_exists(journal.url, journal.stream) else iter(())
    return JournalSource(url).recovery()


def journal_snapshot(config: BrokerConfig) -> tuple[int, int] | None:
    """Where the file journal's last complete snapshot is (broker.journal.stream), if any."""
    try:
        return last_snapshot(file_path(config.journal.url)) if is_file_url(config.journal.url) else None
    except (OSError, JournalError):
        return None


def unreadable(config: BrokerConfig, journal: Journal, exc: BadRecord) -> str:
    """The one line a start refused on a bad journal record says: which record, why, and what
    to do (the broker does not skip it: the state after it would not be the state it had)."""
    url = config.journal.url
    source = JournalSource(journal.url, journal.stream) if isinstance(journal, RedisJournal) else JournalSource(url)
    fix = (
        f"run `kvbroker repair {file_path(url)}` (it cuts that record), then start again"
        if is_file_url(url)
        else "delete that entry, or set journal.recover = false"
    )
    return f"cannot recover from {source.where(exc.index)}: {exc.reason}; the broker does not start on it: {fix}"


async def start_broker(
    config: BrokerConfig,
    config_path: str | None = None,
    overrides: Callable[[BrokerConfig], BrokerConfig] | None = None,
) -> RunningBroker:
    """``overrides`` re-applies command-line settings to a config file read again on reload.
    Raises ConfigError (naming the key) if the certificates or tokens cannot be loaded."""
    security = config.security
    credentials = server_credentials(security)
    tokens = Tokens(security) if security.auth else None
    log.info(
        "security: TLS %s, bearer tokens %s",
        ("on, mutual (client certificates required)" if security.tls_client_ca else "on") if credentials is not None else "off",
        describe_table(tokens.table) if tokens is not None else "off",
    )
    journal = journal_for(config)
    await journal.start()
    try:
        recovered = await asyncio.to_thread(_recoverable, config, journal)
    except BaseException:
        await journal.close()
        raise
    try:
        try:
            service = BrokerService(config, journal, recovered, config_path, overrides)
        except UnreadableSnapshot as exc:
            log.warning("recovery: %s; reading the journal from its first record instead", exc)
            service = BrokerService(config, journal, JournalSource(config.journal.url).ordered(), config_path, overrides)
        except BadRecord:
            if isinstance(journal, RedisJournal) or journal_snapshot(config) is None:
                raise
            # Met after a snapshot: its number counts from the snapshot's mark. Read from the
            # first record, to name it as `repair` and the refusal's fix do.
            BrokerService(config, journal, JournalSource(config.journal.url).ordered(), config_path, overrides)
            raise
    except BadRecord as exc:
        await journal.close()
        raise JournalError(unreadable(config, journal, exc)) from None
    except BaseException:  # a damaged journal met as it is read (JournalError), or worse
        await journal.close()
        raise
    if service.recovered_batches:
        log.info("recovered %d batches from %s", service.recovered_batches, journal.description)
    server = grpc.aio.server(
        interceptors=[AuthInterceptor(tokens)] if tokens is not None else None,
        options=[
            # grpc.aio sets SO_REUSEPORT by default: a second broker on the same port would
            # start and take half the clients (and, on one journal directory, lose events).
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", config.limits.max_message_bytes),
            ("grpc.max_send_message_length", max(MAX_MESSAGE_BYTES, config.limits.max_message_bytes)),
        ],
    )
    add_servicer(BrokerServicer(service, Access(tokens) if tokens is not None else None), server)
    health = await broker_health.install(server, service, config)
    try:
        telemetry = await broker_telemetry.install(server, service, config)
    except BaseException:
        await health.stop()
        await journal.close()
        raise
    try:
        check_listen(config.listen)
        port = server.add_secure_port(config.listen, credentials) if credentials is not None else server.add_insecure_port(config.listen)
    except (RuntimeError, ConfigError) as exc:  # grpc raises RuntimeError("Failed to bind ...")
        port = 0
        why = str(exc)
    else:
        why = "the address is in use (another broker?) or not available here"
    if port == 0:
        await health.stop()
        await telemetry.stop()
        await journal.close()
        raise OSError(f"cannot listen on {config.listen}: {why}")
    await server.start()
    return RunningBroker(server, service, port, health, telemetry)


async def watch_config(service: BrokerService, path: str, interval: float = 1.0) -> None:
    """Reload when the config file changes (its mtime, size or inode: ConfigMap updates
    swap a symlink, editors replace the file)."""

    def signature() -> tuple[int, int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    last = signature()
    while True:
        await asyncio.sleep(interval)
        now = signature()
        if now is not None and now != last:
            last = now
            try:
                result = service.reload()
            except Exception:  # the watcher must outlive any surprise: later files still apply
                log.exception("config file changed: the reload failed; the config in force keeps serving")
                continue
            log.info("config file changed: %s", "reloaded" if result.ok else f"refused: {result.error}")


def freeze_startup_heap() -> int:
    """Put every object the process made while starting out of the cyclic garbage
    collector's reach (``gc.freeze``), after one last collection; returns how many.

    Modules, functions, types, protobuf descriptors, gRPC's, Redis's and OpenTelemetry's
    objects, the config: about 50,000 tracked objects, as long-lived as the process. A full
    collection walked them all, about 20 ms here, a pause of every stream: under
    ``kvbroker bench --prefix-cache`` one or two such pauses a run made the whole p99 at
    50% (batch 64, 4 streams, Redis journal: 45-60 ms; 6.6-7.4 ms frozen, and a full
    collection 1-3 ms). What the broker makes later (blocks, policies' records: untracked;
    a reloaded config's cores) is collected as before. Objects made at startup that become
    cyclic garbage later would never be collected: a Core is freed by reference counting
    (no cycles), and the rest lives until exit.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve(
    config: BrokerConfig,
    *,
    config_path: str | None = None,
    on_ready: Callable[[RunningBroker], None] | None = None,
    grace: float = 5.0,
    overrides: Callable[[BrokerConfig], BrokerConfig] | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully. SIGHUP, or a change of the
    config file, reloads the config."""
    if config.broker_id == BrokerConfig.broker_id and is_redis_url(config.journal.url):
        log.warning(
            "broker.id is left at its default %r: it names this broker's Redis journal stream (%s); every broker "
            "sharing this Redis needs an id of its own (a second one with the same id is refused while this one holds the stream)",
            config.broker_id,
            config.stream_key(),
        )
    broker = await start_broker(config, config_path, overrides)
    # Here, not in start_broker: tests start brokers inside the test process.
    frozen = freeze_startup_heap()
    log.info("froze %d objects of the startup heap (garbage collector)", frozen, extra={"gc_frozen": frozen})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, broker.service.reload)
    watcher = loop.create_task(watch_config(broker.service, config_path)) if config_path else None
    host = config.listen.rsplit(":", 1)[0]
    log.info(
        "kvbroker %s listening on %s:%d policy=%s journal=%s",
        config.broker_id,
        host,
        broker.port,
        broker.service.policy_name,
        broker.service.journal.description,
    )
    if on_ready is not None:
        on_ready(broker)
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    log.info("stopping: finishing calls (grace %.1fs) and flushing the journal", grace)
    await broker.stop(grace)
    log.info("stopped; journal records written: %d", broker.service.journal.written)


def run(
    config: BrokerConfig,
    config_path: str | None = None,
    on_ready: Callable[[RunningBroker], None] | None = None,
    overrides: Callable[[BrokerConfig], BrokerConfig] | None = None,
) -> None:
    import uvloop

    uvloop.run(serve(config, config_path=config_path, on_ready=on_ready, overrides=overrides))
