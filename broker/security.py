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

Tenant isolation itself is decided in ``broker.apply`` from ``IntentBatch.tenant``, which
the servicer sets from the token (``stream_tenant``) before a batch is applied and
journaled, so replay repeats every tenant check exactly.

grpc is imported where used: broker.config imports this module, and the core and replay
(which import broker.config) stay free of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import ssl
import time
import tomllib
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from broker.wire import length_delimited

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("kvbroker.security")

SERVICE_PREFIX = "/kvbroker.v1.BrokerService/"
# RPCs that need an admin token (GetResidency totals are checked by the servicer).
ADMIN_METHODS = frozenset({"Reload", "GetConfig", "GetStats"})
# RFC 6750 b64token: what a bearer token may be made of.
TOKEN_RE = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
MIN_TOKEN_CHARS = 16
# A tenant of "*" in a tokens file: an admin token not bound to one tenant.
ANY_TENANT = "*"
# How often, at most, the tokens file is checked for a change.
REFRESH_S = 1.0


def _error(message: str) -> Exception:
    # Imported here: broker.config imports this module (for SecurityConfig) at its top.
    from broker.config import ConfigError

    return ConfigError(message)


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    """The ``[security]`` table; every key optional, all off by default."""

    # PEM certificate (chain) and private key of the gRPC port: both or neither.
    tls_cert: str = ""
    tls_key: str = ""
    # PEM CA bundle: clients must present a certificate it signed (mutual TLS).
    tls_client_ca: str = ""
    # Bearer tokens: a file, and/or the name of an environment variable holding the same.
    tokens_file: str = ""
    tokens_env: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def auth(self) -> bool:
        return bool(self.tokens_file or self.tokens_env)

    def toml_lines(self) -> list[str]:
        """The ``[security]`` table as TOML that ``security_config_from_dict`` reads back:
        paths and the variable name only (the tokens are not in the config)."""
        return ["[security]", *(f"{f.name} = {json.dumps(getattr(self, f.name))}" for f in dataclasses.fields(self))]


def security_config_from_dict(table: dict[str, Any]) -> SecurityConfig:
    """Validate the ``[security]`` table of a parsed TOML document, files included (each
    must be readable and hold what it should); unknown keys are errors."""
    if not isinstance(table, dict):
        raise _error(f"security: expected a table, got {table!r}")
    t = dict(table)
    values: dict[str, str] = {}
    for field in dataclasses.fields(SecurityConfig):
        value = t.pop(field.name, "")
        if not isinstance(value, str):
            raise _error(f"security.{field.name}: expected a string, got {value!r}")
        values[field.name] = value
    if t:
        raise _error(f"unknown key(s) {', '.join('security.' + k for k in sorted(t))}")
    config = SecurityConfig(**values)
    validate_security(config)
    return config


def validate_security(config: SecurityConfig) -> None:
    """Check the combination of keys and what the files hold; errors name the key."""
    if config.tls_key and not config.tls_cert:
        raise _error("security.tls_key: given without security.tls_cert (TLS needs both)")
    if config.tls_cert and not config.tls_key:
        raise _error("security.tls_cert: given without security.tls_key (TLS needs both)")
    if config.tls_client_ca and not config.tls_cert:
        raise _error("security.tls_client_ca: mutual TLS needs TLS: set security.tls_cert and security.tls_key")
    if config.tls:
        _tls_material(config)
    if config.auth:
        load_tokens(config)


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise _error(f"security.{key}: cannot read {path}: {exc.strerror or exc}") from exc


