"""The harness's settings and its cost model: what the engine is (GPU blocks, the CPU tier,
the scheduler's limits, the CPU tier's policy) and how long its work takes.

No vLLM import here: the command line checks settings before vLLM is loaded.

The cost model turns what vLLM's scheduler decided each step into seconds. A step runs the
tokens the scheduler scheduled: its time is the weights read once (every step reads them),
the prefill tokens' compute, and each decoding request's read of its KV cache. Loads from the
CPU tier and stores to it run beside the steps on the host link, one transfer at a time per
direction (PCIe is full duplex), at ``host_link_bytes_per_s``. The defaults are named for one
real GPU and model: Llama-3.1-8B in bf16 on one H100 SXM. Each constant is a setting; its
comment says where the number comes from. What the model leaves out: attention's quadratic
term in prefill (long prompts cost more per token than this says), the CPU's own overheads,
overlap of compute and transfers inside one step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

# vLLM's GPU KV block, in tokens (its default for CUDA).
GPU_BLOCK_TOKENS: Final = 16
# Mooncake's hash ids name blocks of this many tokens.
MOONCAKE_BLOCK_TOKENS: Final = 512
# vLLM's built-in CPU-tier policies (vllm/v1/kv_offload/cpu/policies).
VLLM_POLICIES: Final = ("lru", "arc")


class HarnessError(ValueError):
    """A setting is not usable; the message names it and says why."""


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds for a step's work and for a transfer (defaults: Llama-3.1-8B bf16, one H100 SXM)."""

    # KV bytes per token: 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes (bf16).
    kv_bytes_per_token: int = 131_072
    # Weights read by every step: 8.03e9 parameters x 2 bytes, over HBM3's 3.35 TB/s.
    step_overhead_s: float = 16.06e9 / 3.35e12
    # Prefill compute per token: 2 x 8.03e9 FLOPs over 989 TFLOP/s bf16 dense at 50% use.
    prefill_s_per_token: float = 2 * 8.03e9 / (0.5 * 989e12)
    # A decoding request reads its whole KV cache each step, over HBM at 3.35 TB/s.
    hbm_bytes_per_s: float = 3.35e12
    # CPU <-> GPU, one direction: half of PCIe 5.0 x16's 64 GB/s, what block-wise copies
    # from pinned memory reach (an assumption; measure yours and set it).
    host_link_bytes_per_s: float = 32e9

    def step_seconds(self, prefill_tokens: int, decode_context_tokens: int) -> float:
        """One step: the weights read, ``prefill_tokens`` computed, and decoding requests
        reading ``decode_context_tokens`` tokens of KV cache in all."""
        return (
            self.step_overhead_s
            + prefill_tokens * self.prefill_s_per_token
            + decode_context_tokens * self.kv_bytes_per_token / self.hbm_bytes_per_s
        )

    def transfer_seconds(self, tokens: int) -> float:
        """``tokens`` tokens of KV cache over the host link."""
        return tokens * self.kv_bytes_per_token / self.host_link_bytes_per_s

    def check(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise HarnessError(f"cost.{field.name}: must be > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class HarnessSettings:
    """One engine: its GPU prefix cache, its CPU tier and the policy deciding it, its limits."""

    # vLLM's GPU KV cache, in 16-token blocks (block 0 is vLLM's null block): 24,576 blocks
    # (393k tokens, 48 GiB) is what an H100 80GB keeps for KV beside the 8B weights at vLLM's
    # gpu_memory_utilization 0.9 (72 GB less 16 GB of weights, less activations).
    gpu_blocks: int = 24576
    # vLLM's cpu_bytes_to_use: 0 runs the engine without a CPU tier (no connector).
    cpu_bytes: int = 0
    # The CPU tier's chunk, in tokens (vLLM's block_size in kv_connector_extra_config).
    cpu_chunk_tokens: int = MOONCAKE_BLOCK_TOKENS
    # The CPU tier's policy: "vllm:lru", "vllm:arc" (vLLM's own) or "kvbroker:NAME".
    policy: str = "vllm:lru"
    # kvbroker policy parameters (kvbroker policies only).
    policy_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    # vLLM's store_threshold: a chunk is stored at its Nth offer (1: at once).
    store_threshold: int = 1
    # vLLM's scheduler limits.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Arrival times are the trace's times this many times over (2: half the rate).
    time_scale: float = 1.0
    cost: CostModel = dataclasses.field(default_factory=CostModel)

    @property
    def offloads(self) -> bool:
        return self.cpu_bytes > 0

    @property
    def policy_family(self) -> str:
        return self.policy.partition(":")[0]

    @property
    def policy_name(self) -> str:
        return self.policy.partition(":")[2]

    @property
    def cpu_chunks(self) -> int:
        """The CPU tier's chunks as vLLM counts them (cpu_bytes over one chunk's bytes)."""
        return self.cpu_bytes // (self.cpu_chunk_tokens * self.cost.kv_bytes_per_token)

    @property
    def max_model_len(self) -> int:
        """The longest request the GPU cache holds alone (vLLM refuses longer ones)."""
        return (self.gpu_blocks - 1) * GPU_BLOCK_TOKENS

    def label(self) -> str:
        """How a table row names this engine's CPU tier."""
        if not self.offloads:
            return "no CPU tier"
        name = self.policy
        return f"{name} st{self.store_threshold}" if self.policy_family == "vllm" else name

    def check(self) -> None:
        """Raise HarnessError naming the first unusable setting."""
        if self.gpu_blocks < 2:
            raise HarnessError(f"gpu_blocks: must be >= 2, got {self.gpu_blocks!r}")
        if self.cpu_bytes < 0:
            raise HarnessError(f"cpu_bytes: must be >= 0, got {self.cpu_bytes!r}")
        if self.cpu_chunk_tokens <= 0 or self.cpu_chunk_tokens % GPU_BLOCK_TOKENS:
            raise HarnessError(f"cpu_chunk_tokens: must be a positive multiple of {GPU_BLOCK_TOKENS}, got {self.cpu_chunk_tokens!r}")
        family, _, name = self.policy.partition(":")
        if family == "vllm" and name not in VLLM_POLICIES:
            raise HarnessError(f"policy: vLLM's policies are {', '.join(VLLM_POLICIES)}, got {name!r}")
        if family not in ("vllm", "kvbroker") or not name:
            raise HarnessError(f"policy: expected vllm:NAME or kvbroker:NAME, got {self.policy!r}")
        if self.offloads and self.cpu_chunks < 1:
            raise HarnessError(f"cpu_bytes: {self.cpu_bytes} bytes hold no {self.cpu_chunk_tokens}-token chunk")
        if not 1 <= self.store_threshold <= 64:
            raise HarnessError(f"store_threshold: must be 1..64, got {self.store_threshold!r}")
        if self.max_num_seqs < 1:
            raise HarnessError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens < GPU_BLOCK_TOKENS:
            raise HarnessError(f"max_num_batched_tokens: must be >= {GPU_BLOCK_TOKENS}, got {self.max_num_batched_tokens!r}")
        if not self.time_scale > 0:
            raise HarnessError(f"time_scale: must be > 0, got {self.time_scale!r}")
        self.cost.check()
