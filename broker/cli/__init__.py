"""The kvbroker command."""

import os

# Before anything imports gRPC: `serve` forks off the event loop (broker.service.__init__
# says why gRPC's fork handlers are turned off).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
