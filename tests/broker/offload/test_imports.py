"""Loading kvbroker into vLLM must not drag the broker's server in: broker.offload imports
the core, journal, config, policies and clients, never broker.service, gRPC or a server."""

from __future__ import annotations

import subprocess
import sys

import pytest

ROOM = (
    "broker.offload",
    "broker.offload.settings",
    "broker.offload.events",
    "broker.offload.embedded",
    "broker.offload.translate",
    "broker.offload.shadows",
    "broker.offload.manager_model",
    "broker.offload.vllm_report",
)
FORBIDDEN = ("broker.service", "grpc", "grpc.aio", "broker.replay", "broker.cli")


def imported_after(modules: tuple[str, ...]) -> list[str]:
    code = (
        "import sys\n"
        f"for m in {modules!r}: __import__(m)\n"
        f"print(sorted(m for m in sys.modules if m in {FORBIDDEN!r} or m.startswith(tuple(f + '.' for f in {FORBIDDEN!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return eval(out.stdout)


def test_the_offload_room_imports_no_server_and_no_grpc() -> None:
    assert imported_after((*ROOM, "clients.kv_hints")) == []


@pytest.mark.vllm
def test_the_policy_vllm_loads_imports_no_server() -> None:
    found = imported_after(("broker.offload.vllm_policy",))
    # vLLM itself may import grpc for its own reasons; what must not come is kvbroker's server.
    assert [m for m in found if m.startswith(("broker.service", "broker.replay", "broker.cli"))] == []
