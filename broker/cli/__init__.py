"""The kvbroker command."""

# Before anything imports gRPC: broker.service turns gRPC's fork handlers off (`serve` forks
# off the event loop; its __init__ says why), one setting for the command and the library.
import broker.service  # noqa: F401
