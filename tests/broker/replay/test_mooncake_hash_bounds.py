"""A Mooncake hash id is a uint64: one >= 2**64 is a bad line named in one line, exit 2,
or skipped and counted with --skip-bad, in every replay mode (issue 41 item 15: `replay
--engine vllm` ended in an OverflowError traceback, even with --skip-bad)."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.cli.main import main

GOOD = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize("hash_id", [2**64, 2**64 + 12345, 10**300], ids=["2^64", "above", "10^300"])
@pytest.mark.parametrize("engine", [["--engine", "vllm"], ["--no-decode"]], ids=["vllm", "broker"])
def test_a_hash_id_past_uint64_is_one_line_exit_2_or_skipped_and_counted(
    hash_id: int, engine: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD + f'{{"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [3, {hash_id}]}}\n')
    args = ["replay", "--trace", str(trace), "--format", "mooncake", *engine, "--hbm", "1MiB", "--policy", "lru"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"kvbroker replay: --trace: {trace}:2: hash_ids[1]: expected an integer in 0..2^64-1")
    assert len(err.strip().splitlines()[-1]) < 300

    assert main([*args, "--skip-bad", "--json"]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 bad line(s)" in captured.err and "Traceback" not in captured.err
    assert '"skipped_lines": 1' in captured.out


def test_the_largest_uint64_hash_id_is_taken(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD + f'{{"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [{2**64 - 1}]}}\n')
    assert main(["replay", "--trace", str(trace), "--format", "mooncake", "--engine", "vllm", "--hbm", "1MiB", "--policy", "lru"]) == 0
