"""The modules compiled with mypyc, and the check that their compiled form is current.

``pip install -e .`` compiles the modules below (setup.py; ``KVBROKER_PURE_PYTHON=1`` skips
it). A compiled module is an extension file (``core.cpython-311-x86_64-linux-gnu.so``)
beside its source, and Python imports it instead of the ``.py``: after an edit to
``broker/model/core.py`` without a rebuild, the broker and the tests would run the old code. So
the build records the sha256 of every source it compiled (``MANIFEST``), and ``stale()``
names each compiled module whose source no longer matches; the test suite refuses to run
and ``kvbroker`` warns while any is stale.

This module imports nothing of the project: setup.py loads it before anything is built.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

# The hot path of replay and the live broker; the other modules stay interpreted.
COMPILED_MODULES = (
    "broker.model.apply",
    "broker.model.core",
    "broker.model.stats",
    "policies.base",
    "policies.deadline_edf",
    "policies.lru",
    "policies.priority_lru",
    "policies.structures",
)

# Hand-written C extensions, by module: their source (setup.py builds them beside the
# group; the same record and staleness check cover them).
C_EXTENSIONS = {
    # The native reader of IntentBatch bytes (broker/model/wire.py says why).
    "broker.model._wire": "broker/model/_wire.c",
    # The native writer of a batch's answer, DirectiveBatch bytes (broker/model/_answer.c says why).
    "broker.model._answer": "broker/model/_answer.c",
    # Untracking objects that cannot be on a cycle (policies/_gc.c says why).
    "policies._gc": "policies/_gc.c",
}

# Everything setup.py builds, by module.
BUILT_MODULES = (*COMPILED_MODULES, *C_EXTENSIONS)

# The mypyc runtime and code shared by the compiled modules: one top-level extension module
# (mypyc derives each module's __file__ from its place, so it must sit above the packages).
GROUP = "kvbroker_native"

# sha256 of each compiled module's source at build time (written by setup.py, not in git).
MANIFEST = "broker/_native_build.json"

REBUILD = "rebuild: pip install -e . (or set KVBROKER_PURE_PYTHON=1 and reinstall, to run without compiling)"

ROOT = Path(__file__).resolve().parent.parent

# Set (to anything but 0) when installing: nothing is compiled, earlier builds are removed.
PURE_ENV = "KVBROKER_PURE_PYTHON"


def source(module: str, root: Path | None = None) -> Path:
    root = root or ROOT
    if module in C_EXTENSIONS:
        return root / C_EXTENSIONS[module]
    return root.joinpath(*module.split(".")).with_suffix(".py")


def extensions(module: str, root: Path | None = None) -> list[Path]:
    """The compiled files of ``module`` that Python would import instead of its source."""
    base = (root or ROOT).joinpath(*module.split("."))
    return [p for p in (base.with_name(base.name + suffix) for suffix in EXTENSION_SUFFIXES) if p.exists()]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(root: Path | None = None) -> None:
    """Record the sources being compiled (setup.py, before it compiles them)."""
    root = root or ROOT
    sources = {module: digest(source(module, root)) for module in BUILT_MODULES}
    root.joinpath(MANIFEST).write_text(json.dumps({"sources": sources}, indent=2, sort_keys=True) + "\n")


def remove_build(root: Path | None = None) -> list[Path]:
    """Delete the compiled files and the manifest (setup.py, for a pure Python install)."""
    root = root or ROOT
    gone = [p for module in (*BUILT_MODULES, GROUP + "__mypyc") for p in extensions(module, root)]
    manifest = root.joinpath(MANIFEST)
    if manifest.exists():
        gone.append(manifest)
    for path in gone:
        path.unlink()
    return gone


def compiled(root: Path | None = None) -> list[str]:
    """The modules of BUILT_MODULES that have a compiled file beside their source."""
    return [module for module in BUILT_MODULES if extensions(module, root)]


def stale(root: Path | None = None) -> list[str]:
    """Compiled modules whose source changed since they were built (or that no build of
    this project recorded), as source paths relative to ``root``."""
    root = root or ROOT
    names = compiled(root)
    if not names:
        return []
    try:
        recorded = json.loads(root.joinpath(MANIFEST).read_text())["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        recorded = {}
    out = []
    for module in names:
        path = source(module, root)
        if not path.exists() or recorded.get(module) != digest(path):
            out.append(str(path.relative_to(root)))
    return out


def stale_message(root: Path | None = None) -> str | None:
    """What to tell a developer who edited a compiled module's source, or None."""
    changed = stale(root)
    if not changed:
        return None
    return f"compiled modules are older than their sources ({', '.join(changed)} changed since the last build); {REBUILD}"


def suite_problem(root: Path | None = None, pure: bool | None = None) -> str | None:
    """Why the test suite must not run on this install, or None: a compiled module is
    stale, or KVBROKER_PURE_PYTHON=1 is set while compiled modules are still installed (the
    "pure" run would test compiled code)."""
    problem = stale_message(root)
    if problem:
        return problem
    if pure is None:
        pure = os.environ.get(PURE_ENV, "") not in ("", "0")
    names = compiled(root)
    if pure and names:
        return (
            f"{PURE_ENV}=1, but {len(names)} compiled modules are installed ({', '.join(names)}); reinstall: {PURE_ENV}=1 pip install -e ."
        )
    return None
