"""Who may talk to the broker, and over what: TLS, mutual TLS, bearer tokens and tenants.

The ``[security]`` table:

- ``tls_cert`` + ``tls_key`` (PEM files) serve the gRPC port over TLS; ``tls_client_ca`` adds
  mutual TLS: a client must present a certificate signed by that CA, or the handshake fails.
- ``tokens_file`` and/or ``tokens_env`` (the name of an environment variable) turn on
  bearer-token authentication: every call of ``kvbroker.v1.BrokerService`` must carry
  ``authorization: Bearer <token>`` metadata, checked by ``AuthInterceptor`` before the
  call reaches the servicer (no or unknown token: UNAUTHENTICATED, streams included).
  Each token maps to a tenant, and some tokens are admin tokens: Reload, GetConfig,
  GetStats and per-tier totals of GetResidency need one (else PERMISSION_DENIED). The
  health and reflection services stay open, for probes and grpcurl.

Tokens are never logged, never put in an error, never kept in the config (which holds the
file path and the variable name only) and never held in memory in clear: the table maps
``sha256(token)`` to its ``Identity``. The tokens file is read again when it changes (at
most once a second, on the next call), so tokens rotate without a restart; a file that no
longer parses keeps the previous table and says why in the log.

Tenant isolation itself is decided in ``broker.model.apply`` from ``IntentBatch.tenant``, which
the servicer sets from the token (``stream_tenant``) before a batch is applied and
journaled, so replay repeats every tenant check exactly.

The ``[security]`` table and the files it names are read and checked by broker.config.security;
this module serves them. grpc is imported where used, so that importing this module for its
plain helpers (``stream_tenant``, ``tenant_field``) does not load grpc.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

from broker.config.security import REFRESH_S, Identity, SecurityConfig, env_tokens, load_tokens, tls_material, token_digest
from broker.model.pbwire import key, length_delimited
from kvbroker.v1 import intent_pb2 as pb

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("kvbroker.security")

SERVICE_PREFIX = "/kvbroker.v1.BrokerService/"
# RPCs that need an admin token (GetResidency totals are checked by the servicer).
ADMIN_METHODS = frozenset({"Reload", "GetConfig", "GetStats"})
# IntentBatch.tenant's key (``tenant_field`` writes the field by hand: broker.model.pbwire).
_TENANT: Final = key(pb.IntentBatch, "tenant")


# RFC 6750 b64token: what a bearer token may be made of.
def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of the gRPC port (client certificates required with a client CA),
    or None without TLS. Raises ConfigError naming the key."""
    if not config.tls:
        return None
    import grpc

    key, cert, ca = tls_material(config)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


