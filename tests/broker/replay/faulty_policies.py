"""Out-of-tree policies (loaded by module path) that fail or stall on purpose: what the Ray
runner's retries, failure reports and cancellation are tested with. Each is FIFO otherwise."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from policies.base import PolicyContext
from policies.fifo import FIFOPolicy


@dataclasses.dataclass(frozen=True)
class FaultParams:
    """``marker``: a file; ``seconds``: how long to stall."""

    marker: str = ""
    seconds: float = 0.0


class FailOncePolicy(FIFOPolicy):
    """The first run (the one that creates ``marker``) raises; every later run is FIFO."""

    name = "fail_once"
    description = "fails on its first run"
    Params = FaultParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        try:
            with open(self.params.marker, "x"):
                pass
        except FileExistsError:
            return
        raise RuntimeError(f"fail_once: first run (created {self.params.marker})")


class AlwaysFailsPolicy(FIFOPolicy):
    """Every run raises, counting its attempts in ``marker`` (one line each)."""

    name = "always_fails"
    description = "fails on every run"
    Params = FaultParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        with open(self.params.marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        raise RuntimeError("always_fails: as designed")


class StallPolicy(FIFOPolicy):
    """Sleeps ``seconds`` before it starts: a job that runs long."""

    name = "stall"
    description = "stalls before it starts"
    Params = FaultParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        time.sleep(self.params.seconds)
