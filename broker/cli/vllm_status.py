"""`kvbroker vllm-status PATH`: what the kvbroker CachePolicy inside vLLM wrote to its
status file (``kvbroker_status_file``; vllm_integration/decisions_to_vllm/report.py), as a table or JSON.

Kept apart from broker/cli/main.py so the verb is one ``add_parser(subparsers)`` call to wire in.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Mapping
from typing import Any, Final

from broker.cli.checks import BadInput
from clients.regular_file import open_regular

# A status file holds a few rows; anything far larger is not one (and is not read whole).
MAX_BYTES: Final = 16 * 2**20
# The fields of the file and of each row, and what each must be (more fields are allowed:
# a newer writer may add some).
TOP: Final = {"client_id": str, "pid": int, "time": float, "policy": str, "capacity": int, "rows": list}
ROW: Final = {"role": str, "policy": str, "capacity": int, "hits": int, "asked": int, "hit_ratio": float, "sample_rate": float}
COLUMNS: Final = ("role", "policy", "capacity", "hits", "asked", "hit_ratio", "sample_rate")


class StatusError(ValueError):
    """The status file cannot be shown; the message is the reason."""


def _finite(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer JSON holds and a float cannot (10**400)
        return False


def _check(record: Mapping[str, Any], fields: Mapping[str, type], where: str) -> None:
    for name, kind in fields.items():
        if name not in record:
            raise StatusError(f"{where}{name}: missing")
        value = record[name]
        if kind is float:
            ok, expected = _finite(value), "a finite number"
        elif kind is int:
            ok, expected = isinstance(value, int) and not isinstance(value, bool) and value >= 0, "an integer >= 0"
        else:
            ok, expected = isinstance(value, kind), f"a {'string' if kind is str else 'list'}"
        if not ok:
            raise StatusError(f"{where}{name}: expected {expected}, got {json.dumps(value)[:60]}")


def read_status(path: str) -> dict[str, Any]:
    """The status file at ``path``, checked; StatusError says why it cannot be shown."""
    try:
        with open_regular(path) as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise StatusError(f"cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise StatusError(f"larger than {MAX_BYTES} bytes: not a status file")
    try:
        status = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise StatusError(f"not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise StatusError("not a status file (JSON nested too deep)") from None
    except ValueError as exc:
        raise StatusError(f"not JSON ({exc}); empty or half written? the writer replaces it whole") from None
    if not isinstance(status, dict):
        raise StatusError(f"expected a JSON object, got {type(status).__name__}")
    _check(status, TOP, "")
    for i, row in enumerate(status["rows"]):
        if not isinstance(row, dict):
            raise StatusError(f"rows[{i}]: expected an object, got {json.dumps(row)[:60]}")
        _check(row, ROW, f"rows[{i}].")
    return status


def shown(value: Any) -> str:
    """``value`` as text safe for a terminal: a character that is not printable (ESC, CR,
    BEL, a bidirectional override, ...) is written as its escape (``\\x1b``), so a status
    file cannot move the cursor, recolour or retitle the reader's terminal. Letters of any
    script stay as they are."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def table(status: Mapping[str, Any], now: float) -> str:
    """The rows as an aligned table, under a line saying whose figures and how old (the
    file's strings escaped: ``shown``)."""
    age = now - float(status["time"])
    try:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(status["time"])))
    except (OverflowError, OSError, ValueError):  # a time no calendar holds
        when = "at an impossible time"
    head = (
        f"client {shown(status['client_id'])}, pid {status['pid']}, policy {shown(status['policy'])}, "
        f"CPU tier {status['capacity']} chunks; "
        f"written {when}, {age:.1f} s ago"
    )
    cells = [list(COLUMNS)] + [
        [
            shown(row["role"]),
            shown(row["policy"]),
            str(row["capacity"]),
            str(row["hits"]),
            str(row["asked"]),
            f"{float(row['hit_ratio']):.4f}",
            f"{float(row['sample_rate']):g}",
        ]
        for row in status["rows"]
    ]
    widths = [max(len(r[c]) for r in cells) for c in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    tail = [f"metrics: {shown(status['metrics_url'])}"] if isinstance(status.get("metrics_url"), str) else []
    return "\n".join([head, "", *lines, *tail])


def cmd_vllm_status(args: argparse.Namespace) -> int:
    try:
        status = read_status(args.path)
    except StatusError as exc:
        raise BadInput("PATH", f"{args.path}: {exc}") from None
    if args.json:
        print(json.dumps(status))
    else:
        print(table(status, time.time()))
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add the ``vllm-status`` verb to the kvbroker command's subparsers."""
    p = subparsers.add_parser("vllm-status", help="the hits of the kvbroker CachePolicy inside vLLM, from its kvbroker_status_file")
    p.add_argument("path", metavar="PATH", help="the status file (kvbroker_status_file, with {pid} and {rank} replaced)")
    p.add_argument("--json", action="store_true", help="the file's JSON object, as written")
    p.set_defaults(func=cmd_vllm_status)
    return p
