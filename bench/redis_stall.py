"""How long a hung Redis (up, not answering: SIGSTOP) stalls a broker's answers.

Starts a test-owned ``redis-server`` on a free loopback port and a real ``kvbroker serve`` on
a Redis journal with a spool, streams batches of 8 allocations one at a time, freezes Redis
with SIGSTOP, and times the next batches' round trips (each answer waits for its journal
record: ack_after = "journal"); then thaws Redis. Prints the slowest round trip while Redis
was frozen, per run.

    python bench/redis_stall.py                      # this checkout, journal.redis_timeout_s default
    python bench/redis_stall.py --timeout 0.2        # with journal.redis_timeout_s = 0.2
    python bench/redis_stall.py --kvbroker /other/venv/bin/kvbroker --no-timeout-key   # an older build

Wall-clock figures: noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.broker_client import BrokerClient
from tests.redis_server import RedisServer, free_port


def serve(kvbroker: str, workdir: Path, redis_url: str, timeout: float | None) -> tuple[subprocess.Popen[str], int]:
    extra = f"redis_timeout_s = {timeout}\n" if timeout is not None else ""
    config = workdir / "broker.toml"
    config.write_text(f'[journal]\nurl = "{redis_url}"\nstream = "stall"\nspool_dir = "{workdir / "spool"}"\n{extra}')
    args = [kvbroker, "serve", "--config", str(config), "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = json.loads(proc.stdout.readline())
    return proc, int(line["port"])


async def one_run(kvbroker: str, timeout: float | None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        redis = RedisServer(free_port())
        redis.start()
        proc, port = serve(kvbroker, workdir, redis.url, timeout)
        try:
            async with BrokerClient(f"127.0.0.1:{port}", "stall", max_batch_events=8, max_delay_s=30) as client:
                n = 0

                async def batch() -> float:
                    nonlocal n
                    for _ in range(8):
                        await client.allocate(f"b{n}", 4096, ts_us=n)
                        n += 1
                    started = time.monotonic()
                    await client.flush(timeout=120)
                    return time.monotonic() - started

                for _ in range(50):
                    await batch()
                assert redis.proc is not None
                os.kill(redis.proc.pid, signal.SIGSTOP)
                try:
                    worst = max([await batch() for _ in range(5)])
                finally:
                    os.kill(redis.proc.pid, signal.SIGCONT)
                await batch()
                return worst
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            redis.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kvbroker", default=str(Path(sys.executable).parent / "kvbroker"))
    parser.add_argument("--timeout", type=float, help="journal.redis_timeout_s (default: leave it to the build's default)")
    parser.add_argument("--no-timeout-key", action="store_true", help="a build without journal.redis_timeout_s")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    timeout = None if args.no_timeout_key else args.timeout
    stalls = [asyncio.run(one_run(args.kvbroker, timeout)) for _ in range(args.runs)]
    print(json.dumps({"kvbroker": args.kvbroker, "redis_timeout_s": timeout, "worst_round_trip_s": [round(s, 3) for s in stalls]}))


if __name__ == "__main__":
    main()
