"""Sidecar mode's TLS and token files (issue 33, item 16): a file that cannot be read stops
vLLM's start with a SettingsError naming its variable, and a link that never reaches its
broker shuts down quietly (no "Future exception was never retrieved" per batch)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clients.broker_client import ClientSecurity
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.link import BrokerLink
from vllm_integration.decisions_to_vllm.policy_calls import Translator
from vllm_integration.decisions_to_vllm.settings import SettingsError, load_settings
from vllm_integration.decisions_to_vllm.sidecar import make_decider

SIDECAR = {"kvbroker_mode": "sidecar", "kvbroker_broker": "127.0.0.1:1"}


@pytest.fixture
def pem(tmp_path: Path) -> Path:
    path = tmp_path / "ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return path


@pytest.mark.parametrize(
    "env,message",
    [
        ({"KVBROKER_TLS_CA": "{tmp}/missing.pem"}, "KVBROKER_TLS_CA: cannot read {tmp}/missing.pem: No such file or directory"),
        ({"KVBROKER_TLS_CA": "{tmp}"}, "KVBROKER_TLS_CA: cannot read {tmp}: a folder, not a regular file"),
        ({"KVBROKER_TLS_CA": "{tmp}/empty"}, "KVBROKER_TLS_CA: {tmp}/empty is empty"),
        ({"KVBROKER_TLS_CERT": "{pem}"}, "KVBROKER_TLS_CERT and KVBROKER_TLS_KEY: give both"),
        ({"KVBROKER_TLS_CERT": "{pem}", "KVBROKER_TLS_KEY": "{tmp}/missing.key"}, "KVBROKER_TLS_KEY: cannot read {tmp}/missing.key"),
        ({"KVBROKER_TOKEN_FILE": "{tmp}/missing.token"}, "KVBROKER_TOKEN_FILE: cannot read {tmp}/missing.token"),
    ],
    ids=["ca-missing", "ca-folder", "ca-empty", "cert-without-key", "key-missing", "token-file-missing"],
)
def test_sidecar_settings_refuse_a_security_file_that_cannot_be_read(env: dict[str, str], message: str, tmp_path: Path, pem: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    filled = {k: v.format(tmp=tmp_path, pem=pem) for k, v in env.items()}
    with pytest.raises(SettingsError) as caught:
        load_settings(SIDECAR, filled)
    assert message.format(tmp=tmp_path) in str(caught.value)


def test_readable_files_the_token_itself_and_embedded_mode_pass(tmp_path: Path, pem: Path) -> None:
    missing = str(tmp_path / "missing")
    load_settings(SIDECAR, {"KVBROKER_TLS_CA": str(pem)})
    load_settings(SIDECAR, {"KVBROKER_TOKEN": "t", "KVBROKER_TOKEN_FILE": missing})  # the token wins; its file is not read
    load_settings({}, {"KVBROKER_TLS_CA": missing})  # embedded mode reaches no broker


def test_the_decider_refuses_a_ca_gone_after_the_settings_loaded(tmp_path: Path, pem: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(SIDECAR, {"KVBROKER_TLS_CA": str(pem)})
    monkeypatch.setenv("KVBROKER_TLS_CA", str(tmp_path / "gone.pem"))
    local = EmbeddedCore(settings, 4)
    with pytest.raises(SettingsError, match=r"tls_ca .*gone\.pem: cannot read it"):
        make_decider(settings, local, Translator(local))


def test_a_link_whose_ca_cannot_be_read_fails_loudly_and_counts_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    link = BrokerLink("127.0.0.1:1", "c", security=ClientSecurity(tls_ca=str(tmp_path / "missing.pem")))
    try:
        deadline = time.monotonic() + 10
        while link.failed is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.failed is not None and "missing.pem" in str(link.failed)
        assert link.counters()["client_connect_failures"] == 1
    finally:
        link.close()
    assert any(r.levelname == "ERROR" and "missing.pem" in r.getMessage() for r in caplog.records)


def test_closing_a_link_that_never_reached_its_broker_is_quiet(tmp_path: Path) -> None:
    # A child process: "never retrieved" is logged when the futures are collected, at the
    # latest at exit, which only a whole process shows.
    script = textwrap.dedent(
        """
        import logging, socket, time
        logging.basicConfig(level=logging.WARNING)
        from vllm_integration.decisions_to_vllm.link import BrokerLink
        from kvbroker.v1 import intent_pb2 as pb

        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()  # nothing listens there
        link = BrokerLink(f"127.0.0.1:{port}", "c", backoff_initial_s=0.01, backoff_max_s=0.05)
        for i in range(300):
            link.send([pb.Event(ts_us=i + 1, freed=pb.BlocksFreed(block_ids=[f"b{i}"]))])
            link.ask([pb.Event(ts_us=i + 1, freed=pb.BlocksFreed(block_ids=[f"x{i}"]))], 0.001)
            time.sleep(0.001)
        link.close()
        print("abandoned", link.counters()["client_abandoned_batches"])
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) > 0  # batches were left unanswered at close
    assert "never retrieved" not in proc.stderr
    assert "Traceback" not in proc.stderr
