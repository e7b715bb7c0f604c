"""Sidecar mode: what an evict call costs vLLM's scheduler with the broker up, hung, down
and back.

Starts a real ``kvbroker serve`` on loopback (file journal in a temporary directory), and
drives the adapter's translator (what ``KvbrokerCachePolicy`` runs inside vLLM) with the
sidecar decider, as vLLM's manager does: a skewed stream of stores into a full CPU tier,
each store that finds no room evicting one chunk first. Four phases:

- up: the broker decides (an evict waits for its answer, at most the bound);
- hung: the broker is stopped (SIGSTOP): the stream stays open, no answer comes; the
  first evicts wait out the bound, then the decider stops asking for cooldown_s;
- down: the broker is killed (SIGKILL): no stream, the fallback decides at once;
- back: a broker restarted on the port: the decider reconnects and asks again.

For each phase: evict calls, their wall time (p50 / p99 / max, µs), who decided, and the
fallbacks by reason. Also the mean cost of the other calls (insert, touch), which only
queue events for the broker.

    python bench/vllm_sidecar.py [--chunks 256] [--stores 3000] [--deadline-ms 5] [--policy arc]

Wall-clock figures: noisy on a shared machine (say how loaded it was).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.vllm_integration.decisions_to_vllm.fakes import Chunk, Ctx  # noqa: E402
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore  # noqa: E402
from vllm_integration.decisions_to_vllm.latency import LatencyHistogram  # noqa: E402
from vllm_integration.decisions_to_vllm.policy_calls import Translator  # noqa: E402
from vllm_integration.decisions_to_vllm.settings import load_settings  # noqa: E402
from vllm_integration.decisions_to_vllm.sidecar import REASONS, SidecarDecider, make_decider  # noqa: E402


def start_broker(workdir: Path, policy: str, chunks: int, port: int = 0) -> tuple[subprocess.Popen[str], int]:
    config = workdir / "broker.toml"
    config.write_text(
        f'[policy]\nname = "{policy}"\n[[tiers]]\nname = "cpu0"\ncapacity = {chunks}\nhigh_watermark = 1.0\nlow_watermark = 1.0\n'
    )
    command = [sys.executable, "-m", "broker.cli.main", "serve", "--config", str(config), "--journal", f"file://{workdir}/broker.journal"]
    command += ["--listen", f"127.0.0.1:{port}"]
    with (workdir / "serve.log").open("a") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
    assert proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
    return proc, int(ready["port"])


class Driver:
    def __init__(self, translator: Translator, decider: SidecarDecider, chunks: int) -> None:
        self.translator = translator
        self.decider = decider
        self.chunks = chunks
        self.i = 0
        self.evicts = LatencyHistogram()
        self.others = LatencyHistogram()

    def store(self) -> None:
        i = self.i
        self.i += 1
        # A skewed stream: a hot set of a tenth of the tier, and a cold tail four times it.
        n = i % (self.chunks // 10) if i % 3 else (i * 7919) % (4 * self.chunks)
        key = n.to_bytes(8, "big")
        translator = self.translator
        request = Ctx(f"r{i}")
        if translator.get(key) is not None:
            started = time.perf_counter()
            translator.touch([key], request)
            self.others.record(time.perf_counter() - started)
            return
        if len(translator.entries) >= self.chunks:
            started = time.perf_counter()
            victims = translator.evict(1, {key})
            self.evicts.record(time.perf_counter() - started)
            assert victims is not None and len(victims) == 1
        started = time.perf_counter()
        translator.insert(key, Chunk(0), request)
        self.others.record(time.perf_counter() - started)

    def phase(self, name: str, stores: int, rows: list[dict[str, Any]]) -> None:
        before = dict(self.decider.counts)
        self.evicts = LatencyHistogram()
        self.others = LatencyHistogram()
        for _ in range(stores):
            self.store()
        after = self.decider.counts
        delta = {k: after[k] - before[k] for k in after}
        s = self.evicts.summary()
        rows.append(
            {
                "phase": name,
                "evicts": s["count"],
                "p50_us": s["p50_us"],
                "p99_us": s["p99_us"],
                "max_us": s["max_us"],
                "broker": delta["broker_decisions"],
                "fallback": delta["fallback_decisions"],
                "why": ", ".join(f"{r} {delta['fallback_' + r]}" for r in REASONS if delta["fallback_" + r]) or "-",
                "other_call_us": self.others.summary()["mean_us"],
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=256, help="the CPU tier, in chunks")
    parser.add_argument("--stores", type=int, default=3000, help="stores per phase")
    parser.add_argument("--deadline-ms", type=float, default=5.0, help="kvbroker_deadline_ms")
    parser.add_argument("--policy", default="arc", help="the broker's policy (the fallback runs lru)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvbroker-sidecar-bench-"))
    proc, port = start_broker(workdir, args.policy, args.chunks)
    settings = load_settings(
        {
            "kvbroker_mode": "sidecar",
            "kvbroker_broker": f"127.0.0.1:{port}",
            "kvbroker_deadline_ms": args.deadline_ms,
            "kvbroker_fallback_policy": "lru",
            "kvbroker_client_id": "bench-dp0",
            "kvbroker_broker_tier": "cpu0",
        },
        environ={},
    )
    local = EmbeddedCore(settings, args.chunks, policy="lru")
    translator = Translator(local)
    decider = make_decider(settings, local, translator)
    translator.decider = decider
    driver = Driver(translator, decider, args.chunks)
    rows: list[dict[str, Any]] = []
    try:
        decider.link.wait_connected(10)
        while len(translator.entries) < args.chunks:  # fill the tier first
            driver.store()
        decider.flush()
        # Warm up (not counted): the broker takes the fill, answers a first eviction.
        deadline = time.monotonic() + 5
        while decider.counts["broker_decisions"] == 0 and time.monotonic() < deadline:
            driver.store()
            time.sleep(0.001)
        driver.phase("up", args.stores, rows)
        proc.send_signal(signal.SIGSTOP)
        driver.phase("hung (SIGSTOP)", args.stores, rows)
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 5
        while decider.link.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        driver.phase("down (SIGKILL)", args.stores, rows)
        proc, _ = start_broker(workdir, args.policy, args.chunks, port)
        decider.link.wait_connected(10)
        time.sleep(decider.cooldown_s)
        driver.phase("back (restarted)", args.stores, rows)
    finally:
        decider.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(20)
    load = os.getloadavg()[0]
    print(f"kvbroker sidecar: bound {args.deadline_ms} ms, {args.chunks} chunks, broker {args.policy}, fallback lru; load {load:.1f}")
    header = ["phase", "evicts", "p50_us", "p99_us", "max_us", "broker", "fallback", "why", "other_call_us"]
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in header]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row[h]).ljust(w) for h, w in zip(header, widths, strict=True)))
    print(decider.summary())  # the line the sidecar logs every 60 s and at exit


if __name__ == "__main__":
    main()
