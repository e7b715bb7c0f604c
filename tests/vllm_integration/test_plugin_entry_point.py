"""The installed kvbroker declares vLLM's plugin entry point (``vllm.general_plugins``:
``"eviction_policy": "kvbroker"``), and it resolves without vLLM: vLLM loads it in every one
of its processes, so loading it must not fail nor pull vLLM or the broker in. That vLLM
itself loads it and builds its manager with the name: test_plugin_vllm.py (marker vllm).

Read in a child process started in an empty folder, as an installed program reads it: from
a checkout, Python would put the checkout's ``kvbroker.egg-info`` (a by-product of the
build, possibly older than pyproject.toml) ahead of the installed metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = """
import importlib.metadata, json, sys
found = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.dist.name == "kvbroker"]
register = found[0].load() if found else None
print(json.dumps({
    "entries": [[e.name, e.value] for e in found],
    "callable": callable(register),
    "imported": sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "broker", "policies", "grpc")),
}))
"""


def test_the_installed_distribution_declares_the_vllm_plugin_and_loading_it_imports_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["entries"] == [["kvbroker", "vllm_integration.decisions_to_vllm.plugin:register"]]
    assert found["callable"] is True
    assert found["imported"] == []
