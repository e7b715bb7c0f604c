"""The ``[security]`` table, and the files it names: TLS material and bearer-token tables,
read and checked here so a config that names a bad file is refused like any bad key
(broker.service.security serves what they hold).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import ssl
import tomllib
from collections.abc import Iterable
from typing import Any

from broker.config.errors import ConfigError

TOKEN_RE = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
MIN_TOKEN_CHARS = 16
# A tenant of "*" in a tokens file: an admin token not bound to one tenant.
ANY_TENANT = "*"
# How often, at most, the tokens file is checked for a change.
REFRESH_S = 1.0


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
        raise ConfigError(f"security: expected a table, got {table!r}")
    t = dict(table)
    values: dict[str, str] = {}
    for field in dataclasses.fields(SecurityConfig):
        value = t.pop(field.name, "")
        if not isinstance(value, str):
            raise ConfigError(f"security.{field.name}: expected a string, got {value!r}")
        values[field.name] = value
    if t:
        raise ConfigError(f"unknown key(s) {', '.join('security.' + k for k in sorted(t))}")
    config = SecurityConfig(**values)
    validate_security(config)
    return config


def validate_security(config: SecurityConfig) -> None:
    """Check the combination of keys and what the files hold; errors name the key."""
    if config.tls_key and not config.tls_cert:
        raise ConfigError("security.tls_key: given without security.tls_cert (TLS needs both)")
    if config.tls_cert and not config.tls_key:
        raise ConfigError("security.tls_cert: given without security.tls_key (TLS needs both)")
    if config.tls_client_ca and not config.tls_cert:
        raise ConfigError("security.tls_client_ca: mutual TLS needs TLS: set security.tls_cert and security.tls_key")
    if config.tls:
        tls_material(config)
    if config.auth:
        load_tokens(config)


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"security.{key}: cannot read {path}: {exc.strerror or exc}") from exc


def tls_material(config: SecurityConfig) -> tuple[bytes, bytes, bytes | None]:
    """(key, certificate chain, client CA or None), checked: PEM of the right kind, the key
    matching the certificate, the CA loadable."""
    cert = _read(config.tls_cert, "tls_cert")
    key = _read(config.tls_key, "tls_key")
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ConfigError(f"security.tls_cert: {config.tls_cert} holds no PEM certificate")
    if b"PRIVATE KEY-----" not in key:
        raise ConfigError(f"security.tls_key: {config.tls_key} holds no PEM private key")
    if b"ENCRYPTED" in key:
        raise ConfigError(f"security.tls_key: {config.tls_key} is encrypted; give the key unencrypted (e.g. a Kubernetes secret)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"security.tls_key: does not match security.tls_cert, or one of them is not valid PEM ({exc})") from exc
    ca = None
    if config.tls_client_ca:
        ca = _read(config.tls_client_ca, "tls_client_ca")
        if b"-----BEGIN CERTIFICATE-----" not in ca:
            raise ConfigError(f"security.tls_client_ca: {config.tls_client_ca} holds no PEM certificate")
        try:
            ssl.create_default_context(cadata=ca.decode("ascii", errors="replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"security.tls_client_ca: {config.tls_client_ca} is not a valid PEM CA bundle ({exc})") from exc
    return key, cert, ca


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
        raise ConfigError(f"{where}: the token must be a non-empty string")
    if not TOKEN_RE.match(token):
        raise ConfigError(f"{where}: the token has characters a bearer token cannot have (RFC 6750: A-Z a-z 0-9 - . _ ~ + / =)")
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{where}: the token is shorter than {MIN_TOKEN_CHARS} characters")
    if not isinstance(tenant, str):
        raise ConfigError(f"{where}: tenant: expected a string, got {type(tenant).__name__}")
    if not isinstance(admin, bool):
        raise ConfigError(f"{where}: admin: expected true or false, got {type(admin).__name__}")
    if tenant == ANY_TENANT:
        tenant = ""
    if not tenant and not admin:
        raise ConfigError(f'{where}: a tenant token needs a tenant ("{ANY_TENANT}" or none only for admin tokens)')
    return token_digest(token), Identity(tenant, admin, where)


def _mapping_entries(data: Any, where: str) -> Iterable[tuple[str, Identity]]:
    """``{token: tenant}`` or ``{token: {tenant = ..., admin = true}}``; entries are named by
    position, never by the token."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of token to tenant")
    for i, (token, value) in enumerate(data.items(), 1):
        at = f"{where}: entry {i}"
        if isinstance(value, str):
            yield _identity(token, value, False, at)
        elif isinstance(value, dict):
            extra = set(value) - {"tenant", "admin"}
            if extra:
                raise ConfigError(f"{at}: unknown key(s) {', '.join(sorted(extra))} (tenant, admin)")
            yield _identity(token, value.get("tenant", ""), value.get("admin", False), at)
        else:
            raise ConfigError(f"{at}: expected a tenant name or a table {{tenant, admin}}")


def _line_entries(text: str, where: str) -> Iterable[tuple[str, Identity]]:
    """``TOKEN TENANT [admin]`` per line (or separated by ``;``); ``#`` starts a comment."""
    for n, line in enumerate(re.split(r"[\n;]", text), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        at = f"{where}: line {n}"
        if len(words) not in (2, 3) or (len(words) == 3 and words[2] != "admin"):
            raise ConfigError(f"{at}: expected TOKEN TENANT [admin]")
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
            raise ConfigError(f"{where}: malformed JSON at line {exc.lineno} column {exc.colno}") from None
        entries = _mapping_entries(data, where)
    elif toml:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            raise ConfigError(f"{where}: malformed TOML") from None  # its message may quote a token
        entries = _mapping_entries(data, where)
    else:
        entries = _line_entries(text, where)
    table: dict[str, Identity] = {}
    for digest, identity in entries:
        if digest in table:
            raise ConfigError(f"{identity.source}: the same token is given twice")
        table[digest] = identity
    return table


def _file_tokens(path: str) -> dict[str, Identity]:
    raw = _read(path, "tokens_file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"security.tokens_file: {path} is not UTF-8 text") from None
    return parse_tokens(text, "security.tokens_file", toml=path.endswith(".toml"))


def _env_tokens(name: str) -> dict[str, Identity]:
    text = os.environ.get(name)
    if text is None:
        raise ConfigError(f"security.tokens_env: the environment variable {name} is not set")
    return parse_tokens(text, "security.tokens_env")


def env_tokens(config: SecurityConfig) -> dict[str, Identity]:
    """The tokens of ``tokens_env`` alone (what is left when the tokens file is deleted)."""
    return _env_tokens(config.tokens_env) if config.tokens_env else {}


def load_tokens(config: SecurityConfig) -> dict[str, Identity]:
    """The token table from ``tokens_env`` and ``tokens_file``; a token defined in both must
    mean the same there. At least one token is needed."""
    table = _env_tokens(config.tokens_env) if config.tokens_env else {}
    if config.tokens_file:
        for digest, identity in _file_tokens(config.tokens_file).items():
            other = table.get(digest)
            if other is not None and (other.tenant, other.admin) != (identity.tenant, identity.admin):
                raise ConfigError(f"{identity.source}: the same token is in {other.source} with another tenant or admin flag")
            table.setdefault(digest, identity)
    if not table:
        key = "tokens_file" if config.tokens_file else "tokens_env"
        raise ConfigError(f"security.{key}: holds no token (every call would be refused)")
    return table
