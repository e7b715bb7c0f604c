"""Everything kvbroker does with vLLM, in one room, by direction.

- ``events_from_vllm/``: vLLM -> kvbroker. vLLM's KV-cache events (ZMQ) mirrored into a
  broker by the ``kvbroker vllm-bridge`` sidecar, plus the engine hooks. Imports clients/
  and kvbroker.v1, never broker/.
- ``decisions_to_vllm/``: kvbroker -> vLLM. ``KvbrokerCachePolicy``: kvbroker's policies
  choosing the evictions of vLLM's CPU offload tier (embedded core or sidecar mode, shadows
  and what-if sizes, live reload, the report). Imports the broker's core, config, journal
  and policies, never its server, replay or command line.
- ``hints``: a request's ``kvbroker.intent`` on vLLM's KV hints (the helper an orchestrator
  calls, the parser the CachePolicy calls). Imports no broker.
- ``manager_replay/``: ``kvbroker replay --engine vllm``, a trace's requests through the
  emulated CPU offload manager with the CachePolicy deciding (what the policy realizes
  inside vLLM, one request after another).
- ``scheduler_harness/``: ``kvbroker replay --engine vllm-scheduler``, vLLM's own Scheduler,
  GPU prefix cache and CPU tier driven by a fake executor (requests in flight together).
  Both register with replay by dotted path (broker/replay/engines.py): broker/ imports
  neither.
- ``trace_import``: a bridge capture (``--format vllm-events``) as broker events, for
  ``kvbroker replay`` and ``kvbroker import`` (the replay trace registry calls it).

tests/test_layout.py holds these rules; docs/vllm.md and docs/vllm-bridge.md are the guides.
"""
