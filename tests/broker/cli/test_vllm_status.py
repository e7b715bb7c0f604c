"""`kvbroker vllm-status PATH`: the status file the kvbroker CachePolicy writes inside vLLM,
as a table or its JSON; a file that is missing, unreadable or garbled is one line naming the
path and the reason, exit 2, never a traceback (fuzzed)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cli.main import main
from vllm_integration.decisions_to_vllm.report import Reporter
from vllm_integration.decisions_to_vllm.settings import OffloadSettings


def snapshot() -> dict[str, Any]:
    return {
        "client_id": "vllm-dp1",
        "pid": 4242,
        "time": time.time() - 12.0,
        "policy": "history_arc",
        "capacity": 1953,
        "rows": [
            {"role": "decider", "policy": "history_arc", "capacity": 1953, "hits": 18962, "asked": 60000,
             "hit_ratio": 18962 / 60000, "sample_rate": 1.0},
            {"role": "whatif", "policy": "history_arc", "capacity": 3906, "hits": 300, "asked": 600, "hit_ratio": 0.5, "sample_rate": 0.01},
        ],
    }  # fmt: skip


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["vllm-status", *argv])
    return code, out.getvalue(), err.getvalue()


def test_the_table_of_a_file_the_reporter_wrote(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    Reporter(snapshot, OffloadSettings(status_file=str(path), metrics_port=0)).close()
    code, out, err = run(str(path))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("client vllm-dp1, pid 4242, policy history_arc, CPU tier 1953 chunks; written ")
    age = float(lines[0].rsplit(", ", 1)[1].removesuffix(" s ago"))
    assert 11.5 < age < 60  # the snapshot's time, not the file's
    assert lines[2].split() == ["role", "policy", "capacity", "hits", "asked", "hit_ratio", "sample_rate"]
    assert lines[4].split() == ["decider", "history_arc", "1953", "18962", "60000", "0.3160", "1"]
    assert lines[5].split() == ["whatif", "history_arc", "3906", "300", "600", "0.5000", "0.01"]
    assert lines[6].startswith("metrics: http://127.0.0.1:")  # where to scrape, when it served


def test_json_prints_the_files_object(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    written = snapshot()
    path.write_text(json.dumps({**written, "from_a_newer_writer": [1, 2]}))
    code, out, _ = run(str(path), "--json")
    assert code == 0 and json.loads(out) == {**written, "from_a_newer_writer": [1, 2]}


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "cannot read it: No such file or directory"),
        ("", "not JSON (Expecting value: line 1 column 1 (char 0)); empty or half written? the writer replaces it whole"),
        ('{"client_id": "v", "pid"', "not JSON ("),
        (b"\xff\xfe{}", "not UTF-8 text (byte 0)"),
        ("[1, 2]", "expected a JSON object, got list"),
        ("{}", "client_id: missing"),
        ("rows=7", "rows: expected a list, got 7"),
        ("rows=[3]", "rows[0]: expected an object, got 3"),
        ('hits="many"', 'rows[0].hits: expected an integer >= 0, got "many"'),
        ("hits=true", "rows[0].hits: expected an integer >= 0, got true"),
        ("hits=-1", "rows[0].hits: expected an integer >= 0, got -1"),
        ("hit_ratio=NaN", "rows[0].hit_ratio: expected a finite number, got NaN"),
        ("time=" + "9" * 400, "time: expected a finite number, got 999999"),
        ("nested", "not a status file (JSON nested too deep)"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_path_and_the_reason_exit_2(tmp_path: Path, content: Any, reason: str) -> None:
    path = tmp_path / "status.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif isinstance(content, str) and "=" in content:
        field, _, value = content.partition("=")
        good = snapshot()
        target = good if field in ("rows", "time") else good["rows"][0]
        target[field] = json.loads(value) if value != "NaN" else float("nan")
        path.write_text(json.dumps(good))
    elif content is not None:
        path.write_text(content)
    code, out, err = run(str(path))
    assert (code, out) == (2, "")
    assert err.startswith(f"kvbroker vllm-status: PATH: {path}: {reason}") and err.count("\n") == 1


def test_a_folder_or_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    code, _, err = run(str(tmp_path))
    assert code == 2 and err == f"kvbroker vllm-status: PATH: {tmp_path}: cannot read it: a folder, not a regular file\n"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, _, err = run(str(fifo))
    assert code == 2 and "a FIFO (named pipe), not a regular file" in err


def test_control_characters_of_the_file_are_escaped_in_the_table(tmp_path: Path) -> None:
    # A status file is written by another process (or anyone who can write its folder):
    # its strings must not reach the terminal as escape sequences (clear the screen, set
    # the title, hide text). Printable letters of any script stay as they are.
    status = snapshot()
    status["client_id"] = "vllm\x1b[2J\x1b]0;owned\x07"
    status["policy"] = "lru\r\u202eétoile"
    status["rows"][0]["role"] = "decider\x1b[8m"
    status["rows"][0]["policy"] = "arc\x9b31m"
    status["metrics_url"] = "http://x\x1b[1A"
    path = tmp_path / "status.json"
    path.write_text(json.dumps(status))
    code, out, err = run(str(path))
    assert (code, err) == (0, "")
    assert all(ch.isprintable() for ch in out.replace("\n", ""))
    assert out.startswith("client vllm\\x1b[2J\\x1b]0;owned\\x07, pid 4242, policy lru\\r\\u202eétoile, ")
    assert "decider\\x1b[8m" in out and "arc\\x9b31m" in out and "metrics: http://x\\x1b[1A" in out
    # --json prints the file's object, escaped by JSON itself.
    code, out, _ = run(str(path), "--json")
    assert code == 0 and "\x1b" not in out and json.loads(out)["client_id"] == status["client_id"]


def check_never_raises(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "s.json")
        with open(path, "wb") as f:
            f.write(data)
        code, out, err = run(path)
    assert code in (0, 2)
    assert (code == 0) == (err == "") == out.startswith("client ") and "Traceback" not in err
    if code == 2:
        assert err.startswith(f"kvbroker vllm-status: PATH: {path}: ") and err.count("\n") == 1


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_bytes_never_raise(data: bytes) -> None:
    check_never_raises(data)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


FIELDS = ["client_id", "pid", "time", "policy", "capacity", "rows", "role", "hits", "asked", "hit_ratio", "sample_rate"]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(FIELDS), JSON)
def test_a_good_file_with_any_field_replaced_never_raises(field: str, value: Any) -> None:
    """A field of a sound file set to any JSON value: shown, or refused naming it."""
    status = snapshot()
    (status if field in status else status["rows"][1])[field] = value
    check_never_raises(json.dumps(status).encode())
