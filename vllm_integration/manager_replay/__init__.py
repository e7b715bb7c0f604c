"""``kvbroker replay --engine vllm``: a Mooncake trace's requests through the emulated CPU
offload manager of vLLM with kvbroker's CachePolicy deciding (engine.py). It lives with the
vLLM integration and registers with replay by name (broker/replay/engines.py): broker/
imports nothing of it."""
