"""A file journal's lock file (``PATH.lock``) lives only while its holder does: `repair`,
a cleanly stopped broker and a closed writer remove it; a crashed holder's is taken over.
`status` of a broker without a journal says so (issue 40 item 20)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path

import pytest

from broker.cli.main import main
from broker.config.settings import JournalConfig
from broker.journal import JournalError
from broker.journal.file import FileJournal, lock_path, release_lock, take_lock
from broker.service.server import start_broker
from tests.broker.replay.test_tail import run_engine
from tests.conftest import small_config
from tests.e2e.test_cli import start_serve


def test_repair_and_repair_check_leave_no_lock_file(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    run_engine(path, 3)
    assert not os.path.exists(lock_path(str(path)))
    assert main(["repair", "--check", str(path)]) == 0
    assert main(["repair", str(path)]) == 0
    assert os.listdir(tmp_path) == ["j.journal"]


async def test_a_closed_file_journal_and_a_cleanly_stopped_broker_leave_no_lock_file(tmp_path: Path) -> None:
    path = tmp_path / "w.journal"
    journal = FileJournal(str(path))
    await journal.start()
    assert os.path.exists(lock_path(str(path)))  # held while open
    await journal.close()
    assert not os.path.exists(lock_path(str(path)))

    served = tmp_path / "served.journal"
    config = small_config()
    config = dataclasses.replace(config, journal=JournalConfig(url=f"file://{served}"))
    broker = await start_broker(config)
    assert os.path.exists(lock_path(str(served)))
    await broker.stop(grace=0.5)
    assert sorted(os.listdir(tmp_path)) == ["served.journal", "w.journal"]


def test_a_lock_file_left_by_a_crashed_holder_is_taken_and_a_held_one_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "j.journal")
    Path(lock_path(path)).write_text("12345\n")  # a holder killed: the file stays, unlocked
    fd = take_lock(path)
    try:
        with pytest.raises(JournalError, match=f"in use by another broker \\(pid {os.getpid()}"):
            take_lock(path)
    finally:
        release_lock(path, fd)
    assert not os.path.exists(lock_path(path))


def test_a_lock_on_a_removed_lock_file_does_not_count(tmp_path: Path) -> None:
    """One process opened PATH.lock just before its holder removed it: a lock on that
    removed file must not let it write beside the next holder."""
    path = str(tmp_path / "j.journal")
    first = take_lock(path)
    stale = os.open(lock_path(path), os.O_RDWR)  # opened before the holder lets go
    release_lock(path, first)
    second = take_lock(path)  # a new PATH.lock
    try:
        assert os.fstat(stale).st_ino != os.stat(lock_path(path)).st_ino
        with pytest.raises(JournalError, match="in use"):
            take_lock(path)
    finally:
        os.close(stale)
        release_lock(path, second)


async def test_status_of_a_broker_without_a_journal_says_nothing_is_journaled(capsys: pytest.CaptureFixture[str]) -> None:
    broker = await start_broker(small_config())  # journal none
    try:
        code = await asyncio.to_thread(main, ["status", "--target", f"127.0.0.1:{broker.port}"])
    finally:
        await broker.stop(grace=0.5)
    assert code == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("journal"))
    assert line.startswith("journal none: nothing is journaled"), line
    assert "written" not in line


@pytest.mark.e2e
def test_a_real_serve_stopped_with_sigterm_leaves_no_lock_file(tmp_path: Path) -> None:
    journal = tmp_path / "serve.journal"
    proc, _ = start_serve(tmp_path, "--journal", f"file://{journal}")
    try:
        assert os.path.exists(lock_path(str(journal)))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    assert not os.path.exists(lock_path(str(journal))) and journal.exists()
