"""An asyncio loop run to completion on a thread of its own: how a synchronous caller (the
blocking SyncBrokerClient, the vLLM sidecar's link) keeps an async BrokerClient going."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any


def run_loop(
    loop: asyncio.AbstractEventLoop,
    main: Callable[[], Coroutine[Any, Any, None]],
    ready: threading.Event,
    name: str,
    log: logging.Logger,
) -> None:
    """The thread's body: run ``main()`` on ``loop`` until it returns, log what it raises
    (under ``name``), then close the loop and set ``ready`` (so that a caller waiting for
    the thread to start is not left waiting when it failed)."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main())
    except Exception:
        log.exception("%s: its thread failed", name)
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        ready.set()
