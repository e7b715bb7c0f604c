"""The real `kvbroker` fed hostile files (issue 33, items 12 to 15): a FIFO where a file is
read, a line too long to hold, a journal record whose checksum is right and whose payload is
garbage, an --out that is a FIFO or a symbolic link. Each is one line on stderr that names
the flag or the record, exit 2 (repair: it cuts the record), never a hang or a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.journal.file import read_file_journal
from broker.journal.records import MAGIC, JournalRecord, RecordKind, encode

pytestmark = pytest.mark.e2e

KVBROKER = Path(sys.executable).parent / "kvbroker"
MOONCAKE = Path(__file__).parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl"
# A FIFO blocks its reader until a writer comes: a hang shows as this timeout.
TIMEOUT_S = 30


def run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([str(KVBROKER), *argv], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvbroker {' '.join(argv)} hung for {TIMEOUT_S} s")


def one_line(proc: subprocess.CompletedProcess[str], *names: str) -> str:
    """The process said one line on stderr, naming each of ``names``, and exited 2."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.jsonl"
    os.mkfifo(path)
    return path


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(MOONCAKE.read_text().splitlines(keepends=True)[:3]))
    return path


# ---- item 12: a FIFO is no file to read -------------------------------------------------


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["replay", "--journal", "{fifo}", "--policy", "lru"], "--journal"),
        (["replay", "--journal", "file://{fifo}", "--policies", "lru,fifo"], "--journal"),
        (["replay", "--journal", "file://{dir}/pipe.*", "--policy", "lru"], "--journal"),  # a glob match
        (["replay", "--trace", "{fifo}", "--format", "mooncake", "--policy", "lru"], "--trace"),
        (["replay", "--trace", "{fifo}", "--format", "vllm-events", "--policy", "lru"], "--trace"),
        (["replay", "--trace", "{fifo}", "--format", "kvds-events", "--policy", "lru"], "--trace"),
        (["import", "--trace", "{fifo}", "--format", "mooncake", "--out", "{dir}/o.journal"], "--trace"),
        (["repair", "{fifo}"], "journal"),
        (["serve", "--listen", "127.0.0.1:0", "--journal", "{fifo}"], "--journal"),
    ],
    ids=["journal", "journal-url", "journal-glob", "mooncake", "vllm-events", "kvds", "import", "repair", "serve"],
)
def test_a_fifo_is_refused_not_waited_on(argv: list[str], flag: str, fifo: Path) -> None:
    proc = run(*(a.format(fifo=fifo, dir=fifo.parent) for a in argv))
    one_line(proc, flag, "FIFO", "not a regular file")


# ---- item 14: a line longer than the bound --------------------------------------------------


