"""vLLM -> kvbroker: what vLLM did with its KV cache, mirrored into a broker from outside
vLLM (no patch), so the journal records it and replay compares policies on it.

- ``zmq_events``: vLLM's KV-event publisher as it is on the wire (ZMQ frames, msgpack
  batches), block ids, the seq tracker, the capture files.
- ``to_intents``: those events as broker MemoryIntent events (``EngineTranslator``).
- ``bridge``: the sidecar process: one ``RankBridge`` per data-parallel rank, ZMQ in, gRPC out.
- ``bridge_cli``: the ``kvbroker vllm-bridge`` verb.
- ``engine_hooks``: the intent the scheduler knows and the events cannot carry (decode
  phase, deadlines, drafts), sent for the blocks the bridge named.

Like clients/, this room never imports broker/ (tests/test_layout.py).
"""