def _tls_material(config: SecurityConfig) -> tuple[bytes, bytes, bytes | None]:
    """(key, certificate chain, client CA or None), checked: PEM of the right kind, the key
    matching the certificate, the CA loadable."""
    cert = _read(config.tls_cert, "tls_cert")
    key = _read(config.tls_key, "tls_key")
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise _error(f"security.tls_cert: {config.tls_cert} holds no PEM certificate")
    if b"PRIVATE KEY-----" not in key:
        raise _error(f"security.tls_key: {config.tls_key} holds no PEM private key")
    if b"ENCRYPTED" in key:
        raise _error(f"security.tls_key: {config.tls_key} is encrypted; give the key unencrypted (e.g. a Kubernetes secret)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        raise _error(f"security.tls_key: does not match security.tls_cert, or one of them is not valid PEM ({exc})") from exc
    ca = None
    if config.tls_client_ca:
        ca = _read(config.tls_client_ca, "tls_client_ca")
        if b"-----BEGIN CERTIFICATE-----" not in ca:
            raise _error(f"security.tls_client_ca: {config.tls_client_ca} holds no PEM certificate")
        try:
            ssl.create_default_context(cadata=ca.decode("ascii", errors="replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise _error(f"security.tls_client_ca: {config.tls_client_ca} is not a valid PEM CA bundle ({exc})") from exc
    return key, cert, ca


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of the gRPC port (client certificates required with a client CA),
    or None without TLS. Raises ConfigError naming the key."""
    if not config.tls:
        return None
    import grpc

    key, cert, ca = _tls_material(config)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


# ---- tokens --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """Who a token is: its tenant ("" only for an admin token bound to no tenant) and
    whether it may call the admin RPCs. ``source`` says where it was defined (for logs;
    never the token)."""

    tenant: str
    admin: bool
    source: str


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _identity(token: Any, tenant: Any, admin: Any, where: str) -> tuple[str, Identity]:
    if not isinstance(token, str) or not token:
        raise _error(f"{where}: the token must be a non-empty string")
    if not TOKEN_RE.match(token):
        raise _error(f"{where}: the token has characters a bearer token cannot have (RFC 6750: A-Z a-z 0-9 - . _ ~ + / =)")
    if len(token) < MIN_TOKEN_CHARS:
        raise _error(f"{where}: the token is shorter than {MIN_TOKEN_CHARS} characters")
    if not isinstance(tenant, str):
        raise _error(f"{where}: tenant: expected a string, got {type(tenant).__name__}")
    if not isinstance(admin, bool):
        raise _error(f"{where}: admin: expected true or false, got {type(admin).__name__}")
    if tenant == ANY_TENANT:
        tenant = ""
    if not tenant and not admin:
        raise _error(f'{where}: a tenant token needs a tenant ("{ANY_TENANT}" or none only for admin tokens)')
    return token_digest(token), Identity(tenant, admin, where)


def _mapping_entries(data: Any, where: str) -> Iterable[tuple[str, Identity]]:
    """``{token: tenant}`` or ``{token: {tenant = ..., admin = true}}``; entries are named by
    position, never by the token."""
    if not isinstance(data, dict):
        raise _error(f"{where}: expected a mapping of token to tenant")
    for i, (token, value) in enumerate(data.items(), 1):
        at = f"{where}: entry {i}"
        if isinstance(value, str):
            yield _identity(token, value, False, at)
        elif isinstance(value, dict):
            extra = set(value) - {"tenant", "admin"}
            if extra:
                raise _error(f"{at}: unknown key(s) {', '.join(sorted(extra))} (tenant, admin)")
            yield _identity(token, value.get("tenant", ""), value.get("admin", False), at)
        else:
            raise _error(f"{at}: expected a tenant name or a table {{tenant, admin}}")


def _line_entries(text: str, where: str) -> Iterable[tuple[str, Identity]]:
    """``TOKEN TENANT [admin]`` per line (or separated by ``;``); ``#`` starts a comment."""
    for n, line in enumerate(re.split(r"[\n;]", text), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        at = f"{where}: line {n}"
        if len(words) not in (2, 3) or (len(words) == 3 and words[2] != "admin"):
            raise _error(f"{at}: expected TOKEN TENANT [admin]")
        yield _identity(words[0], words[1], len(words) == 3, at)


def parse_tokens(text: str, where: str, *, toml: bool = False) -> dict[str, Identity]:
    """The token table (sha256 of each token -> Identity) of a tokens file or variable.

    JSON when the text starts with ``{``, TOML when ``toml`` (a ``.toml`` file), else lines.
    Errors name ``where`` and the entry or line, never a token.
    """
    stripped = text.strip()
    entries: Iterable[tuple[str, Identity]]
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise _error(f"{where}: malformed JSON at line {exc.lineno} column {exc.colno}") from None
        entries = _mapping_entries(data, where)
    elif toml:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            raise _error(f"{where}: malformed TOML") from None  # its message may quote a token
        entries = _mapping_entries(data, where)
    else:
        entries = _line_entries(text, where)
    table: dict[str, Identity] = {}
    for digest, identity in entries:
        if digest in table:
            raise _error(f"{identity.source}: the same token is given twice")
        table[digest] = identity
    return table


def _file_tokens(path: str) -> dict[str, Identity]:
    raw = _read(path, "tokens_file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _error(f"security.tokens_file: {path} is not UTF-8 text") from None
    return parse_tokens(text, "security.tokens_file", toml=path.endswith(".toml"))


def _env_tokens(name: str) -> dict[str, Identity]:
    text = os.environ.get(name)
    if text is None:
        raise _error(f"security.tokens_env: the environment variable {name} is not set")
    return parse_tokens(text, "security.tokens_env")


def load_tokens(config: SecurityConfig) -> dict[str, Identity]:
    """The token table from ``tokens_env`` and ``tokens_file``; a token defined in both must
    mean the same there. At least one token is needed."""
    table = _env_tokens(config.tokens_env) if config.tokens_env else {}
    if config.tokens_file:
        for digest, identity in _file_tokens(config.tokens_file).items():
            other = table.get(digest)
            if other is not None and (other.tenant, other.admin) != (identity.tenant, identity.admin):
                raise _error(f"{identity.source}: the same token is in {other.source} with another tenant or admin flag")
            table.setdefault(digest, identity)
    if not table:
        key = "tokens_file" if config.tokens_file else "tokens_env"
        raise _error(f"security.{key}: holds no token (every call would be refused)")
    return table


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
        if signature is None or signature == self._signature:
            return
        self._signature = signature
        try:
            table = load_tokens(self.config)
        except ValueError as exc:  # ConfigError
            self.reload_errors += 1
            log.warning("tokens not reloaded, the previous ones stay in force: %s", exc)
            return
        self.table = table
        self.reloads += 1
        log.info("tokens reloaded from %s: %s", self.config.tokens_file, describe_table(table))

    def lookup(self, token: str) -> Identity | None:
        if self.config.tokens_file:
            now = self._clock()
            if now >= self._next_check:
                self._next_check = now + REFRESH_S
                self.refresh()
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


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only refuses the call."""
    import grpc

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        log.info("refused %s from %s: %s", method, context.peer(), details)
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


class Access:
    """What the servicer asks about a call: who it is, and which tenant it acts for."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

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
    return length_delimited(b"\x22", tenant.encode("utf-8"))  # field 4, wire type 2
