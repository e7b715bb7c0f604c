"""Replay engines by name (``kvbroker replay --engine NAME``): a Mooncake trace's requests run
as an engine runs them, instead of its events replayed as imported.

An engine is named by the dotted path of its function (``module:function``), imported when a
job uses it: broker/ imports no engine's room (vllm_integration/ holds the vLLM ones;
tests/test_layout.py holds that), and a venv without vLLM still lists and checks them. The
function takes (sweep.Source, CoreConfig, policy, params) and returns (ReplayResult, lines
skipped); a ``metrics["engine_record"]`` dict is added to the job's record as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any, Final

ENGINES: Final[dict[str, str]] = {
    # vLLM's CPU offload manager alone, one request after another (its CachePolicy's calls).
    "vllm": "vllm_integration.manager_replay.engine:replay_engine",
    # vLLM's own scheduler, GPU prefix cache and CPU tier, requests in flight together (issue 39).
    "vllm-scheduler": "vllm_integration.scheduler_harness.replay_engine:replay_engine",
}

# The third-party package an engine needs, checked before a job starts.
REQUIRES: Final[dict[str, str]] = {"vllm-scheduler": "vllm"}


def missing(name: str) -> str | None:
    """Why engine ``name`` cannot run here (None if it can)."""
    package = REQUIRES.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        from broker.extras import install_hint

        return f"{name} runs vLLM's own scheduler: it needs {package} installed ({install_hint('vllm')})"
    return None


def load(name: str) -> Callable[..., Any]:
    """The replay function of engine ``name`` (KeyError if there is none)."""
    return by_path(ENGINES[name])


def by_path(target: str) -> Callable[..., Any]:
    """The function a ``module:function`` path names, imported now: how broker/ reaches the
    vLLM integration's rooms without importing them (tests/test_layout.py)."""
    module, _, function = target.partition(":")
    found: Callable[..., Any] = getattr(importlib.import_module(module), function)
    return found


# Whether a journal's config is the one kvbroker's CachePolicy runs inside vLLM (its one CPU
# tier of one-byte chunks): replay then shows that tier in vLLM's chunks.
VLLM_CPU_TIER_CHECK: Final = "vllm_integration.manager_replay.engine:is_vllm_cpu_tier"
# The reader of captures written by `kvbroker vllm-bridge --capture` (--format vllm-events).
VLLM_CAPTURE_READER: Final = "vllm_integration.trace_import:capture_format"
