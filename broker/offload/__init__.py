"""Only the old module path vLLM configs name (``broker.offload.vllm_policy``): the vLLM
integration lives in ``vllm_integration/`` (the CachePolicy: ``vllm_integration.decisions_to_vllm``)."""
