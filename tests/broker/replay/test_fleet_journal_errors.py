"""Fleet replay's edges: a Redis URL with a stream pattern and nothing there is one line,
exit 2, as without the pattern (issue 40 item 7); `--verify` on a file glob says per
journal whether it verified and exits non-zero when one did not (issue 40 item 14)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.cli.main import main
from broker.replay.fleet import fleet_total
from tests.redis_server import free_port
from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.settings import OffloadSettings


class QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Not on stderr: the test reads the replay's stderr."""


@pytest.fixture
def http_port() -> Iterator[int]:
    """A port where an HTTP server answers, not Redis."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), QuietHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("stream", ["kvbroker:*:journal", "kvbroker:pod-a:journal"], ids=["pattern", "plain"])
@pytest.mark.parametrize("listener", ["nothing", "http"])
def test_a_redis_journal_nobody_answers_is_one_line_exit_2_with_or_without_a_pattern(
    stream: str, listener: str, http_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port() if listener == "nothing" else http_port
    code = main(["replay", "--journal", f"redis://127.0.0.1:{port}/0?stream={stream}", "--policy", "lru"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in err


def engine_journal(path: Path, policy: str, batches: int = 30) -> None:
    """A journal an embedded core wrote under ``policy``, with a trailer; allocations that
    fill its 8-chunk tier so the policy decides evictions (directives to verify)."""
    core = EmbeddedCore(OffloadSettings(journal=f"file://{path}", client_id="engine", policy=policy), 8)
    for n in range(batches):
        ts = intent_bytes.timestamp(n + 1)
        core.apply([intent_bytes.cleared(ts)])
    core.close()


def test_fleet_verify_on_a_file_glob_says_per_journal_and_fails_when_one_is_not_verified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine_journal(tmp_path / "a.journal", "lru")
    engine_journal(tmp_path / "b.journal", "arc")
    glob = f"file://{tmp_path}/*.journal"

    # Each journal's live policy replayed: each verifies, the fleet with them.
    assert main(["replay", "--journal", glob, "--policy", "lru,arc", "--verify", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    by = {(r["source"].rpartition("/")[2], r["policy"]): r for r in records}
    assert by[("a.journal", "lru")]["verified"] is True and by[("b.journal", "arc")]["verified"] is True
    # A policy that was live in one pod only is not "NO (0)" for the fleet: not verified there.
    assert by[("fleet", "lru")]["verified"] is None and by[("fleet", "arc")]["verified"] is None

    # Only lru replayed: b.journal (live arc) is not verified: said, exit 1 (was NO (0), exit 0).
    assert main(["replay", "--journal", glob, "--policy", "lru", "--verify"]) == 1
    captured = capsys.readouterr()
    assert "NO (0)" not in captured.out
    assert f"--verify: file://{tmp_path}/b.journal: not verified: its live policy arc was not replayed (add --policy arc)" in captured.err
    assert "a.journal: not verified" not in captured.err


@pytest.mark.parametrize(
    "pods,expected",
    [((True, True), True), ((True, None), None), ((None, None), None), ((True, False), False), ((None, False), False)],
)
def test_a_fleet_row_is_verified_only_when_every_pod_is(pods: tuple[bool | None, ...], expected: bool | None) -> None:
    base = {
        "source": "x",
        "accesses": 0,
        "prompt_blocks": 0,
        "accesses_by_tier": {},
        "latency_hist": {},
        "dc_accesses": 0,
        "dc_misses": 0,
        "deadline_accesses": 0,
        "deadline_misses": 0,
        "events": 0,
        "seconds": 1.0,
        "prefix_hits": 0,
        "prefix_hit_rate_any_tier": 0.0,
        "mean_us": 0.0,
    }
    rows = [{**base, "verified": v, "mismatches": None if v is None else (0 if v else 3)} for v in pods]
    assert fleet_total(rows)["verified"] is expected
