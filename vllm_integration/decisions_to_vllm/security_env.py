"""The sidecar's TLS and token files (the ``KVBROKER_TLS_*`` / ``KVBROKER_TOKEN_FILE``
variables the link reads, as every kvbroker client does), checked when the settings load.

A file that cannot be read used to surface nowhere: the link's connect failed before any
attempt was counted or logged, and the local fallback decided forever. A sidecar that cannot
reach its broker as configured is a bad setting, said when vLLM starts, like the others.
Here, apart from the link, so that loading settings does not import gRPC.
"""

from __future__ import annotations

from collections.abc import Mapping

from clients.regular_file import open_regular

# The variables ClientSecurity.from_env reads that name a file.
FILE_VARIABLES = ("KVBROKER_TLS_CA", "KVBROKER_TLS_CERT", "KVBROKER_TLS_KEY", "KVBROKER_TOKEN_FILE")


def security_problem(env: Mapping[str, str]) -> str | None:
    """What is wrong with the security files ``env`` names (first the variable), or None."""
    for name in FILE_VARIABLES:
        path = env.get(name, "")
        if not path or (name == "KVBROKER_TOKEN_FILE" and env.get("KVBROKER_TOKEN")):
            continue  # unset; or the token itself is given, and the file is not read
        try:
            with open_regular(path) as f:
                empty = not f.read(1)
        except OSError as exc:
            return f"{name}: cannot read {path}: {exc.strerror or exc} (sidecar mode reaches the broker with it)"
        if empty:
            return f"{name}: {path} is empty (sidecar mode reaches the broker with it)"
    if bool(env.get("KVBROKER_TLS_CERT")) != bool(env.get("KVBROKER_TLS_KEY")):
        return "KVBROKER_TLS_CERT and KVBROKER_TLS_KEY: give both (mutual TLS) or neither"
    return None
