"""kvbroker -> vLLM: kvbroker's policies deciding the evictions of vLLM's CPU offload tier.

vLLM 0.33's CPU offloading asks a ``CachePolicy`` which chunks to evict; kvbroker's is
``cache_policy.KvbrokerCachePolicy``, loaded by the name ``kvbroker`` (``plugin``) or by module
path (``broker.offload.vllm_policy``, the path older configs name, re-exports it).

- ``cache_policy``: the class vLLM loads (imports vLLM at module level; ``plugin`` imports
  vLLM's factory when vLLM calls it).
- ``plugin``: the ``vllm.general_plugins`` entry point that registers the name ``kvbroker``.
- ``settings``, ``security_env``: the ``kvbroker_*`` keys of kv_connector_extra_config,
  the environment fallback, the sidecar's TLS and token files.
- ``policy_calls``: vLLM's CachePolicy calls as MemoryIntent events, and the decider seam
  (embedded or sidecar).
- ``intent_bytes``: those events written straight to protobuf wire bytes.
- ``embedded``: the deterministic core in vLLM's process, and its journal thread.
- ``sidecar``, ``sidecar_setup``, ``link``, ``latency``: sidecar mode (a ``kvbroker serve``
  decides under a hard bound; imported only in that mode: it brings gRPC in).
- ``shadows``, ``manager_model``: other policies and sizes run on the same requests
  (what-if), through a model of vLLM's manager (``kvbroker replay --engine vllm`` uses it too).
- ``reload``: ``kvbroker_settings_file``, watched; ``report``: log lines, Prometheus, the
  status file ``kvbroker vllm-status`` reads.

This room imports the core, the journal, the config, policies and clients, never the
server (broker.service), replay, the command line nor gRPC at module level: loading the
policy into vLLM must not start or import a broker (tests/vllm_integration/test_imports.py).
"""
