"""What reporting (vllm_integration/decisions_to_vllm/report.py) costs vLLM's scheduler thread.

The Mooncake trace's first ``--requests`` requests through vLLM's real CPUOffloadingManager
with kvbroker's ``lru`` (1,953 chunks), each policy call timed on the calling thread's CPU
clock (manager_driver.TimedPolicy): the reporter at its defaults (a log line a minute, no
metrics, no status file) against a busy one, far past any sane setting: the status file
rewritten every 10 ms, a log line every 0.5 s, metrics served and scraped every 10 ms by
another thread. Runs alternate; the median and best of ``--repeat`` are printed. Needs vLLM::

    PYTHONPATH=. python bench/vllm_report_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import urllib.request

from tests.vllm_integration.decisions_to_vllm import manager_driver as driver


def run(requests: list[list[int]], busy: bool) -> tuple[float, int]:
    """(µs per policy call on the calling thread, scrapes made)."""
    with tempfile.TemporaryDirectory() as folder:
        extra = {"metrics_port": 0, "status_file": f"{folder}/status.json", "status_s": 0.01, "report_s": 0.5} if busy else {}
        manager = driver.kvbroker_manager("lru", 1953, **extra)
        timed = driver.TimedPolicy(manager)
        policy = timed.inner
        stop = threading.Event()
        scrapes = 0

        def scrape() -> None:
            nonlocal scrapes
            while not stop.wait(0.01):
                with urllib.request.urlopen(policy.reporter.metrics_url, timeout=10) as answer:
                    answer.read()
                scrapes += 1

        scraper = threading.Thread(target=scrape, daemon=True)
        if busy:
            scraper.start()
        driver.mooncake(manager, requests)
        stop.set()
        if busy:
            scraper.join()
        policy.close()
        return timed.us_per_call(), scrapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500, help="the first N requests of the trace (default 1500)")
    parser.add_argument("--repeat", type=int, default=4, help="runs of each (default 4)")
    args = parser.parse_args()
    requests = list(driver.mooncake_requests(args.requests))
    runs: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.repeat):
        for busy in (False, True):
            us, scrapes = run(requests, busy)
            runs[busy].append(us)
            scraped = f", {scrapes} scrapes" if busy else ""
            print(f"run {i + 1} {'busy' if busy else 'defaults'}: {us:.3f} µs per call{scraped}", flush=True)
    base, busy = runs[False], runs[True]
    print(f"defaults: median {statistics.median(base):.3f}, best {min(base):.3f} µs per call")
    print(
        f"busy:     median {statistics.median(busy):.3f}, best {min(busy):.3f} µs per call "
        f"({statistics.median(busy) / statistics.median(base):.3f}x, best {min(busy) / min(base):.3f}x)"
    )


if __name__ == "__main__":
    main()
