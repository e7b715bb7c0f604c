"""The short name ``kvbroker`` for vLLM's ``eviction_policy``: a vLLM general plugin.

pyproject.toml declares ``register`` as a ``vllm.general_plugins`` entry point. vLLM 0.33
calls every such entry point in each of its processes (``vllm.plugins.load_general_plugins``:
the API server, the engine core, the workers) before it builds the offloading manager, so a
config says ``"eviction_policy": "kvbroker"`` instead of a class name and a module path.
The module path (``"eviction_policy": "KvbrokerCachePolicy", "cache_policy_module_path":
"vllm_integration.decisions_to_vllm.cache_policy"``) keeps working: vLLM tries its registry
first and the module path only for names it does not know.

Nothing is imported here at module level, and ``register`` imports only vLLM's factory: the
policy's module (the core, policies, the journal) is loaded lazily by vLLM, when a manager
is built with that name, so a vLLM that never names kvbroker pays nothing for the plugin.
"""

from __future__ import annotations

import logging

# Under vLLM's logger (this room runs inside vLLM).
log = logging.getLogger("vllm.kvbroker")

NAME = "kvbroker"
MODULE = "vllm_integration.decisions_to_vllm.cache_policy"
CLASS = "KvbrokerCachePolicy"


def register() -> None:
    """Register ``kvbroker`` with vLLM's CachePolicyFactory (idempotent: vLLM may call its
    plugins more than once in one process, e.g. when a test or a tool loads them again)."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    try:
        CachePolicyFactory.register_cache_policy(NAME, MODULE, CLASS)
    except ValueError:
        # vLLM refuses a second registration of a name: this process registered it already.
        log.debug("cache policy %r was registered already", NAME)
