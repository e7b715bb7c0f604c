"""vLLM's own scheduler, GPU prefix cache and CPU offload tier, run on CPU with a fake
executor over a trace (issue 39): the engine as it runs, with kvbroker's CachePolicy in it.

- ``settings``: the engine (GPU blocks, CPU bytes, the scheduler's limits, the CPU tier's
  policy) and the cost model that turns steps and transfers into seconds. No vLLM import.
- ``trace``: Mooncake requests as prompts (512-token hash blocks as tokens vLLM hashes
  into its 16-token blocks). No vLLM import.
- ``engine``: vLLM's Scheduler built as vLLM's tests build it, the fake executor, the run.
- ``figures``: what an operator reads of a run (TTFT, throughput, where tokens came from).
"""
