"""`kvbroker serve` freezes its startup heap (broker.service.server.freeze_startup_heap): a full
garbage collection then walks only what the broker made since, not the ~50,000 objects
of its modules, so it stops being a 20 ms pause of every stream."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path


def test_serve_freezes_its_startup_heap_and_says_how_much(tmp_path: Path) -> None:
    config = tmp_path / "b.toml"
    config.write_text("[[tiers]]\nname = 'hbm'\ncapacity = 1000\n")
    kvbroker = Path(sys.executable).parent / "kvbroker"
    argv = [str(kvbroker), "serve", "--config", str(config), "--listen", "127.0.0.1:0", "--journal", "none"]
    proc = subprocess.Popen(
        [*argv, "--log-level", "info", "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "listening"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    frozen = [r["gc_frozen"] for r in records if "gc_frozen" in r]
    # The broker's own modules, gRPC's, protobuf's and the rest: tens of thousands.
    assert len(frozen) == 1 and frozen[0] > 10_000, records


def test_the_freeze_takes_the_whole_heap_out_of_the_collectors_reach() -> None:
    """In a process of its own: the freeze applies to the whole interpreter."""
    code = """
import gc, json
from broker.service.server import freeze_startup_heap
import broker.service.broker_service, grpc  # a heap to freeze
before = len(gc.get_objects())
frozen = freeze_startup_heap()
print(json.dumps({"before": before, "frozen": frozen, "after": len(gc.get_objects())}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    counts = json.loads(out)
    # All of it but the garbage collected first; nothing left for a collection to walk.
    assert counts["frozen"] > 0.9 * counts["before"] and counts["after"] < 100, counts
