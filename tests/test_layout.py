"""The house's rooms: no import cycle among the project's modules, the client library free
of the broker, and the vLLM integration's two directions kept apart.

Imports are read from the sources (every ``import`` and ``from ... import``, at any depth,
those under ``if TYPE_CHECKING:`` included: a cycle that only the type checker sees is still
two modules that cannot be understood apart).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "clients", "policies", "vllm_integration")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imported(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project modules ``name`` imports (a ``from pkg import mod`` counts as ``pkg.mod``)."""

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(m for m in map(owner, targets) if m is not None)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_walker_sees_a_cycle() -> None:
    # The check itself: a graph with a loop through three modules is reported, one without is not.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_walker_reads_every_kind_of_import(tmp_path: pathlib.Path) -> None:
    modules = {
        "broker": tmp_path / "__init__.py",
        "broker.x": tmp_path / "x.py",
        "broker.y": tmp_path / "y.py",
        "broker.z": tmp_path / "z.py",
    }
    source = tmp_path / "w.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from broker import x\n"
        "if TYPE_CHECKING:\n    from broker.y import Thing\n"
        "def f():\n    import broker.z\n"
    )
    assert imported("broker.w", source, modules) == {"broker.x", "broker.y", "broker.z"}


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert {
        "broker.model.core",
        "broker.service.server",
        "broker.replay.traces.kvds",
        "clients.broker_client",
        "policies.lru",
        "vllm_integration.events_from_vllm.bridge",
        "vllm_integration.decisions_to_vllm.cache_policy",
    } <= set(graph)
    assert cycles(graph) == []


def test_clients_do_not_import_the_broker() -> None:
    # A sidecar or an engine imports clients/; it must not pull the broker (server, core,
    # journal) in. What both need (model sizes) lives in clients/.
    graph = import_graph()
    offenders = sorted(
        (name, dep) for name, deps in graph.items() if name.startswith("clients") for dep in deps if dep.startswith("broker")
    )
    assert offenders == []


def offenders(graph: dict[str, set[str]], room: tuple[str, ...], forbidden: tuple[str, ...]) -> list[tuple[str, str]]:
    """The imports from a module of ``room`` (names or their packages) of a module of ``forbidden``."""

    def within(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    return sorted((name, dep) for name, deps in graph.items() if within(name, room) for dep in deps if within(dep, forbidden))


def test_the_room_finds_what_it_forbids() -> None:
    graph = {"a.x": {"b.y", "c"}, "a": {"bb"}, "d": {"b"}}
    assert offenders(graph, ("a",), ("b",)) == [("a.x", "b.y")]


def test_clients_import_neither_the_broker_nor_the_cache_policy() -> None:
    assert offenders(import_graph(), ("clients",), ("broker", "vllm_integration.decisions_to_vllm")) == []


def test_vllms_events_and_the_hints_import_no_broker() -> None:
    # vLLM -> kvbroker (the bridge sidecar, its translator, the engine hooks) and a request's
    # KV hints run beside or inside vLLM with clients/ only.
    rooms = ("vllm_integration.events_from_vllm", "vllm_integration.hints")
    assert offenders(import_graph(), rooms, ("broker", "vllm_integration.decisions_to_vllm")) == []


def test_the_cache_policy_imports_no_server_replay_or_command_line() -> None:
    # kvbroker -> vLLM: loaded into vLLM's process, it brings the core, never a server.
    forbidden = ("broker.service", "broker.replay", "broker.cli", "vllm_integration.events_from_vllm", "vllm_integration.trace_import")
    assert offenders(import_graph(), ("vllm_integration.decisions_to_vllm",), forbidden) == []


def test_the_capture_importer_imports_the_trace_base_not_the_server() -> None:
    forbidden = ("broker.service", "broker.cli", "vllm_integration.decisions_to_vllm")
    assert offenders(import_graph(), ("vllm_integration.trace_import",), forbidden) == []


def test_only_the_doors_of_the_broker_import_the_vllm_integration() -> None:
    # The command line (the vllm-bridge verb) and the old module path vLLM configs name; the
    # rest of broker/ knows nothing of vLLM: the model, the journal and replay (its engines
    # and the vllm-events trace format reach vllm_integration/ only by the dotted paths
    # broker/replay/engines.py registers).
    doors = ("broker.cli.main", "broker.offload.vllm_policy")
    graph = import_graph()
    found = offenders(graph, ("broker",), ("vllm_integration",))
    assert sorted({name for name, _ in found}) == sorted(doors)
    assert [dep for name, dep in found if name == "broker.offload.vllm_policy"] == ["vllm_integration.decisions_to_vllm.cache_policy"]
    assert offenders(graph, ("broker.model", "broker.journal", "broker.replay"), ("vllm_integration",)) == []


def test_both_vllm_replay_engines_live_in_the_vllm_integration_and_resolve() -> None:
    from broker.replay import engines

    for target in (*engines.ENGINES.values(), engines.VLLM_CPU_TIER_CHECK, engines.VLLM_CAPTURE_READER):
        assert target.startswith("vllm_integration."), target
    assert callable(engines.load("vllm")) and callable(engines.by_path(engines.VLLM_CAPTURE_READER))
    assert not (ROOT / "broker" / "replay" / "engine_vllm.py").exists()


def test_the_broker_reaches_the_scheduler_harness_only_by_its_registered_name() -> None:
    # `replay --engine vllm-scheduler` loads the harness by the dotted path broker/replay/engines.py
    # names (imported when a job runs it): no broker module imports the harness's room.
    found = offenders(import_graph(), ("broker",), ("vllm_integration.scheduler_harness",))
    assert found == []
    from broker.replay.engines import ENGINES

    assert ENGINES["vllm-scheduler"].startswith("vllm_integration.scheduler_harness.")
