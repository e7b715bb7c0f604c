"""kvbroker inside an inference engine's own tier manager: vLLM's CPU offloading asks a
``CachePolicy`` which chunks to evict, and kvbroker's is ``broker.offload.vllm_policy``.

- ``settings``: kv_connector_extra_config keys (``kvbroker_*``), environment fallback.
- ``events``: the MemoryIntent events the adapter sends, written as wire bytes.
- ``embedded``: the deterministic core in vLLM's process, and its journal thread.
- ``translate``: vLLM's calls as events, and the decider seam (embedded or sidecar).
- ``vllm_policy``: the class vLLM loads (imports vLLM).
- ``sidecar``, ``sidecar_setup``, ``link``, ``latency``: sidecar mode (a ``kvbroker serve``
  decides under a hard bound; imported only in that mode: it brings gRPC in).

This room imports the core, the journal, the config, policies and clients, never the
server (broker.service) nor gRPC: loading the policy into vLLM must not start or import a
broker (tests/broker/offload/test_imports.py).
"""
