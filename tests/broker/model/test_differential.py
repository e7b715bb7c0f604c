"""The compiled core and policies decide exactly what the pure Python reference decides.

On seeded random event streams (tests/broker/model/differential.py), for every online
policy: each batch's directives (every field of their key) and rejections, the final
residency and the metrics are equal, compiled (this process, when the install is compiled)
and pure (a child process that imports the sources). In the pure build (``.ci/run``'s pure
step) both sides are the reference: the test then checks the harness runs there too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from policies import registry
from tests.broker.model.differential import build_flavour, outcome

ROOT = Path(__file__).parents[3]
ONLINE = [name for name in registry.names() if not registry.policy_class(name).offline]
SEEDS = (1, 2, 3)


def pure_outcomes(seed: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.broker.model.differential", "--pure", "--policy", ",".join(ONLINE), "--seed", str(seed)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["build"] == "pure", "the child must run the sources, not the compiled modules"
    return found["outcomes"]


@pytest.mark.parametrize("seed", SEEDS)
def test_compiled_and_pure_decide_the_same_on_a_random_stream(seed: int) -> None:
    reference = pure_outcomes(seed)
    for policy in ONLINE:
        mine = json.loads(json.dumps(outcome(policy, seed)))
        theirs = reference[policy]
        for i, (a, b) in enumerate(zip(mine["batches"], theirs["batches"], strict=True)):
            assert a == b, f"{policy} seed {seed}: batch {i} differs ({build_flavour()} vs pure)"
        assert mine == theirs, f"{policy} seed {seed}: residency or metrics differ ({build_flavour()} vs pure)"


def test_the_stream_exercises_the_eviction_demotion_and_prefetch_paths() -> None:
    """The comparison means something only if the stream makes the core decide."""
    runs = [outcome("deadline_edf", seed) for seed in SEEDS]
    kinds = {d[1] for found in runs for batch in found["batches"] for d in batch["directives"]}
    assert {1, 2, 4} <= kinds, kinds  # evict, demote, prefetch, over the seeds compared
    for found in runs:
        assert any(batch["rejections"] for batch in found["batches"])
        assert found["residency"], "blocks left resident at the end"
