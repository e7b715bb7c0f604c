"""vLLM's own offloading spec, in sidecar mode with a CA file that is not there: the start
stops with a SettingsError naming KVBROKER_TLS_CA (issue 33, item 16)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_integration.decisions_to_vllm.settings import SettingsError

pytestmark = pytest.mark.vllm


def test_a_missing_ca_stops_vllms_start_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    missing = tmp_path / "ca.pem"
    monkeypatch.setenv("KVBROKER_TLS_CA", str(missing))
    extra = {
        "eviction_policy": "KvbrokerCachePolicy",
        "cache_policy_module_path": "vllm_integration.decisions_to_vllm.cache_policy",
        "kvbroker_mode": "sidecar",
        "kvbroker_broker": "127.0.0.1:1",
    }
    from tests.vllm_integration.decisions_to_vllm.manager_driver import offloading_config

    config = offloading_config(extra)
    with pytest.raises(SettingsError, match=f"KVBROKER_TLS_CA: cannot read {missing}: No such file or directory"):
        CPUOffloadingSpec(config).get_manager()  # type: ignore[arg-type]