def test_a_line_beyond_the_bound_is_named_by_its_number(tmp_path: Path) -> None:
    # 17 MiB of one valid request, over the 16 MiB bound (its JSON would parse today).
    path = tmp_path / "long.jsonl"
    with path.open("wb") as f:
        f.write(b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
        f.write(b'{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [' + b"7, " * (17 * 2**20 // 3) + b"8]}\n")
    line = one_line(run("replay", "--trace", str(path), "--format", "mooncake", "--policy", "lru"), "--trace")
    assert f"{path}:2: line: longer than {16 * 2**20} bytes" in line
    # --skip-bad skips it (unread) and counts it; the other line is replayed.
    proc = run("import", "--trace", str(path), "--format", "mooncake", "--out", str(tmp_path / "o.journal"), "--skip-bad")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["skipped_lines"] == 1


# ---- item 15: import --out never replaces what is not a regular file -------------------------


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-file", "dangling-symlink"])
def test_import_out_refuses_what_is_not_a_regular_file(kind: str, tmp_path: Path, trace: Path) -> None:
    out = tmp_path / "out.journal"
    target = tmp_path / "target"
    if kind == "fifo":
        os.mkfifo(out)
    else:
        if kind == "symlink-to-file":
            target.write_bytes(b"keep")
        out.symlink_to(target)
    before = os.lstat(out)
    line = one_line(run("import", "--trace", str(trace), "--format", "mooncake", "--out", str(out)), "--out", str(out))
    assert ("FIFO" if kind == "fifo" else "symbolic link") in line
    after = os.lstat(out)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)  # untouched
    assert not target.exists() or target.read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out.journal", "trace.jsonl"] + (["target"] if target.exists() else []))


def test_import_out_replaces_a_regular_file_and_writes_a_new_one(tmp_path: Path, trace: Path) -> None:
    old = tmp_path / "old.journal"
    old.write_bytes(b"an earlier import")
    for out in (old, tmp_path / "new.journal"):
        proc = run("import", "--trace", str(trace), "--format", "mooncake", "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        assert out.read_bytes().startswith(b"KVBJRNL1")
        assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~current_umask())
    assert not list(tmp_path.glob("*.importing"))


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- item 13: a record whose checksum is right and whose payload is garbage -----------------


def journal_with_bad_record(path: Path, kind: RecordKind, trace: Path) -> int:
    """A journal imported from ``trace`` (a CONFIG record, then batches) with a record of
    ``kind`` holding garbage put after the first batch, framed by the journal's own writer
    (its CRC is right); returns that record's byte offset."""
    good = path.with_suffix(".good")
    proc = run("import", "--trace", str(trace), "--format", "mooncake", "--out", str(good))
    assert proc.returncode == 0, proc.stderr
    records = list(read_file_journal(str(good)))
    assert [r.kind for r in records[:2]] == [RecordKind.CONFIG, RecordKind.BATCH] and len(records) >= 3
    head = MAGIC + encode(records[0]) + encode(records[1])
    garbage = b"\xff\xff\xff\xff not a batch" if kind == RecordKind.BATCH else b"{not json"
    path.write_bytes(head + encode(JournalRecord(kind, 1, 1, garbage)) + b"".join(encode(r) for r in records[2:]))
    return len(head)


@pytest.fixture
def long_trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace20.jsonl"
    path.write_text("".join(MOONCAKE.read_text().splitlines(keepends=True)[:20]))
    return path


@pytest.mark.parametrize("kind", [RecordKind.BATCH, RecordKind.CONFIG], ids=["batch", "config"])
@pytest.mark.parametrize(
    "policies", [["--policy", "lru"], ["--policies", "lru,fifo"], ["--policy", "belady"]], ids=["one", "two", "offline"]
)
def test_replay_names_the_bad_record(kind: RecordKind, policies: list[str], tmp_path: Path, long_trace: Path) -> None:
    journal = tmp_path / "j.journal"
    offset = journal_with_bad_record(journal, kind, long_trace)
    where = f"record 3 (a {kind.name} record at byte offset {offset})"
    line = one_line(run("replay", "--journal", str(journal), *policies), "--journal", where)
    assert ("not a valid IntentBatch" if kind == RecordKind.BATCH else "not a config") in line


@pytest.mark.parametrize("kind", [RecordKind.BATCH, RecordKind.CONFIG], ids=["batch", "config"])
def test_repair_cuts_the_bad_record_and_keeps_the_rest(kind: RecordKind, tmp_path: Path, long_trace: Path) -> None:
    journal = tmp_path / "j.journal"
    offset = journal_with_bad_record(journal, kind, long_trace)
    total = len(list(read_file_journal(str(journal))))
    check = run("repair", "--check", "--json", str(journal))
    assert check.returncode == 1, check.stderr  # damaged
    report = json.loads(check.stdout)
    assert report["damaged"] and not report["written"]
    assert report["records_kept"] == total - 1
    assert [c["offset"] for c in report["cuts"]] == [offset] == [b["offset"] for b in report["bad_records"]]
    fixed = run("repair", str(journal))
    assert fixed.returncode == 0 and f"the record at offset {offset}" in fixed.stdout, fixed.stderr
    assert len(list(read_file_journal(str(journal)))) == total - 1
    assert run("repair", "--check", str(journal)).returncode == 0  # sound now
    proc = run("replay", "--journal", str(journal), "--policy", "lru", "--json")
    assert proc.returncode == 0, proc.stderr
    batches = sum(1 for r in read_file_journal(str(journal)) if r.kind == RecordKind.BATCH)
    assert json.loads(proc.stdout)[0]["batches"] == batches


@pytest.mark.parametrize("kind", [RecordKind.BATCH, RecordKind.CONFIG], ids=["batch", "config"])
def test_serve_refuses_a_journal_with_a_bad_record_in_one_line(kind: RecordKind, tmp_path: Path, long_trace: Path) -> None:
    journal = tmp_path / "j.journal"
    offset = journal_with_bad_record(journal, kind, long_trace)
    before = journal.read_bytes()
    proc = run("serve", "--listen", "127.0.0.1:0", "--journal", str(journal), "--log-level", "warning")
    line = one_line(proc, "journal", f"record 3 (a {kind.name} record at byte offset {offset})", f"kvbroker repair {journal}")
    assert "does not start" in line
    assert journal.read_bytes() == before  # nothing cut behind the operator's back
