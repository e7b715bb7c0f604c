"""The command that installs one of kvbroker's optional extras, for the hints that name it.

kvbroker is not on a package index: asking pip for ``kvbroker[ray]`` by name finds nothing. What works:

- ``vllm`` and ``ray`` (``OWN_VENV``) go into a venv of their own, beside the clone's
  ``.venv``, with kvbroker installed in it from the clone: ``python3 -m venv .venv-vllm &&
  .venv-vllm/bin/pip install -e '.[vllm]'``. Each brings a large tree (vLLM pins torch) that
  the main venv must not carry: .ci/run refuses a ``.venv`` that imports either, and their
  tests run in those venvs (README "Development").
- the others (``plot``, ``otlp``, ...) are a few packages: the hint installs the extra's
  requirements into the Python that runs kvbroker, from the installed metadata (so it works
  from a wheel as well as from a clone).

Imports nothing of the project: the CLI, replay and the service call it in their errors.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import sys
import tomllib
from pathlib import Path

DIST = "kvbroker"
# Extras kept out of the main venv: a venv of their own, named .venv-EXTRA (as .ci/run names them).
OWN_VENV = frozenset({"vllm", "ray"})

_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def checkout() -> Path | None:
    """The clone kvbroker runs from (an editable install, or a checkout on PYTHONPATH), else
    None (installed from a wheel: the package sits in site-packages, no pyproject.toml beside)."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    try:
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None
    return root if name == DIST else None


def package_version() -> str:
    """kvbroker's version: the installed metadata's, else the clone's pyproject.toml's."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        pass
    root = checkout()
    if root is None:
        return "unknown"
    return str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"])


def requirements(extra: str) -> list[str]:
    """The requirements ``extra`` adds, from the installed metadata, else the clone's pyproject.toml."""
    try:
        declared = importlib.metadata.requires(DIST) or []
    except importlib.metadata.PackageNotFoundError:
        declared = []
    found = []
    for line in declared:
        requirement, _, marker = line.partition(";")
        match = _EXTRA_MARKER.search(marker)
        if match and match.group(1) == extra:
            found.append(requirement.strip().replace(" ", ""))
    if found:
        return found
    root = checkout()
    if root is None:
        return []
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    return list(extras.get(extra, []))


def venv_of(extra: str) -> str:
    """The venv an own-venv extra goes into, relative to the clone."""
    return f".venv-{extra}"


def clone_command(extra: str) -> str:
    """The shell command, run in a kvbroker clone, that installs ``extra`` where it belongs."""
    if extra in OWN_VENV:
        venv = venv_of(extra)
        return f"python3 -m venv {venv} && {venv}/bin/pip install -e '.[{extra}]'"
    return f".venv/bin/pip install -e '.[{extra}]'"


def install_hint(extra: str, then: str = "") -> str:
    """One line: how to install ``extra`` from here. ``then``: what to run afterwards, for an
    own-venv extra (e.g. ``.venv-ray/bin/kvbroker replay ... --ray``)."""
    if extra in OWN_VENV:
        root = checkout()
        where = f"cd {shlex.quote(str(root))} && " if root is not None else "in a kvbroker clone: "
        after = f", then {then}" if then else ""
        return f"install it in a venv of its own: {where}{clone_command(extra)}{after}"
    return pip_install(*requirements(extra))


def pip_install(*packages: str) -> str:
    """The command that installs ``packages`` into the Python running kvbroker."""
    return f"{shlex.quote(sys.executable)} -m pip install " + " ".join(shlex.quote(p) for p in packages)
