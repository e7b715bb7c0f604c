"""Imports as they run (tests/test_layout.py reads them from the sources): loading kvbroker's
CachePolicy into vLLM must not drag the broker's server in (vllm_integration.decisions_to_vllm
imports the core, journal, config, policies and clients, never broker.service, gRPC or a
server), and the bridge's side (vllm_integration.events_from_vllm) and the hints load no
broker at all."""

from __future__ import annotations

import subprocess
import sys

import pytest

ROOM = (
    "vllm_integration",
    "vllm_integration.decisions_to_vllm",
    "vllm_integration.decisions_to_vllm.settings",
    "vllm_integration.decisions_to_vllm.intent_bytes",
    "vllm_integration.decisions_to_vllm.embedded",
    "vllm_integration.decisions_to_vllm.policy_calls",
    "vllm_integration.decisions_to_vllm.shadows",
    "vllm_integration.decisions_to_vllm.manager_model",
    "vllm_integration.decisions_to_vllm.report",
    "vllm_integration.decisions_to_vllm.reload",
    "vllm_integration.decisions_to_vllm.security_env",
    "vllm_integration.decisions_to_vllm.latency",
)
FROM_VLLM = (
    "vllm_integration.events_from_vllm.zmq_events",
    "vllm_integration.events_from_vllm.to_intents",
    "vllm_integration.events_from_vllm.bridge",
    "vllm_integration.events_from_vllm.bridge_cli",
    "vllm_integration.events_from_vllm.engine_hooks",
    "vllm_integration.hints",
)
FORBIDDEN = ("broker.service", "grpc", "grpc.aio", "broker.replay", "broker.cli")


def imported_after(modules: tuple[str, ...], forbidden: tuple[str, ...] = FORBIDDEN) -> list[str]:
    code = (
        "import sys\n"
        f"for m in {modules!r}: __import__(m)\n"
        f"print(sorted(m for m in sys.modules if m in {forbidden!r} or m.startswith(tuple(f + '.' for f in {forbidden!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return eval(out.stdout)


def test_the_cache_policy_room_imports_no_server_and_no_grpc() -> None:
    assert imported_after((*ROOM, "vllm_integration.hints")) == []


def test_the_events_from_vllm_load_no_broker() -> None:
    assert imported_after(FROM_VLLM, ("broker", "vllm_integration.decisions_to_vllm")) == []


@pytest.mark.vllm
def test_the_policy_vllm_loads_imports_no_server() -> None:
    found = imported_after(("vllm_integration.decisions_to_vllm.cache_policy", "broker.offload.vllm_policy"))
    # vLLM itself may import grpc for its own reasons; what must not come is kvbroker's server.
    assert [m for m in found if m.startswith(("broker.service", "broker.replay", "broker.cli"))] == []
