"""Small synchronous calls for tools: stats and residency of a running broker."""

from __future__ import annotations

import grpc

from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc


def get_stats(target: str, *, timeout: float = 5.0) -> spb.GetStatsResponse:
    with grpc.insecure_channel(target) as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        response: spb.GetStatsResponse = stub.GetStats(spb.GetStatsRequest(), timeout=timeout)
        return response


def get_residency(target: str, request: spb.GetResidencyRequest, *, timeout: float = 5.0) -> spb.GetResidencyResponse:
    with grpc.insecure_channel(target) as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        response: spb.GetResidencyResponse = stub.GetResidency(request, timeout=timeout)
        return response
