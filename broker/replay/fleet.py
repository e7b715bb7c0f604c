"""Fleet replay: many journals (one per broker, i.e. per inference pod) in one sweep.

``expand_journals`` turns the ``--journal`` values into one journal each: a Redis URL whose
``?stream=`` (or ``--stream``) holds a glob pattern (``kvbroker:*:journal``) names every
stream key that matches, found with SCAN (on a cluster, on every master); a ``file://``
path with a pattern names every file that matches. Each becomes one source of the sweep.

``with_fleet_totals`` puts after the per-pod records of each point of the sweep (policy,
parameters, capacities, intent) one record for the whole fleet: ``source`` is ``"fleet"``
and ``sources`` the number of pods in it. Its counts are the pods' sums, its rates and
percentiles are recomputed from the summed counts and latency histograms (not averaged),
its capacities are the pods' summed, and ``seconds`` is the replay time of all its jobs.
"""

from __future__ import annotations

import glob
import json
from typing import Any

import redis

from broker.journal import JournalError, file_path, split_redis_url
from broker.journal.redis_stream import directives_key, redact
from broker.journal.redis_urls import is_redis_url, sync_client
from broker.model.stats import CoreStats

FLEET = "fleet"
DIRECTIVES_SUFFIX = directives_key("")
_GLOB = ("*", "?", "[")

# Counts a fleet row sums.
SUMMED = (
    "batches",
    "events",
    "accesses",
    "prompt_blocks",
    "prefix_hits",
    "dc_accesses",
    "dc_misses",
    "demotions",
    "evictions",
    "prefetches",
    "recomputes",
    "bytes_up",
    "bytes_down",
    "bytes_moved",
    "directives",
    "rejected_events",
    "deadline_accesses",
    "deadline_misses",
    "skipped_lines",
    "seconds",
)


def is_pattern(text: str | None) -> bool:
    return text is not None and any(c in text for c in _GLOB)


def expand_journals(urls: list[str], stream: str | None = None) -> list[tuple[str, str | None]]:
    """(journal URL, stream key or None) for every journal the ``--journal`` values name,
    in the order given, patterns expanded in sorted order. Raises JournalError when a
    pattern matches nothing."""
    out: list[tuple[str, str | None]] = []
    for url in urls:
        if is_redis_url(url):
            conn, key = split_redis_url(url)
            key = key or stream
            if key is not None and is_pattern(key):
                keys = scan_streams(conn, key)
                if not keys:
                    raise JournalError(f"{redact(conn)}: no stream matches {key!r}")
                out.extend((conn, k) for k in keys)
            else:
                out.append((url, stream))
        elif is_pattern(file_path(url)):
            paths = sorted(glob.glob(file_path(url)))
            if not paths:
                raise JournalError(f"no journal file matches {file_path(url)!r}")
            out.extend((f"file://{p}", None) for p in paths)
        else:
            out.append((url, stream))
    return list(dict.fromkeys(out))  # a journal named twice is one source


def scan_streams(url: str, pattern: str) -> list[str]:
    """The stream keys matching ``pattern`` (SCAN ... TYPE stream), sorted; a journal's
    directives stream (``KEY:directives``) is not a journal of its own."""
    try:
        client = sync_client(url, socket_timeout=10)
        try:
            keys = {k.decode() if isinstance(k, bytes) else str(k) for k in client.scan_iter(match=pattern, count=1000, _type="stream")}
        finally:
            client.close()
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
        # Nothing listening, or no Redis there (an HTTP port): said as a journal without a
        # pattern says it (stream_exists), one line.
        raise JournalError(f"cannot reach Redis at {redact(url)}: {exc}") from None
    return sorted(k for k in keys if not k.endswith(DIRECTIVES_SUFFIX))


def group_key(record: dict[str, Any], combo: int) -> str:
    """The point of the sweep a record is at, across sources."""
    return json.dumps([combo, record["policy"], record.get("intent"), record.get("params")], sort_keys=True)


def with_fleet_totals(records: list[dict[str, Any]], combos: list[int]) -> list[dict[str, Any]]:
    """The records with a fleet row after the last pod record of each sweep point that more
    than one source reached (``combos[i]``: the capacity point of ``records[i]``)."""
    groups: dict[str, list[int]] = {}
    for i, (record, combo) in enumerate(zip(records, combos, strict=True)):
        groups.setdefault(group_key(record, combo), []).append(i)
    last = {members[-1]: members for members in groups.values() if len({records[i]["source"] for i in members}) > 1}
    out: list[dict[str, Any]] = []
    for i, record in enumerate(records):
        out.append(record)
        if i in last:
            out.append(fleet_total([records[j] for j in last[i]]))
    return out


def fleet_total(pods: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for several pods' records of the same sweep point."""
    first = pods[0]
    total: dict[str, Any] = {key: first[key] for key in first}
    for key in SUMMED:
        if key in first:
            total[key] = sum(p[key] for p in pods)
    for key in ("accesses_by_tier", "capacity_bytes", "capacity_tokens", "latency_hist"):
        if first.get(key) is None:
            continue
        merged: dict[str, int] = {}
        for pod in pods:
            for name, value in (pod.get(key) or {}).items():
                merged[name] = merged.get(name, 0) + value
        total[key] = merged
    total["latency_hist"] = dict(sorted(total["latency_hist"].items(), key=lambda kv: int(kv[0])))
    accesses, prompt = total["accesses"], total["prompt_blocks"]
    top = next(iter(total["accesses_by_tier"]), None)
    total["hit_rate"] = total["accesses_by_tier"][top] / accesses if accesses and top is not None else 0.0
    total["prefix_hit_rate"] = total["prefix_hits"] / prompt if prompt else 0.0
    # The pods' rates weighted by their prompt blocks and accesses: what the summed counts
    # the records do not carry (prefix hits in any tier, total latency) give.
    total["prefix_hit_rate_any_tier"] = sum(p["prefix_hit_rate_any_tier"] * p["prompt_blocks"] for p in pods) / prompt if prompt else 0.0
    total["mean_us"] = sum(p["mean_us"] * p["accesses"] for p in pods) / accesses if accesses else 0.0
    total["dc_miss_rate"] = total["dc_misses"] / total["dc_accesses"] if total["dc_accesses"] else 0.0
    dl = total["deadline_accesses"]
    total["deadline_miss_rate"] = total["deadline_misses"] / dl if dl else 0.0
    stats = CoreStats(0)
    stats.latency_hist = {int(k): v for k, v in total["latency_hist"].items()}
    for key, q in (("p50_us", 0.50), ("p95_us", 0.95), ("p99_us", 0.99)):
        total[key] = stats.latency_percentile(q)
    total["events_per_s"] = total["events"] / total["seconds"] if total.get("seconds") else 0.0
    verified = [p["verified"] for p in pods]
    # Yes only when every pod verified; NO when one did not reproduce its journal; else
    # not verified (a pod whose live policy was another: this row verifies nothing there).
    total["verified"] = True if all(v is True for v in verified) else False if any(v is False for v in verified) else None
    mismatches = [p["mismatches"] for p in pods if p["mismatches"] is not None]
    total["mismatches"] = sum(mismatches) if mismatches else None
    total.pop("first_mismatch", None)
    total["source"] = FLEET
    total["sources"] = len(pods)
    return total
