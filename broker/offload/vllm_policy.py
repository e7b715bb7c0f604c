"""The path vLLM configs written before the move name (``"cache_policy_module_path":
"broker.offload.vllm_policy"``); the class is vllm_integration.decisions_to_vllm.cache_policy's."""

from vllm_integration.decisions_to_vllm.cache_policy import KvbrokerCachePolicy

__all__ = ["KvbrokerCachePolicy"]
