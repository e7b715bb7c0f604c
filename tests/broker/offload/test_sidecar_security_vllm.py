"""vLLM's own offloading spec, in sidecar mode with a CA file that is not there: the start
stops with a SettingsError naming KVBROKER_TLS_CA (issue 33, item 16)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from broker.offload.settings import SettingsError

pytestmark = pytest.mark.vllm


def test_a_missing_ca_stops_vllms_start_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    missing = tmp_path / "ca.pem"
    monkeypatch.setenv("KVBROKER_TLS_CA", str(missing))
    extra = {
        "cpu_bytes_to_use": 64 * 4096,
        "eviction_policy": "KvbrokerCachePolicy",
        "cache_policy_module_path": "broker.offload.vllm_policy",
        "kvbroker_mode": "sidecar",
        "kvbroker_broker": "127.0.0.1:1",
    }
    config = SimpleNamespace(
        extra_config=extra,
        enable_kv_cache_events=False,
        groups=(SimpleNamespace(tokens_per_block=16, sliding_window_size_in_chunks=None),),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=SimpleNamespace(world_size=1, rank=0),
        worker_kv_bytes_per_block=4096,
        replicated_layout=False,
        model=SimpleNamespace(max_model_len=0),
        engine_id="e",
    )
    with pytest.raises(SettingsError, match=f"KVBROKER_TLS_CA: cannot read {missing}: No such file or directory"):
        CPUOffloadingSpec(config).get_manager()  # type: ignore[arg-type]
