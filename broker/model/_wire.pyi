# Types of broker.model._wire, the native reader of IntentBatch bytes (broker/model/_wire.c); the tuple
# layouts are documented in broker/model/wire.py.
from collections.abc import Iterator
from typing import Any

class Unsupported(ValueError): ...

class BatchReader:
    client_id: str
    batch_seq: int
    tenant: str
    count: int
    raw: bytes
    def __init__(self, raw: bytes) -> None: ...
    def events(self, blocks: dict[str, Any] | None = None) -> Iterator[tuple[Any, ...]]: ...
