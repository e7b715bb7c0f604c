"""Journals of a small fleet for the fleet and Ray replay tests: the repository's traces
imported into file journals (``kvbroker import``), and copied by the broker's own Redis
writer into Redis streams named like a fleet's (``PREFIX:POD:journal``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from broker.cli.main import main
from broker.journal import open_journal
from broker.journal.file import read_file_journal

DATA = Path(__file__).resolve().parents[2] / "data"
# (pod, trace, format, more import flags): two pods that saw different workloads, a few
# thousand events each.
PODS = (
    ("pod-a", str(DATA / "kvds" / "deadline_pressure.jsonl"), "kvds-events", ()),
    ("pod-b", "balanced", "profile", ("--scale", "0.2")),
)
TIERS = """
[[tiers]]
name = "hbm"
capacity = "96MiB"
[[tiers]]
name = "dram"
capacity = "1GiB"
"""


def file_journals(directory: Path) -> list[Path]:
    """One journal file per pod, each with a config record (two tiers)."""
    config = directory / "tiers.toml"
    config.write_text(TIERS)
    paths = []
    for pod, trace, fmt, flags in PODS:
        out = directory / f"{pod}.journal"
        assert main(["import", "--trace", trace, "--format", fmt, *flags, "--out", f"file://{out}", "--config", str(config)]) == 0
        paths.append(out)
    return paths


def copy_to_redis(paths: list[Path], url: str, prefix: str) -> list[str]:
    """Each journal file written to ``PREFIX:POD:journal`` by RedisJournal; the keys."""

    async def copy(path: Path, key: str) -> None:
        journal = open_journal(url, stream=key, maxlen=10_000_000, fsync=False, max_group=512, spool_dir="")
        await journal.start()
        for record in read_file_journal(str(path)):
            journal.append(record)
        await journal.close()

    keys = []
    for path in paths:
        key = f"{prefix}:{path.stem}:journal"
        asyncio.run(copy(path, key))
        keys.append(key)
    return keys
