"""docs/writing-a-policy.md does what it says: its example is docs/examples/mru_policy.py word
for word, that policy passes the contract suite run by the page's own command, replays by
``module:Class`` as the page shows, and a broker config takes its name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "writing-a-policy.md"
EXAMPLE = ROOT / "docs" / "examples" / "mru_policy.py"
MARKER = "<!-- docs/examples/mru_policy.py, verbatim (tests/policies/test_writing_a_policy.py checks) -->"
SPEC = "mru_policy:MRUPolicy"
KVBROKER = Path(sys.executable).parent / "kvbroker"


def example_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "docs" / "examples")}


@pytest.fixture
def importable() -> Iterator[None]:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        yield
    finally:
        sys.path.remove(str(EXAMPLE.parent))
        sys.modules.pop("mru_policy", None)


def test_the_page_shows_the_example_file_verbatim_and_it_is_about_forty_lines() -> None:
    text = DOC.read_text()
    assert MARKER in text
    block = re.search(r"```python\n(.*?)```", text[text.index(MARKER) :], re.S)
    assert block is not None and block.group(1) == EXAMPLE.read_text()
    assert len(EXAMPLE.read_text().splitlines()) <= 50


def test_the_example_passes_the_contract_suite_by_the_pages_command() -> None:
    command = re.search(r"KVBROKER_CONTRACT_POLICIES=(\S+) PYTHONPATH=(\S+) \\\n\s+\.venv/bin/python -m pytest (.*)\n", DOC.read_text())
    assert command is not None and command.group(1) == SPEC and command.group(2) == "docs/examples"
    env = {**example_env(), "KVBROKER_CONTRACT_POLICIES": SPEC}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *command.group(3).split()], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed is not None and int(passed.group(1)) >= 4, done.stdout[-2000:]  # contract, determinism, remove, declares


def test_the_example_evicts_the_most_recently_used_first(importable: None) -> None:
    from tests.policies.harness import SimTier

    tier = SimTier(SPEC, 3)
    for block_id in ("a", "b", "c"):
        tier.insert(block_id)
    tier.access("a")  # a is now the most recently used
    assert tier.insert("d") == ["a"]
    # The incoming block is protected; the next most recent goes.
    assert tier.insert("e") == ["d"]


def test_the_example_replays_by_module_and_class_beside_the_built_in_ones(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    with (ROOT / "tests" / "data" / "mooncake" / "synthetic_trace.jsonl").open() as f:
        trace.write_text("".join(next(f) for _ in range(200)))
    assert f"--policies {SPEC},lru,fifo" in DOC.read_text()
    argv = ["replay", "--trace", str(trace), "--format", "mooncake", "--no-decode", "--hbm", "1000000tok"]
    argv += ["--policies", f"{SPEC},lru", "--json"]
    done = subprocess.run(
        [str(KVBROKER), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=example_env(),
    )
    assert done.returncode == 0, done.stderr
    records = {r["policy"]: r for r in json.loads(done.stdout)}
    assert set(records) == {"mru", "lru"}
    assert records["mru"]["accesses"] == records["lru"]["accesses"] > 0
    assert records["mru"]["hit_rate"] != records["lru"]["hit_rate"]  # the order differs, so do the hits


def test_a_broker_config_names_it_as_the_page_says(importable: None) -> None:
    assert f'name = "{SPEC}"' in DOC.read_text()
    assert parse_config(f'[policy]\nname = "{SPEC}"\n').core.policy.name == SPEC
