"""The live broker: gRPC server, service, health, security, limits, telemetry."""

import os

# The broker forks to copy a shadow and to write a snapshot off the event loop
# (broker.service.forked_copy). gRPC's fork handlers, on by default in this process's gRPC,
# crash that child (SIGSEGV or SIGABRT while the server and its threads run: the copy then
# fell back to the event loop, the pause it exists to avoid). The child runs no gRPC, so the
# handlers are turned off, before gRPC starts; an operator's own setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
