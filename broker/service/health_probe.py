"""A gRPC health probe for container health checks: ``python -m broker.service.health_probe``.

    python -m broker.service.health_probe --addr 127.0.0.1:50051 --service kvbroker.v1.BrokerService

Calls ``grpc.health.v1.Health/Check`` once and prints the status. Exit codes (the
conventions of grpc_health_probe): 0 SERVING, 1 any other status (NOT_SERVING, unknown
service), 2 the server could not be reached or answered with an error.
"""

from __future__ import annotations

import argparse
import sys

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_UNREACHABLE = 2


def probe(addr: str, service: str = "", timeout: float = 3.0) -> tuple[int, str]:
    """(exit code, status or error) of one health check."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.NOT_FOUND:
            return EXIT_NOT_SERVING, f"SERVICE_UNKNOWN ({service!r} is not registered)"
        return EXIT_UNREACHABLE, f"{code.name if code else 'UNKNOWN'}: {exc.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return (EXIT_SERVING if response.status == health_pb2.HealthCheckResponse.SERVING else EXIT_NOT_SERVING), name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.service.health_probe", description="check a gRPC server's health service once")
    parser.add_argument("--addr", default="127.0.0.1:50051", help="HOST:PORT of the broker (default 127.0.0.1:50051)")
    parser.add_argument("--service", default="", help='service name to check ("" = the whole server; kvbroker.v1.BrokerService; liveness)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    code, status = probe(args.addr, args.service, args.timeout)
    print(f"{args.addr} {args.service or '(server)'}: {status}", file=sys.stdout if code == EXIT_SERVING else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
