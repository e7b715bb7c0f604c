"""Small synchronous calls for tools: stats and residency of a running broker.

``security`` (TLS, client certificate, bearer token) defaults to ``ClientSecurity.from_env()``
(KVBROKER_TLS_CA, KVBROKER_TOKEN, ...); GetStats needs an admin token when the broker
checks tokens.
"""

from __future__ import annotations

from clients.broker_client import ClientSecurity
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc


def get_stats(target: str, *, timeout: float = 5.0, security: ClientSecurity | None = None) -> spb.GetStatsResponse:
    sec = security if security is not None else ClientSecurity.from_env()
    with sec.channel(target) as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        response: spb.GetStatsResponse = stub.GetStats(spb.GetStatsRequest(), timeout=timeout, metadata=sec.metadata())
        return response


def get_residency(
    target: str, request: spb.GetResidencyRequest, *, timeout: float = 5.0, security: ClientSecurity | None = None
) -> spb.GetResidencyResponse:
    sec = security if security is not None else ClientSecurity.from_env()
    with sec.channel(target) as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        response: spb.GetResidencyResponse = stub.GetResidency(request, timeout=timeout, metadata=sec.metadata())
        return response
