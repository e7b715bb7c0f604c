"""A trace line longer than the bound is one bad line naming its number, read past in pieces
(never held whole), and counted with --skip-bad; a FIFO is no trace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from broker.replay.traces.base import MAX_LINE_BYTES, SkipCounter, TraceError, read_jsonl


def write(path: Path, *lines: bytes) -> Path:
    path.write_bytes(b"".join(lines))
    return path


def test_a_line_over_the_bound_is_named(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", b'{"a": 1}\n', b'{"b": "' + b"x" * 200 + b'"}\n', b'{"c": 3}\n')
    with pytest.raises(TraceError) as caught:
        list(read_jsonl(str(path), SkipCounter(), max_line=64))
    assert (caught.value.line, caught.value.field) == (2, "line")
    assert "longer than 64 bytes" in caught.value.reason


def test_skip_bad_reads_past_it_and_keeps_the_numbering(tmp_path: Path) -> None:
    # The long line is the last one and has no newline; the one at the bound exactly is kept.
    at_bound = b'{"k": "' + b"y" * (64 - 9) + b'"}'
    assert len(at_bound) == 64
    path = write(tmp_path / "t.jsonl", b'{"a": 1}\n', b'{"b": "' + b"x" * 5000 + b'"}\n', at_bound + b"\n", b"[" * 100)
    skips = SkipCounter(skip_bad=True)
    got = list(read_jsonl(str(path), skips, max_line=64))
    assert [n for n, _ in got] == [1, 3]
    assert skips.skipped == 2  # the long line, and the unterminated long tail
    assert "t.jsonl:2: line: longer than 64 bytes" in skips.examples[0]
    assert "t.jsonl:4: line: longer than 64 bytes" in skips.examples[1]


def test_the_default_bound() -> None:
    assert MAX_LINE_BYTES == 16 * 2**20  # docs/cli.md names it


def test_a_fifo_is_no_trace(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(TraceError, match="FIFO"):
        list(read_jsonl(str(fifo), SkipCounter()))
