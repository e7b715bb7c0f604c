"""What every trace importer shares: errors that name file, line and field; JSONL reading
with an optional skip-and-count of bad lines; grouping events into batches."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from clients.regular_file import open_regular
from kvbroker.v1 import intent_pb2 as pb

# The longest trace line read (bytes, without its newline). A line is one request or event
# and is parsed whole, so a longer one (or a file that is one endless line) would take all
# memory: 300 MiB of one line ended in MemoryError under a 4 GiB limit. 16 MiB is a Mooncake
# request of ~1.9 million block hashes (~950M tokens at 512 per block), thousands of times
# the longest context served today; its JSON takes ~155 MiB of RSS to parse (docs/cli.md).
MAX_LINE_BYTES = 16 * 2**20


class TraceError(ValueError):
    """A line of a trace is not what its format says; names the file, line and field."""

    def __init__(self, path: str, line: int, field: str, reason: str) -> None:
        super().__init__(f"{path}:{line}: {field}: {reason}")
        self.path = path
        self.line = line
        self.field = field
        self.reason = reason

    def __reduce__(self) -> tuple[type[TraceError], tuple[str, int, str, str]]:
        # A replay job's error crosses from its worker process to the CLI by pickle, which by
        # default calls __init__ with the message alone (and the pool breaks on the TypeError).
        return (type(self), (self.path, self.line, self.field, self.reason))


@dataclasses.dataclass
class SkipCounter:
    """With ``skip_bad``, bad lines are counted (and the first few kept) instead of raised."""

    skip_bad: bool = False
    skipped: int = 0
    examples: list[str] = dataclasses.field(default_factory=list)

    def bad(self, error: TraceError) -> None:
        if not self.skip_bad:
            raise error
        self.skipped += 1
        if len(self.examples) < 5:
            self.examples.append(str(error))


def read_jsonl(path: str, skips: SkipCounter, max_line: int = MAX_LINE_BYTES) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-empty line; a line that is not a JSON object, or
    is longer than ``max_line`` bytes, is bad (a long one is skipped unread with --skip-bad)."""
    try:
        f = open_regular(path)  # closed by the with below; open errors are reported apart
    except OSError as exc:
        raise TraceError(path, 0, "file", exc.strerror or str(exc)) from exc
    with f:
        for number, raw in enumerate(_bounded_lines(f, max_line), start=1):
            if raw is None:
                skips.bad(TraceError(path, number, "line", f"longer than {max_line} bytes, the bound of a trace line"))
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                skips.bad(TraceError(path, number, "line", f"not UTF-8: {exc.reason} at byte {exc.start}"))
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                # "\ud800" is valid JSON but no Unicode: protobuf cannot carry it.
                surrogate = "\\u" in line and _has_surrogate(obj)
            except json.JSONDecodeError as exc:
                skips.bad(TraceError(path, number, "line", f"not JSON: {exc.msg}"))
                continue
            except RecursionError:
                skips.bad(TraceError(path, number, "line", "nested too deeply"))
                continue
            if surrogate:
                skips.bad(TraceError(path, number, "line", "a string holds a lone surrogate (\\ud800-\\udfff escape), not valid Unicode"))
                continue
            if not isinstance(obj, dict):
                skips.bad(TraceError(path, number, "line", f"expected a JSON object, got {type(obj).__name__}"))
                continue
            yield number, obj


def _bounded_lines(f: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """The lines of ``f``; None for one longer than ``limit`` bytes (its newline not
    counted), which is read past in pieces, never held whole."""
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw
            continue
        yield None  # read past only if the caller goes on (--skip-bad)
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(1 << 20)


def _has_surrogate(obj: Any) -> bool:
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(obj, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_surrogate(v) for v in obj)
    return False


def require_int(
    obj: dict[str, Any], key: str, path: str, line: int, *, minimum: int = 0, maximum: int | None = None, optional: bool = False
) -> int | None:
    """An integer field (floats with no fraction are accepted) in [minimum, maximum]."""
    if key not in obj or obj[key] is None:
        if optional:
            return None
        raise TraceError(path, line, key, "required")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(path, line, key, f"expected an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise TraceError(path, line, key, f"expected an integer, got {value!r}")
        value = int(value)
    if value < minimum:
        raise TraceError(path, line, key, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise TraceError(path, line, key, f"must be <= {maximum}, got {value}")
    return int(value)


def batched(events: Iterable[pb.Event], client_id: str, max_events: int) -> Iterator[pb.IntentBatch]:
    """Group events, in order, into IntentBatches of at most ``max_events``."""
    seq = 0
    chunk: list[pb.Event] = []
    for event in events:
        chunk.append(event)
        if len(chunk) >= max_events:
            seq += 1
            yield pb.IntentBatch(client_id=client_id, batch_seq=seq, events=chunk)
            chunk = []
    if chunk:
        seq += 1
        yield pb.IntentBatch(client_id=client_id, batch_seq=seq, events=chunk)
