"""The memory of one what-if size (vllm_integration/decisions_to_vllm/shadows.py), per chunk
of the size, once full: ``PYTHONPATH=. python bench/vllm_whatif_memory.py [TIER] [POLICY]``.

One exact size at 1x of a TIER-chunk tier is fed 12 x TIER distinct chunks (16 a request),
so its resident chunks and its history of evicted ones (kvbroker_history_ghosts, 8 x by
default) are full; the Python heap it holds (tracemalloc) is compared with the same run
without the size. docs/vllm.md ("Their memory") quotes it.
"""

from __future__ import annotations

import gc
import hashlib
import sys
import tracemalloc

from vllm_integration.decisions_to_vllm.settings import OffloadSettings
from vllm_integration.decisions_to_vllm.shadows import ShadowSet


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def held(tier: int, policy: str, whatif: tuple[float, ...]) -> int:
    """Bytes the Python heap holds after feeding a ShadowSet of ``whatif`` sizes."""
    gc.collect()
    tracemalloc.start()
    shadows = ShadowSet(OffloadSettings(policy=policy, whatif=whatif, whatif_sample=1.0), tier)
    n = 0
    for r in range(tier * 12 // 16):
        shadows.request([key(n + j) for j in range(16)], set(), None, None, r)
        n += 16
    gc.collect()
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del shadows
    return current


def main() -> None:
    tier = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    policy = sys.argv[2] if len(sys.argv) > 2 else "history_arc"
    size = held(tier, policy, (1.0,)) - held(tier, policy, ())
    print(f"{policy}, tier {tier} chunks: one exact what-if size at 1x holds {size / 2**20:.1f} MiB, {size / tier:.0f} B per chunk")


if __name__ == "__main__":
    main()
