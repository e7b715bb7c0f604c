"""Build: compiles the hot path (broker.native.COMPILED_MODULES) with mypyc, and the C
extensions (broker.native.C_EXTENSIONS).

Everything else about the package is in pyproject.toml. ``KVBROKER_PURE_PYTHON=1`` skips
the compilation and removes the compiled files an earlier build left beside the sources,
so the interpreted code runs. Either way ``pip install -e .`` (or ``pip install .``) is the
one command; the mypy that compiles is pinned in pyproject.toml's [build-system].
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent


def load_native() -> ModuleType:
    """broker/native.py, by path: importing the broker package here would import the
    compiled modules of an earlier build."""
    spec = importlib.util.spec_from_file_location("_kvbroker_native", ROOT / "broker" / "native.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ext_modules() -> list[Extension]:
    native = load_native()
    if os.environ.get(native.PURE_ENV, "") not in ("", "0"):
        for path in native.remove_build(ROOT):
            print(f"{native.PURE_ENV}: removed {path.relative_to(ROOT)}", file=sys.stderr)
        return []
    from mypyc.build import mypycify

    native.write_manifest(ROOT)
    sources = [str(native.source(module, ROOT).relative_to(ROOT)) for module in native.COMPILED_MODULES]
    # The same input on every machine: pip runs this before it installs the dependencies
    # (and mypy would find them in the target environment if they are there already), so
    # the compiler never looks at installed packages; their types are Any to it. (CI's mypy
    # checks the code against them.)
    flags = ["--no-site-packages", "--ignore-missing-imports"]
    extensions: list[Extension] = mypycify([*flags, *sources], opt_level="3", group_name=native.GROUP)
    extensions += [Extension(module, [path], extra_compile_args=["-O2"]) for module, path in native.C_EXTENSIONS.items()]
    return extensions


setup(ext_modules=ext_modules())
