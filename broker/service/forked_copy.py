"""A copy of the live state as it is now, made without stopping the event loop.

A consistent copy of a core that keeps changing needs the core to hold still while it is
copied: ``copy.deepcopy`` on the loop took 1.04 s at 50k blocks and 3-4.6 s at 200k, and
every stream waited (issue 41, item 13). ``fork()`` takes the copy instead: the kernel
gives the child the parent's memory as it is at that instant (copy-on-write, a few ms at
any size), so the child can take its time producing bytes from that frozen image (a
pickle of a shadow, a snapshot record) while the parent goes on serving. A thread of the
parent reads the bytes (the pipe read releases the GIL) and, when asked, rebuilds objects
from them (broker.service.shadow_builds: with the pure-Python unpickler, which gives the GIL
back to the loop every switch interval).

The child runs nothing but ``produce`` and ``os._exit``: no atexit handler, no logging,
no gRPC or journal thread (it has none: a forked child has only the forking thread), and it
closes every file descriptor but its pipe first.
"""

from __future__ import annotations

import os
import resource
import threading
import traceback
from collections.abc import Callable
from typing import Any

# The child's first byte: what follows is the product, or a one-line reason it failed.
_OK = b"0"
_FAILED = b"1"


def max_fd() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def forking_available() -> bool:
    return hasattr(os, "fork")


class ForkedCopy:
    """``produce()`` run in a child forked now, on the memory as it is now; its bytes, and
    what ``finish(bytes)`` builds of them in a thread of this process, arrive later.

    ``done()`` says whether they have; then ``result`` holds what ``finish`` returned, or
    ``error`` the reason (the child's exception or its exit status, one line)."""

    def __init__(self, produce: Callable[[], bytes], finish: Callable[[bytes], Any] = lambda data: data) -> None:
        self.result: Any = None
        self.error: str | None = None
        self._finished = threading.Event()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's code
            status = 1
            try:
                # Hold nothing of the parent's but the pipe: the journal's lock (a restart after
                # the parent's kill would find the journal held by this child), the listening
                # socket, the clients' connections.
                os.closerange(3, write_end)
                os.closerange(write_end + 1, max_fd())
                try:
                    data = _OK + produce()
                except BaseException as exc:  # any failure goes back as one line
                    data = _FAILED + one_line(exc).encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(write_end, view) :]
                status = 0
            finally:
                os._exit(status)
        os.close(write_end)
        self.pid = pid
        self._thread = threading.Thread(target=self._receive, args=(read_end, finish), name="kvbroker-forked-copy", daemon=True)
        self._thread.start()

    def _receive(self, read_end: int, finish: Callable[[bytes], Any]) -> None:
        try:
            chunks = []
            with os.fdopen(read_end, "rb", buffering=0) as pipe:
                while chunk := pipe.read(1 << 20):
                    chunks.append(chunk)
            _, status = os.waitpid(self.pid, 0)
            data = b"".join(chunks)
            if not data or status != 0:
                self.error = f"the copying process ended with status {os.waitstatus_to_exitcode(status)}"
            elif data[:1] == _FAILED:
                self.error = data[1:].decode(errors="replace")
            else:
                self.result = finish(data[1:])
        except Exception as exc:  # reported through ``error``
            self.error = one_line(exc)
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the copy has arrived (for tests and a clean stop)."""
        return self._finished.wait(timeout)


def one_line(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return " ".join(line.strip() for line in lines if line.strip())[:500]
