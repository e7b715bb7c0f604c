"""The guard against stale compiled modules (broker/native.py): a compiled module is imported
instead of its source, so an edited source without a rebuild must be caught."""

from __future__ import annotations

import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from broker import native
from broker.cli import main as cli

SUFFIX = EXTENSION_SUFFIXES[0]


def fake_tree(root: Path, *, compiled: bool = True, manifest: bool = True) -> Path:
    """Sources of every compiled module under ``root``, with a stand-in compiled file
    beside each (and the shared one at the top) and the build's record, as setup.py leaves them."""
    for module in native.BUILT_MODULES:
        path = native.source(module, root)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'"""{module}"""\n' if path.suffix == ".py" else f"/* {module} */\n")
        if compiled:
            path.with_name(path.stem + SUFFIX).write_bytes(b"\x7fELF")
    if compiled:
        root.joinpath(native.GROUP + "__mypyc" + SUFFIX).write_bytes(b"\x7fELF")
    if manifest:
        native.write_manifest(root)
    return root


def test_a_fresh_build_is_not_stale(tmp_path: Path) -> None:
    root = fake_tree(tmp_path)
    assert native.compiled(root) == list(native.BUILT_MODULES)
    assert native.stale(root) == []
    assert native.stale_message(root) is None
    assert native.suite_problem(root, pure=False) is None


def test_an_edited_source_is_named_with_the_command_that_rebuilds(tmp_path: Path) -> None:
    root = fake_tree(tmp_path)
    core = native.source("broker.model.core", root)
    core.write_text(core.read_text() + "x = 1\n")
    assert native.stale(root) == ["broker/model/core.py"]
    message = native.stale_message(root)
    assert message is not None and "broker/model/core.py" in message and "rebuild: pip install -e ." in message
    # The test suite refuses to run on it (tests/conftest.py exits with this message).
    assert native.suite_problem(root, pure=False) == message
    # Put back as it was built: fresh again.
    core.write_text('"""broker.model.core"""\n')
    assert native.stale(root) == []


def test_compiled_files_no_build_recorded_are_all_stale(tmp_path: Path) -> None:
    """E.g. a hand-run ``mypyc broker/model/core.py``: nothing says which sources it saw."""
    root = fake_tree(tmp_path, manifest=False)
    assert native.stale(root) == [str(native.source(m, root).relative_to(root)) for m in native.BUILT_MODULES]


def test_a_pure_install_is_never_stale_and_a_pure_run_refuses_compiled_modules(tmp_path: Path) -> None:
    pure = fake_tree(tmp_path / "pure", compiled=False, manifest=False)
    native.source("broker.model.core", pure).write_text("changed = True\n")
    assert native.stale(pure) == [] and native.suite_problem(pure, pure=True) is None
    built = fake_tree(tmp_path / "built")
    problem = native.suite_problem(built, pure=True)
    assert problem is not None and "KVBROKER_PURE_PYTHON=1 pip install -e ." in problem


def test_remove_build_leaves_the_sources_only(tmp_path: Path) -> None:
    root = fake_tree(tmp_path)
    gone = native.remove_build(root)
    assert len(gone) == len(native.BUILT_MODULES) + 2  # the modules, the shared one, the record
    assert native.compiled(root) == [] and not root.joinpath(native.MANIFEST).exists()
    assert all(native.source(m, root).exists() for m in native.BUILT_MODULES)


def test_the_cli_warns_when_a_compiled_module_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = fake_tree(tmp_path)
    monkeypatch.setattr(native, "ROOT", root)
    assert cli.main(["policies", "--json"]) == 0
    assert "warning" not in capsys.readouterr().err
    native.source("policies.lru", root).write_text("# edited\n")
    assert cli.main(["policies", "--json"]) == 0
    err = capsys.readouterr().err
    assert "kvbroker: warning: compiled modules are older than their sources (policies/lru.py changed" in err
    assert "rebuild: pip install -e ." in err


def test_this_install_imports_what_the_guard_checks() -> None:
    """The modules the guard takes for compiled are the ones Python imported compiled (and
    the conftest let this run, so none of them is stale)."""
    compiled = set(native.compiled())
    for module in native.BUILT_MODULES:
        __import__(module)
        loaded = sys.modules[module].__file__ or ""
        assert loaded.endswith(SUFFIX) == (module in compiled), (module, loaded)
    assert native.stale() == []
