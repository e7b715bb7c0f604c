"""Install lines that work: kvbroker is on no package index, so no README, doc, code or hint
says ``pip install 'kvbroker[...]'``; the hints name the command that works from here (a
venv of its own for vllm and ray, as .ci/run keeps them; the extra's requirements into the
running Python for the others); ``kvbroker --version`` prints the version."""

from __future__ import annotations

import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from broker import extras
from broker.replay import ray_runner

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# "kvbroker[...]" as a requirement: what a package index would have to serve.
INDEX_LINE = "kvbroker["


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith((".md", ".py", ".toml", ".txt", ".yaml", ".yml", "Dockerfile")) and (ROOT / n).is_file()]


def test_no_readme_doc_or_code_installs_kvbroker_from_a_package_index() -> None:
    me = Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in tracked_text_files()
        if path.resolve() != me
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if "pip install" in line and INDEX_LINE in line
    ]
    assert found == []


@pytest.mark.parametrize("extra", sorted(extras.OWN_VENV))
def test_vllm_and_ray_go_into_a_venv_of_their_own_from_the_clone(extra: str) -> None:
    assert extra in PYPROJECT["optional-dependencies"]
    hint = extras.install_hint(extra, then=f".venv-{extra}/bin/kvbroker")
    command = f"python3 -m venv .venv-{extra} && .venv-{extra}/bin/pip install -e '.[{extra}]'"
    assert f"cd {ROOT} && {command}, then .venv-{extra}/bin/kvbroker" in hint
    # The same venv .ci/run builds for the extra's tests, and refuses in the main one.
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"python3 -m venv .venv-{extra}" in ci and f'"import {extra}"' in ci
    # The command runs as a shell would split it: no stray quoting.
    assert shlex.split(extras.clone_command(extra))[:4] == ["python3", "-m", "venv", f".venv-{extra}"]


def test_installed_from_a_wheel_the_hint_says_to_use_a_clone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "checkout", lambda: None)
    assert extras.install_hint("vllm") == (
        "install it in a venv of its own: in a kvbroker clone: python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -e '.[vllm]'"
    )


@pytest.mark.parametrize("extra", ["plot", "otlp"])
def test_a_small_extra_is_its_requirements_into_the_python_running_kvbroker(extra: str) -> None:
    argv = shlex.split(extras.install_hint(extra))
    assert argv[:4] == [sys.executable, "-m", "pip", "install"]
    assert argv[4:] == PYPROJECT["optional-dependencies"][extra]


def test_the_ray_hint_of_replay_is_the_venv_command() -> None:
    hint = ray_runner.install_hint()
    assert hint.startswith("--ray needs Ray (the [ray] extra); install it in a venv of its own: ")
    assert "python3 -m venv .venv-ray && .venv-ray/bin/pip install -e '.[ray]'" in hint
    assert INDEX_LINE not in hint


def test_kvbroker_version_prints_the_version() -> None:
    done = subprocess.run([sys.executable, "-m", "broker.cli.main", "--version"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"kvbroker {PYPROJECT['version']}"
