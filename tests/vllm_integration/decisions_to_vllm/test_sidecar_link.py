"""BrokerLink against a real `kvbroker serve` on loopback: answers in time when the broker is
up, no wait at all when it is down (SIGKILL), and the same link serves again once a broker
is back on the port."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clients.broker_client import accessed_event, allocated_event
from kvbroker.v1 import directive_pb2 as dpb
from vllm_integration.decisions_to_vllm.link import DOWN, TIMEOUT, BrokerLink, Unanswered

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[3]

CONFIG = '[policy]\nname = "lru"\n[[tiers]]\nname = "cpu"\ncapacity = 64\nhigh_watermark = 1.0\nlow_watermark = 1.0\n'


def start_broker(tmp_path: Path, config_text: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    """``kvbroker serve`` as a process (``python -m broker.cli.main``: the same command, also
    where the project is on the path but not installed, as in the vLLM venv)."""
    config = tmp_path / "broker.toml"
    config.write_text(config_text)
    command = [sys.executable, "-m", "broker.cli.main", "serve", "--config", str(config), "--listen", "127.0.0.1:0", *args]
    log = tmp_path / "serve.log"
    with log.open("a") as stderr:  # a file, not a pipe: a long run must not fill a pipe and stall the broker
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"kvbroker serve did not start: {log.read_text()[-2000:]}")
    ready = json.loads(line)
    assert ready["event"] == "listening", ready
    return proc, int(ready["port"])


def serve(tmp_path: Path, port: int = 0) -> tuple[subprocess.Popen[str], int]:
    return start_broker(tmp_path, CONFIG, "--journal", f"file://{tmp_path}/broker.journal", "--listen", f"127.0.0.1:{port}")


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_ask_answers_in_time_then_says_down_at_once_then_serves_again(tmp_path: Path) -> None:
    proc, port = serve(tmp_path)
    link = BrokerLink(f"127.0.0.1:{port}", "dp0", backoff_initial_s=0.02, backoff_max_s=0.1)
    try:
        assert link.wait_connected(10)
        link.send([allocated_event(f"b{i}", 1, i, tier="cpu") for i in range(8)])
        answer = link.ask([accessed_event(["b0", "b1"], 9)], timeout=5.0)
        assert isinstance(answer, dpb.DirectiveBatch), answer
        # The answer is for the batch that carries the asking event: it and everything
        # queued before it are applied, in order.
        assert answer.accepted_events >= 1 and not answer.rejections

        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while link.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not link.connected
        # Down: no wait at all, and the request is not sent (it would be answered too late).
        started = time.perf_counter()
        down = link.ask([accessed_event(["b2"], 10)], timeout=5.0)
        assert isinstance(down, Unanswered) and down.reason == DOWN
        assert time.perf_counter() - started < 0.5

        proc, port2 = serve(tmp_path, port)
        assert port2 == port
        assert link.wait_connected(10)
        again = link.ask([accessed_event(["b3"], 11)], timeout=5.0)
        assert isinstance(again, dpb.DirectiveBatch), again
        assert not again.rejections
        counters = link.counters()
        assert counters["client_connects"] >= 2 and counters["dropped_events"] == 0
        # The journal survived the kill and the resend lost nothing: no resync is asked for.
        assert not link.take_resync()
    finally:
        link.close()
        stop(proc)


def test_ask_times_out_within_its_bound_when_the_broker_does_not_answer(tmp_path: Path) -> None:
    proc, port = serve(tmp_path)
    link = BrokerLink(f"127.0.0.1:{port}", "dp0", backoff_initial_s=0.02, backoff_max_s=0.1)
    try:
        assert link.wait_connected(10)
        # A stopped (not killed) broker keeps its socket open: the stream looks up, no answer comes.
        proc.send_signal(signal.SIGSTOP)
        started = time.perf_counter()
        result = link.ask([allocated_event("x", 1, 1, tier="cpu")], timeout=0.005)
        took = time.perf_counter() - started
        assert isinstance(result, Unanswered) and result.reason == TIMEOUT
        assert took < 0.005 + 0.25  # the bound plus a generous scheduling margin (loaded machine)
        proc.send_signal(signal.SIGCONT)
        # The late answer still arrives: the batch was applied once, nothing is lost.
        late = link.ask([accessed_event(["x"], 2)], timeout=5.0)
        assert isinstance(late, dpb.DirectiveBatch) and not late.rejections
    finally:
        proc.send_signal(signal.SIGCONT)
        link.close()
        stop(proc)


def test_each_asking_event_ends_a_batch_of_its_own_even_when_the_asker_gave_up(tmp_path: Path) -> None:
    proc, port = serve(tmp_path)
    link = BrokerLink(f"127.0.0.1:{port}", "dp0")
    try:
        assert link.wait_connected(10)
        link.send([allocated_event(f"b{i}", 1, i, tier="cpu") for i in range(4)])
        assert isinstance(link.ask([accessed_event(["b0"], 5)], timeout=5.0), dpb.DirectiveBatch)
        for round_ in range(20):
            # The first asker gives up at once, before the link's thread has taken its event;
            # the second one's answer must still be for its own event alone, not for a batch
            # that also carries the first's.
            first = link.ask([accessed_event(["b1"], 6)], timeout=0.0)
            # (Rarely the answer is in before the asker looks again: then it takes it.)
            assert isinstance(first, dpb.DirectiveBatch) or first.reason == TIMEOUT
            second = link.ask([accessed_event(["b2"], 7)], timeout=5.0)
            assert isinstance(second, dpb.DirectiveBatch), second
            assert second.accepted_events == 1, (round_, second)
    finally:
        link.close()
        stop(proc)
