"""The embedded journal's thread waits ``kvbroker_journal_flush_ms`` between two drains;
``close`` (the process's exit) and ``flush`` wake it, so that whatever the interval every
batch applied is written, then the trailer (issue 41: at 60,000 ms a normal exit lost every
batch, at 5,000 no trailer was written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.journal import JournalSource
from broker.journal.records import RecordKind
from broker.journal.trailer import Trailer
from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.settings import OffloadSettings


@pytest.mark.parametrize("flush_ms", [5000.0, 60_000.0])
def test_close_wakes_the_journal_thread_whatever_the_flush_interval(tmp_path: Path, flush_ms: float) -> None:
    path = tmp_path / "journal"
    settings = OffloadSettings(journal=f"file://{path}", journal_flush_ms=flush_ms, journal_exit_s=3.0, client_id="wake")
    core = EmbeddedCore(settings, 50)
    intent = intent_bytes.intent_fields("r")
    for i in range(30):
        ts = intent_bytes.timestamp(1_000 + i)
        core.apply([intent_bytes.allocated(ts, intent_bytes.id_field(f"c{i}"), intent)])
    # A flush waits for what was appended, not for the interval (was: JournalError at 30 s).
    core.journal.flush(timeout=10.0)  # type: ignore[union-attr]
    for i in range(30, 60):
        ts = intent_bytes.timestamp(1_000 + i)
        core.apply([intent_bytes.allocated(ts, intent_bytes.id_field(f"c{i}"), intent)])
    core.close()
    source = JournalSource(f"file://{path}")
    batches = [r for r in source.ordered() if r.kind == RecordKind.BATCH]
    assert len(batches) == 61  # the start's clear, then every batch
    (trailer,) = [Trailer.from_record(r) for r in source.trailers()]
    assert trailer.batches == 61 and trailer.client_id == "wake"
    assert core.journal is not None and core.journal.lost == 0
