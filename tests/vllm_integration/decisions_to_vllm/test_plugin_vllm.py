"""``"eviction_policy": "kvbroker"``: vLLM finds kvbroker's CachePolicy by one short name,
through its own plugin loading (vllm.plugins.load_general_plugins reads the
``vllm.general_plugins`` entry points of the installed distributions), and builds its real
CPU offload manager with it; the module path keeps working.

The child process is a fresh vLLM process, as vLLM's engine core or API server starts: no
plugin loaded, the name unknown until the plugins load. kvbroker's distribution is the one
installed in this interpreter when there is one (a checkout's editable install, a wheel);
else its metadata is written, from pyproject.toml's entry points, the way pip writes
it (a ``.dist-info`` folder on the path), so the test also runs against a shared vLLM venv
that must not be modified.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
GROUP = "vllm.general_plugins"

CHILD = """
import json
from vllm.plugins import load_general_plugins
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from tests.vllm_integration.decisions_to_vllm import manager_driver as driver

try:
    CachePolicyFactory.get_cache_policy_cls("kvbroker")
    known_before = True
except ValueError:
    known_before = False
load_general_plugins()
spec = CPUOffloadingSpec(driver.offloading_config({"eviction_policy": "kvbroker", "kvbroker_policy": "arc"}))
manager = spec.get_manager()
policy = manager._policy
by_name = driver.random_stream(manager, 5, 4000)
by_path = driver.random_stream(driver.kvbroker_manager("arc", spec.num_chunks), 5, 4000)
print(json.dumps({
    "known_before": known_before,
    "class": f"{type(policy).__module__}.{type(policy).__qualname__}",
    "policy": policy.settings.policy,
    "capacity": policy.cache_capacity,
    "chunks": spec.num_chunks,
    "evicted": sum(len(x[3]) for x in by_name if x[0] == "store" and x[2] is not None),
    "same_as_module_path": by_name == by_path,
}))
"""


def installed_entry_points() -> list[importlib.metadata.EntryPoint]:
    return [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.dist is not None and ep.dist.name == "kvbroker"]


def declared_entry_points() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return dict(project["entry-points"][GROUP])


def write_dist_info(folder: Path) -> None:
    """kvbroker's metadata as pip writes it at install (METADATA, entry_points.txt)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = folder / f"kvbroker-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvbroker\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project["entry-points"].items():
        lines += [f"[{group}]", *(f"{name} = {target}" for name, target in entries.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))


def test_vllm_loads_the_plugin_and_builds_its_manager_with_eviction_policy_kvbroker(tmp_path: Path) -> None:
    path = [str(ROOT)]
    installed = installed_entry_points()
    if installed:
        # The real install: its entry point is the one pyproject.toml declares.
        assert {ep.name: ep.value for ep in installed} == declared_entry_points()
    else:
        write_dist_info(tmp_path / "site")
        path.insert(0, str(tmp_path / "site"))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}  # every plugin, as vLLM loads by default
    env["PYTHONPATH"] = os.pathsep.join(path)
    # Run from an empty folder: Python puts the working directory first on the path, and a
    # checkout's kvbroker.egg-info (a by-product of building it) would then hide the metadata.
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=540, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["known_before"] is False  # the name comes from the plugin, not from vLLM
    assert found["class"] == "vllm_integration.decisions_to_vllm.cache_policy.KvbrokerCachePolicy"
    assert (found["policy"], found["capacity"]) == ("arc", found["chunks"])
    # It decides, and decides as the same policy loaded by module path.
    assert found["evicted"] > 100
    assert found["same_as_module_path"] is True


def test_the_plugin_registers_once_however_often_vllm_calls_it() -> None:
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    from vllm_integration.decisions_to_vllm import plugin
    from vllm_integration.decisions_to_vllm.cache_policy import KvbrokerCachePolicy

    plugin.register()
    plugin.register()  # vLLM loads plugins once per process; a second call must not raise
    assert CachePolicyFactory.get_cache_policy_cls("kvbroker") is KvbrokerCachePolicy
