"""The replay engines' registry: names to dotted paths, and what an engine needs to run."""

from __future__ import annotations

import importlib.util

import pytest

from broker.replay import engines


def test_each_engine_names_a_function_by_its_dotted_path() -> None:
    assert set(engines.ENGINES) == {"vllm", "vllm-scheduler"}
    for target in engines.ENGINES.values():
        module, sep, function = target.partition(":")
        assert sep and module and function.isidentifier()
    assert engines.load("vllm").__name__ == "replay_engine"


def test_an_engine_without_its_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    problem = engines.missing("vllm-scheduler")
    assert problem is not None and ".venv-vllm/bin/pip install -e '.[vllm]'" in problem  # the command that works from a clone
    # The one-tier engine needs no vLLM.
    assert engines.missing("vllm") is None