class Tokens:
    """The token table in force; the tokens file is read again when it changes."""

    def __init__(self, config: SecurityConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._signature = self._file_signature()
        self.table = load_tokens(config)
        self._next_check = clock() + REFRESH_S
        self.reloads = 0
        self.reload_errors = 0
        # Bumped whenever the table changes: open streams check their token again then.
        self.generation = 0

    def _file_signature(self) -> tuple[int, int, int] | None:
        if not self.config.tokens_file:
            return None
        try:
            st = os.stat(self.config.tokens_file)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def refresh(self) -> None:
        """Read the tokens again if the file changed (mtime, size or inode: editors and
        Kubernetes secret updates replace it); a table that fails to load is not taken."""
        signature = self._file_signature()
        if signature == self._signature:
            return
        self._signature = signature
        if signature is None:
            # The file is gone: its tokens are revoked (keeping the old table would make
            # deleting the file a revocation that does nothing). tokens_env's stay.
            try:
                self.table = env_tokens(self.config)
            except ValueError:  # the variable is gone too: nothing is left
                self.table = {}
            self.reloads += 1
            self.generation += 1
            log.warning("tokens file %s is gone: its tokens are revoked (%s in force)", self.config.tokens_file, describe_table(self.table))
            return
        try:
            table = load_tokens(self.config)
        except ValueError as exc:  # ConfigError
            self.reload_errors += 1
            log.warning("tokens not reloaded, the previous ones stay in force: %s", exc)
            return
        self.table = table
        self.reloads += 1
        self.generation += 1
        log.info("tokens reloaded from %s: %s", self.config.tokens_file, describe_table(table))

    def maybe_refresh(self) -> None:
        """``refresh`` at most every REFRESH_S (what each lookup does)."""
        if self.config.tokens_file:
            now = self._clock()
            if now >= self._next_check:
                self._next_check = now + REFRESH_S
                self.refresh()

    def lookup(self, token: str) -> Identity | None:
        self.maybe_refresh()
        return self.table.get(token_digest(token))


def describe_table(table: dict[str, Identity]) -> str:
    """What a log may say about a token table: counts, never tokens."""
    admins = sum(1 for i in table.values() if i.admin)
    tenants = len({i.tenant for i in table.values() if i.tenant})
    return f"{len(table)} tokens ({admins} admin) for {tenants} tenants"


def bearer_token(metadata: Iterable[Any] | None) -> str | None:
    """The token of ``authorization: Bearer <token>`` metadata, or None."""
    for item in metadata or ():
        key, value = item[0], item[1]
        if key == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = str(value).strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


# ---- the interceptor and what the servicer asks ------------------------------------------------


# A refused streaming call first takes what the client is sending, within these bounds
# (``drain_requests`` says why).
REFUSE_DRAIN_MESSAGES = 64
REFUSE_DRAIN_IDLE_S = 0.1
REFUSE_DRAIN_S = 1.0


async def drain_requests(requests: AsyncIterator[Any]) -> int:
    """Read what a refused streaming call's client sends, until it half-closes, goes quiet
    for REFUSE_DRAIN_IDLE_S, or the bounds (REFUSE_DRAIN_MESSAGES, REFUSE_DRAIN_S) are
    reached; returns how many messages were read.

    Why: grpc.aio's client reports a write that fails because the call has just ended as
    ``INTERNAL: Internal error from Core``, overwriting the status the server sent
    (grpc/grpc#36066). Refused at once, a client that writes its hello and then reads saw
    INTERNAL instead of UNAUTHENTICATED in about 1 try in 10 (issue 33, item 11). Taking the
    hello (and whatever follows it back to back) first means the client has no write in
    flight when the status arrives. A client that keeps writing past the bounds may still
    meet the client library's bug; the broker's side is bounded either way."""
    read = 0
    deadline = asyncio.get_running_loop().time() + REFUSE_DRAIN_S
    it = aiter(requests)
    while read < REFUSE_DRAIN_MESSAGES:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        try:
            await asyncio.wait_for(anext(it), min(left, REFUSE_DRAIN_IDLE_S if read else left))
        except (StopAsyncIteration, TimeoutError):
            break
        except Exception:  # the client went away or sent garbage: nothing left to take
            break
        read += 1
    return read


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only refuses the call (a streaming
    call after taking what its client sends: ``drain_requests``)."""
    import grpc

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        log.info("refused %s from %s: %s", method, context.peer(), details)
        if handler.request_streaming:
            await drain_requests(request)
        await context.abort(code, details)

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


class AuthInterceptor:
    """Bearer tokens for every BrokerService call; admin tokens for the admin RPCs. Other
    services (health, reflection) pass untouched. A grpc.aio.ServerInterceptor (registered
    as one when made, so this module needs no grpc at import)."""

    def __init__(self, tokens: Tokens) -> None:
        import grpc.aio

        grpc.aio.ServerInterceptor.register(AuthInterceptor)
        self.tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        import grpc

        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if token is None:
            missing = "missing bearer token: send metadata authorization: Bearer <token>"
            return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, missing, method)
        identity = self.tokens.lookup(token)
        if identity is None:
            return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token", method)
        name = method[len(SERVICE_PREFIX) :]
        if name in ADMIN_METHODS and not identity.admin:
            return _deny(handler, grpc.StatusCode.PERMISSION_DENIED, f"{name} needs an admin token", method)
        return handler


class TenantError(Exception):
    """A stream or call asked for a tenant its token does not allow."""


class Revoked:
    """A stream's token was revoked while it was open (the reason, for UNAUTHENTICATED)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class Grant:
    """The token an open stream was let in with, checked again whenever the tokens change
    (at most once a second; a deleted tokens file revokes every token it held)."""

    def __init__(self, tokens: Tokens, token: str | None, identity: Identity | None) -> None:
        self.tokens = tokens
        self.digest = token_digest(token) if token is not None else ""
        self.identity = identity
        self.generation = tokens.generation

    def revoked(self) -> str | None:
        """Why the stream may not go on, or None (O(1) while the tokens are unchanged)."""
        tokens = self.tokens
        tokens.maybe_refresh()
        if tokens.generation == self.generation:
            return None
        self.generation = tokens.generation
        now = tokens.table.get(self.digest)
        if now is None:
            return "bearer token revoked while the stream was open"
        if self.identity is not None and (now.tenant, now.admin) != (self.identity.tenant, self.identity.admin):
            return "bearer token now maps to another tenant or role; open a new stream"
        return None


class Access:
    """What the servicer asks about a call: who it is, and which tenant it acts for."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    def grant(self, context: grpc.aio.ServicerContext) -> Grant:
        """The stream's token, to check again as the tokens change."""
        token = bearer_token(context.invocation_metadata())
        return Grant(self.tokens, token, self.tokens.table.get(token_digest(token)) if token is not None else None)

    def identity(self, context: grpc.aio.ServicerContext) -> Identity | None:
        """The caller (the interceptor already refused calls without a known token)."""
        token = bearer_token(context.invocation_metadata())
        return self.tokens.lookup(token) if token is not None else None


def stream_tenant(identity: Identity | None, requested: str, auth: bool) -> str:
    """The tenant a stream (or Submit) acts for, from its token and ``Hello.tenant``.

    Without authentication: "" (batches are applied as the client sends them). A tenant
    token: its tenant; ``requested`` must be empty or the same. An admin token bound to no
    tenant: ``requested`` (any tenant, or "" for none). Raises TenantError.
    """
    if not auth:
        return ""
    if identity is None:
        raise TenantError("no identity for this call")
    if identity.tenant:
        if requested and requested != identity.tenant:
            raise TenantError(f"hello.tenant: {requested!r} is not the tenant of this token (leave it empty or give the token's)")
        return identity.tenant
    return requested


def query_tenant(identity: Identity | None) -> str | None:
    """The tenant whose blocks a query may see: None (every block) without authentication
    or for an admin token, else the token's tenant."""
    if identity is None or identity.admin:
        return None
    return identity.tenant


def tenant_field(tenant: str) -> bytes:
    """``IntentBatch.tenant`` (field 4, a string) as wire bytes. Appended to a serialized
    batch it sets the field: protobuf takes the last value of a singular field, so the
    journal keeps the client's bytes followed by the tenant the broker decided."""
    return length_delimited(_TENANT, tenant.encode("utf-8"))
