from kvbroker.v1 import directive_pb2 as _directive_pb2
from kvbroker.v1 import intent_pb2 as _intent_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("schema_major", "schema_minor", "client_id", "tenant")
    SCHEMA_MAJOR_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_MINOR_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    schema_major: int
    schema_minor: int
    client_id: str
    tenant: str
    def __init__(self, schema_major: _Optional[int] = ..., schema_minor: _Optional[int] = ..., client_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("served_majors", "schema_minor", "broker_id", "last_batch_seq", "policy", "config_generation", "max_events_per_batch", "max_batch_seq_gap")
    SERVED_MAJORS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_MINOR_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_BATCH_SEQ_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SEQ_GAP_FIELD_NUMBER: _ClassVar[int]
    served_majors: _containers.RepeatedScalarFieldContainer[int]
    schema_minor: int
    broker_id: str
    last_batch_seq: int
    policy: str
    config_generation: int
    max_events_per_batch: int
    max_batch_seq_gap: int
    def __init__(self, served_majors: _Optional[_Iterable[int]] = ..., schema_minor: _Optional[int] = ..., broker_id: _Optional[str] = ..., last_batch_seq: _Optional[int] = ..., policy: _Optional[str] = ..., config_generation: _Optional[int] = ..., max_events_per_batch: _Optional[int] = ..., max_batch_seq_gap: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("hello", "batch")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    batch: _intent_pb2.IntentBatch
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., batch: _Optional[_Union[_intent_pb2.IntentBatch, _Mapping]] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("hello", "directives")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    hello: HelloReply
    directives: _directive_pb2.DirectiveBatch
    def __init__(self, hello: _Optional[_Union[HelloReply, _Mapping]] = ..., directives: _Optional[_Union[_directive_pb2.DirectiveBatch, _Mapping]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("hello", "batch")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    batch: _intent_pb2.IntentBatch
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., batch: _Optional[_Union[_intent_pb2.IntentBatch, _Mapping]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("directives",)
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    directives: _directive_pb2.DirectiveBatch
    def __init__(self, directives: _Optional[_Union[_directive_pb2.DirectiveBatch, _Mapping]] = ...) -> None: ...

class GetResidencyRequest(_message.Message):
    __slots__ = ("block_id", "request_id", "totals")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    request_id: str
    totals: bool
    def __init__(self, block_id: _Optional[str] = ..., request_id: _Optional[str] = ..., totals: _Optional[bool] = ...) -> None: ...

class BlockResidency(_message.Message):
    __slots__ = ("block_id", "request_id", "tier", "size_bytes", "pinned", "phase", "priority", "deadline_us", "tenant")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_US_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    request_id: str
    tier: str
    size_bytes: int
    pinned: bool
    phase: _intent_pb2.Phase
    priority: _intent_pb2.Priority
    deadline_us: int
    tenant: str
    def __init__(self, block_id: _Optional[str] = ..., request_id: _Optional[str] = ..., tier: _Optional[str] = ..., size_bytes: _Optional[int] = ..., pinned: _Optional[bool] = ..., phase: _Optional[_Union[_intent_pb2.Phase, str]] = ..., priority: _Optional[_Union[_intent_pb2.Priority, str]] = ..., deadline_us: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("name", "blocks", "bytes", "capacity_bytes", "pinned_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    blocks: int
    bytes: int
    capacity_bytes: int
    pinned_bytes: int
    def __init__(self, name: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ...) -> None: ...

class GetResidencyResponse(_message.Message):
    __slots__ = ("blocks", "tiers", "dropped_blocks")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockResidency]
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    dropped_blocks: int
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockResidency, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ..., dropped_blocks: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ("config_toml",)
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    config_toml: str
    def __init__(self, config_toml: _Optional[str] = ...) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("ok", "config_generation", "error", "policy")
    OK_FIELD_NUMBER: _ClassVar[int]
    CONFIG_GENERATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    config_generation: int
    error: str
    policy: str
    def __init__(self, ok: _Optional[bool] = ..., config_generation: _Optional[int] = ..., error: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class GetConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetConfigResponse(_message.Message):
    __slots__ = ("config_toml", "config_generation", "policy", "config_path")
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    CONFIG_GENERATION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_PATH_FIELD_NUMBER: _ClassVar[int]
    config_toml: str
    config_generation: int
    policy: str
    config_path: str
    def __init__(self, config_toml: _Optional[str] = ..., config_generation: _Optional[int] = ..., policy: _Optional[str] = ..., config_path: _Optional[str] = ...) -> None: ...

class ArmStats(_message.Message):
    __slots__ = ("name", "policy", "role", "accesses", "hit_rate", "decode_critical_accesses", "decode_critical_misses", "mean_latency_us", "p99_latency_us", "evictions", "demotions", "prefetches", "bytes_moved", "deadline_misses", "clients")
    NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ACCESSES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    DECODE_CRITICAL_ACCESSES_FIELD_NUMBER: _ClassVar[int]
    DECODE_CRITICAL_MISSES_FIELD_NUMBER: _ClassVar[int]
    MEAN_LATENCY_US_FIELD_NUMBER: _ClassVar[int]
    P99_LATENCY_US_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    policy: str
    role: str
    accesses: int
    hit_rate: float
    decode_critical_accesses: int
    decode_critical_misses: int
    mean_latency_us: float
    p99_latency_us: int
    evictions: int
    demotions: int
    prefetches: int
    bytes_moved: int
    deadline_misses: int
    clients: int
    def __init__(self, name: _Optional[str] = ..., policy: _Optional[str] = ..., role: _Optional[str] = ..., accesses: _Optional[int] = ..., hit_rate: _Optional[float] = ..., decode_critical_accesses: _Optional[int] = ..., decode_critical_misses: _Optional[int] = ..., mean_latency_us: _Optional[float] = ..., p99_latency_us: _Optional[int] = ..., evictions: _Optional[int] = ..., demotions: _Optional[int] = ..., prefetches: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., deadline_misses: _Optional[int] = ..., clients: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("broker_id", "policy", "config_generation", "tiers", "events", "directives", "batches", "duplicate_batches", "rejected_events", "accesses_by_tier", "decode_critical_accesses", "decode_critical_misses", "journal_pending", "journal_written", "journal_errors", "journal", "clients", "arms", "journal_spool_records", "journal_spool_bytes", "journal_dropped", "outstanding_directives", "max_outstanding_directives", "refused_batches", "refused_streams", "revoked_streams")
    class EventsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DirectivesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AccessesByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RefusedBatchesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RefusedStreamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_BATCHES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    ACCESSES_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    DECODE_CRITICAL_ACCESSES_FIELD_NUMBER: _ClassVar[int]
    DECODE_CRITICAL_MISSES_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_PENDING_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_SPOOL_RECORDS_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_SPOOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_DROPPED_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTSTANDING_DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    broker_id: str
    policy: str
    config_generation: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    events: _containers.ScalarMap[str, int]
    directives: _containers.ScalarMap[str, int]
    batches: int
    duplicate_batches: int
    rejected_events: int
    accesses_by_tier: _containers.ScalarMap[str, int]
    decode_critical_accesses: int
    decode_critical_misses: int
    journal_pending: int
    journal_written: int
    journal_errors: int
    journal: str
    clients: int
    arms: _containers.RepeatedCompositeFieldContainer[ArmStats]
    journal_spool_records: int
    journal_spool_bytes: int
    journal_dropped: int
    outstanding_directives: int
    max_outstanding_directives: int
    refused_batches: _containers.ScalarMap[str, int]
    refused_streams: _containers.ScalarMap[str, int]
    revoked_streams: int
    def __init__(self, broker_id: _Optional[str] = ..., policy: _Optional[str] = ..., config_generation: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ..., events: _Optional[_Mapping[str, int]] = ..., directives: _Optional[_Mapping[str, int]] = ..., batches: _Optional[int] = ..., duplicate_batches: _Optional[int] = ..., rejected_events: _Optional[int] = ..., accesses_by_tier: _Optional[_Mapping[str, int]] = ..., decode_critical_accesses: _Optional[int] = ..., decode_critical_misses: _Optional[int] = ..., journal_pending: _Optional[int] = ..., journal_written: _Optional[int] = ..., journal_errors: _Optional[int] = ..., journal: _Optional[str] = ..., clients: _Optional[int] = ..., arms: _Optional[_Iterable[_Union[ArmStats, _Mapping]]] = ..., journal_spool_records: _Optional[int] = ..., journal_spool_bytes: _Optional[int] = ..., journal_dropped: _Optional[int] = ..., outstanding_directives: _Optional[int] = ..., max_outstanding_directives: _Optional[int] = ..., refused_batches: _Optional[_Mapping[str, int]] = ..., refused_streams: _Optional[_Mapping[str, int]] = ..., revoked_streams: _Optional[int] = ...) -> None: ...
