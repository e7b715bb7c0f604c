"""kvbroker_* keys of kv_connector_extra_config, KVBROKER_VLLM_* as the fallback, and errors
that name the key."""

from __future__ import annotations

import os

import pytest

from vllm_integration.decisions_to_vllm.settings import OffloadSettings, SettingsError, load_settings


def test_defaults_keys_then_environment() -> None:
    assert load_settings({}, {}) == OffloadSettings()
    env = {"KVBROKER_VLLM_POLICY": "arc", "KVBROKER_VLLM_JOURNAL": "file:///tmp/x.journal", "KVBROKER_VLLM_JOURNAL_FLUSH_MS": "20"}
    got = load_settings({"kvbroker_policy": "s3fifo", "cpu_bytes_to_use": 10, "eviction_policy": "KvbrokerCachePolicy"}, env)
    # The key wins over the variable; the variable over the default; vLLM's own keys are left alone.
    assert (got.policy, got.journal, got.journal_flush_ms) == ("s3fifo", "file:///tmp/x.journal", 20.0)
    # How long an exit waits for the journal: a few seconds unless set.
    assert load_settings({}, {}).journal_exit_s == 3.0
    assert load_settings({}, {"KVBROKER_VLLM_JOURNAL_EXIT_S": "0.5"}).journal_exit_s == 0.5
    assert load_settings({"kvbroker_journal_exit_s": 10}, {"KVBROKER_VLLM_JOURNAL_EXIT_S": "0.5"}).journal_exit_s == 10.0
    params = load_settings({"kvbroker_policy_params": '{"small_ratio": 0.2}', "kvbroker_policy": "s3fifo"}, {})
    assert params.policy_params == {"small_ratio": 0.2}


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        ({"kvbroker_polcy": "lru"}, {}, "kv_connector_extra_config.kvbroker_polcy: unknown key"),
        ({"kvbroker_policy": "nope"}, {}, "kv_connector_extra_config.kvbroker_policy: "),
        ({}, {"KVBROKER_VLLM_POLICY": "nope"}, "kvbroker_policy (or KVBROKER_VLLM_POLICY): "),
        ({"kvbroker_policy": "belady"}, {}, "runs in replay only"),
        ({"kvbroker_mode": "remote"}, {}, "kv_connector_extra_config.kvbroker_mode: expected one of embedded, sidecar"),
        ({"kvbroker_mode": "sidecar"}, {}, "kvbroker_broker (or KVBROKER_VLLM_BROKER): required in sidecar mode"),
        ({"kvbroker_journal": "s3://bucket"}, {}, "kv_connector_extra_config.kvbroker_journal: expected none, file://PATH"),
        ({}, {"KVBROKER_VLLM_JOURNAL_FLUSH_MS": "soon"}, "KVBROKER_VLLM_JOURNAL_FLUSH_MS: expected a number"),
        ({"kvbroker_journal_exit_s": 0}, {}, "kv_connector_extra_config.kvbroker_journal_exit_s: expected a finite number > 0"),
        ({"kvbroker_deadline_ms": -1}, {}, "kv_connector_extra_config.kvbroker_deadline_ms: expected a finite number > 0"),
        ({"kvbroker_policy_params": "{"}, {}, "kv_connector_extra_config.kvbroker_policy_params: not valid JSON"),
        ({"kvbroker_policy": "lru", "kvbroker_policy_params": {"bogus": 1}}, {}, "kv_connector_extra_config.kvbroker_policy_params: "),
        ({"kvbroker_client_id": ""}, {}, "kv_connector_extra_config.kvbroker_client_id: required"),
        ({"kvbroker_metrics_port": 65536}, {}, "kv_connector_extra_config.kvbroker_metrics_port: expected a port in 0..65535"),
        ({"kvbroker_metrics_port": -1}, {}, "kv_connector_extra_config.kvbroker_metrics_port: expected a port in 0..65535"),
        (
            {"kvbroker_metrics_port": True},
            {},
            "kv_connector_extra_config.kvbroker_metrics_port: expected a port number (an integer), got bool",
        ),
        (
            {"kvbroker_metrics_port": 80.5},
            {},
            "kv_connector_extra_config.kvbroker_metrics_port: expected a port number (an integer), got float",
        ),
        ({}, {"KVBROKER_VLLM_METRICS_PORT": "http"}, "KVBROKER_VLLM_METRICS_PORT: expected a port number, got 'http'"),
        ({"kvbroker_metrics_host": ""}, {}, "kv_connector_extra_config.kvbroker_metrics_host: required, a non-empty string"),
        ({"kvbroker_report_s": 0}, {}, "kv_connector_extra_config.kvbroker_report_s: expected a finite number > 0, got 0"),
        ({}, {"KVBROKER_VLLM_STATUS_S": "-5"}, "KVBROKER_VLLM_STATUS_S: expected a finite number > 0, got -5.0"),
        ({"kvbroker_status_file": ""}, {}, "kv_connector_extra_config.kvbroker_status_file: required, a non-empty string"),
        ({"kvbroker_status_file": 7}, {}, "kv_connector_extra_config.kvbroker_status_file: expected a string, got int"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(extra: dict[str, object], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(extra, env)
    assert message in str(caught.value)


def test_the_reporting_settings_off_by_default_then_set_by_key_or_environment() -> None:
    default = load_settings({}, {})
    assert (default.report_s, default.metrics_port, default.metrics_host, default.status_file, default.status_s) == (
        60.0,
        None,
        "127.0.0.1",
        "",
        5.0,
    )
    env = {"KVBROKER_VLLM_METRICS_PORT": "9500", "KVBROKER_VLLM_STATUS_FILE": "/run/kv-{pid}-{rank}.json", "KVBROKER_VLLM_REPORT_S": "30"}
    got = load_settings({"kvbroker_metrics_port": "0", "kvbroker_status_s": 2, "kvbroker_metrics_host": "::1"}, env, rank=2)
    assert (got.metrics_port, got.metrics_host, got.status_s, got.report_s) == (0, "::1", 2.0, 30.0)
    assert got.resolved_status_file() == f"/run/kv-{os.getpid()}-2.json"  # as kvbroker_journal's placeholders


def test_the_core_config_is_one_tier_of_chunks_without_watermark_slack() -> None:
    config = load_settings({"kvbroker_policy": "arc"}, {}).core_config(1234)
    (tier,) = config.tiers
    assert (tier.name, tier.capacity_bytes, tier.high_watermark, tier.low_watermark) == ("cpu", 1234, 1.0, 1.0)
    assert config.policy.name == "arc"
