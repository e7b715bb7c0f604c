"""A process holding the embedded core and its journal, exiting under load: run by
test_exit.py as ``python -m tests.vllm_integration.decisions_to_vllm.exit_child MODE JOURNAL_URL``.

It prints ``pid PID`` once batches are flowing (the process to signal), then ``applied N``
(batches the core applied, the one at start included) just before it exits. Modes:

- ``normal``: apply 20,000 batches as fast as it can, then leave main (the interpreter exits
  with most of them still queued for the journal thread).
- ``sigterm``: apply batches until SIGTERM, whose handler only asks the loop to stop, as
  vLLM's engine core does; the loop then raises SystemExit.
- ``sigterm-fork``: the same in a child made by multiprocessing's fork (vLLM's engine core
  process by default), which leaves with os._exit: no atexit handler runs there.
- ``vllm-fork``: in a forked child, vLLM's real offloading manager with kvbroker's policy
  runs a random request stream, prints ``events N buffered B`` (the events the policy made,
  B of them still in its buffer, not yet applied) and returns: the child's exit must apply
  and journal them (needs vLLM).
- ``disk-full``: apply and flush 100 batches, then cap the file size (RLIMIT_FSIZE) at the
  journal's size, so every later write fails as on a full disk; apply 2,000 more and exit.
- ``redis-down``: apply and flush 100 batches, print ``flushed``, wait for a line on stdin
  (the test stops Redis meanwhile), apply 2,000 more and exit.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import sys

from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.settings import OffloadSettings

# A chunk allocated per batch, so that the tier (100 chunks) fills and batches evict: the
# journal gets directives too.
CAPACITY = 100
INTENT = intent_bytes.intent_fields("r")


def make_core(url: str) -> EmbeddedCore:
    settings = OffloadSettings(journal=url, journal_stream="exit-test", client_id="exit-test", journal_exit_s=2.0)
    return EmbeddedCore(settings, CAPACITY)


def apply_one(core: EmbeddedCore, n: int) -> None:
    ts = intent_bytes.timestamp(n + 1)
    evs = [intent_bytes.allocated(ts, intent_bytes.id_field(f"c{n}"), INTENT)]
    if n >= CAPACITY:
        evs.insert(0, intent_bytes.eviction_requested(ts, 1, ()))
    core.apply(evs)


def run_until_sigterm(url: str) -> None:
    stop = False

    def handler(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True  # as vLLM's handler: the busy loop sees it and raises SystemExit

    signal.signal(signal.SIGTERM, handler)
    core = make_core(url)
    n = 0
    while not stop:
        apply_one(core, n)
        n += 1
        if n == 500:
            print(f"pid {os.getpid()}", flush=True)
    print(f"applied {n + 1}", flush=True)
    raise SystemExit(0)


def run_vllm_stream(url: str) -> None:
    from tests.vllm_integration.decisions_to_vllm import manager_driver

    manager = manager_driver.kvbroker_manager("lru", 64, journal=url, journal_exit_s=2.0)
    manager_driver.random_stream(manager, 3, 2000)
    translator = manager._policy.translator
    buffered = len(translator._buffer)
    print(f"events {translator.stats.events + buffered} buffered {buffered}", flush=True)


def main() -> None:
    mode, url = sys.argv[1], sys.argv[2]
    if mode == "sigterm":
        run_until_sigterm(url)
    if mode in ("sigterm-fork", "vllm-fork"):
        target = run_until_sigterm if mode == "sigterm-fork" else run_vllm_stream
        child = multiprocessing.get_context("fork").Process(target=target, args=(url,))
        child.start()
        child.join()
        return
    core = make_core(url)
    print(f"pid {os.getpid()}", flush=True)
    n = 0
    if mode == "normal":
        for n in range(20_000):
            apply_one(core, n)
        print(f"applied {n + 2}", flush=True)
        return
    for n in range(100):
        apply_one(core, n)
    core.flush()
    if mode == "disk-full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        size = os.path.getsize(url.removeprefix("file://"))
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))
    elif mode == "redis-down":
        print("flushed", flush=True)
        sys.stdin.readline()
    for n in range(100, 2_100):
        apply_one(core, n)
    print(f"applied {n + 2}", flush=True)


if __name__ == "__main__":
    main()
