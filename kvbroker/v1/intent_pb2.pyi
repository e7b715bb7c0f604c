from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_PREFILL: _ClassVar[Phase]
    PHASE_DECODE: _ClassVar[Phase]
    PHASE_VERIFY: _ClassVar[Phase]
    PHASE_ROLLBACK: _ClassVar[Phase]
    PHASE_DONE: _ClassVar[Phase]
    PHASE_IDLE: _ClassVar[Phase]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_COLD: _ClassVar[Priority]
    PRIORITY_WARM: _ClassVar[Priority]
    PRIORITY_HOT: _ClassVar[Priority]
    PRIORITY_DECODE_CRITICAL: _ClassVar[Priority]

class AckStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_STATUS_UNSPECIFIED: _ClassVar[AckStatus]
    ACK_STATUS_DONE: _ClassVar[AckStatus]
    ACK_STATUS_FAILED: _ClassVar[AckStatus]
PHASE_UNSPECIFIED: Phase
PHASE_PREFILL: Phase
PHASE_DECODE: Phase
PHASE_VERIFY: Phase
PHASE_ROLLBACK: Phase
PHASE_DONE: Phase
PHASE_IDLE: Phase
PRIORITY_UNSPECIFIED: Priority
PRIORITY_COLD: Priority
PRIORITY_WARM: Priority
PRIORITY_HOT: Priority
PRIORITY_DECODE_CRITICAL: Priority
ACK_STATUS_UNSPECIFIED: AckStatus
ACK_STATUS_DONE: AckStatus
ACK_STATUS_FAILED: AckStatus

class MemoryIntent(_message.Message):
    __slots__ = ("block_id", "request_id", "phase", "priority", "deadline_us", "slack_us", "recompute_cost_us", "spill_cost_us", "size_bytes", "pin_requested", "is_draft", "is_committed", "tenant", "layer", "head_group", "token_start", "token_count", "allowed_tiers", "parent_block_id", "request_priority", "expected_reuse_window_tokens", "recompute_ok", "compression_ok", "prefetch_ok")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_US_FIELD_NUMBER: _ClassVar[int]
    SLACK_US_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_COST_US_FIELD_NUMBER: _ClassVar[int]
    SPILL_COST_US_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIN_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    IS_DRAFT_FIELD_NUMBER: _ClassVar[int]
    IS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HEAD_GROUP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TIERS_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_REUSE_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_OK_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_OK_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_OK_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    request_id: str
    phase: Phase
    priority: Priority
    deadline_us: int
    slack_us: int
    recompute_cost_us: int
    spill_cost_us: int
    size_bytes: int
    pin_requested: bool
    is_draft: bool
    is_committed: bool
    tenant: str
    layer: int
    head_group: int
    token_start: int
    token_count: int
    allowed_tiers: _containers.RepeatedScalarFieldContainer[str]
    parent_block_id: str
    request_priority: int
    expected_reuse_window_tokens: int
    recompute_ok: bool
    compression_ok: bool
    prefetch_ok: bool
    def __init__(self, block_id: _Optional[str] = ..., request_id: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., priority: _Optional[_Union[Priority, str]] = ..., deadline_us: _Optional[int] = ..., slack_us: _Optional[int] = ..., recompute_cost_us: _Optional[int] = ..., spill_cost_us: _Optional[int] = ..., size_bytes: _Optional[int] = ..., pin_requested: _Optional[bool] = ..., is_draft: _Optional[bool] = ..., is_committed: _Optional[bool] = ..., tenant: _Optional[str] = ..., layer: _Optional[int] = ..., head_group: _Optional[int] = ..., token_start: _Optional[int] = ..., token_count: _Optional[int] = ..., allowed_tiers: _Optional[_Iterable[str]] = ..., parent_block_id: _Optional[str] = ..., request_priority: _Optional[int] = ..., expected_reuse_window_tokens: _Optional[int] = ..., recompute_ok: _Optional[bool] = ..., compression_ok: _Optional[bool] = ..., prefetch_ok: _Optional[bool] = ...) -> None: ...

class BlockAllocated(_message.Message):
    __slots__ = ("intent", "tier", "reuse", "scope")
    INTENT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    intent: MemoryIntent
    tier: str
    reuse: bool
    scope: str
    def __init__(self, intent: _Optional[_Union[MemoryIntent, _Mapping]] = ..., tier: _Optional[str] = ..., reuse: _Optional[bool] = ..., scope: _Optional[str] = ...) -> None: ...

class BlocksAccessed(_message.Message):
    __slots__ = ("block_ids", "next_use_us", "scope", "token_positions", "ends_scope", "refresh_only")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_USE_US_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ENDS_SCOPE_FIELD_NUMBER: _ClassVar[int]
    REFRESH_ONLY_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    next_use_us: int
    scope: str
    token_positions: _containers.RepeatedScalarFieldContainer[int]
    ends_scope: str
    refresh_only: bool
    def __init__(self, block_ids: _Optional[_Iterable[str]] = ..., next_use_us: _Optional[int] = ..., scope: _Optional[str] = ..., token_positions: _Optional[_Iterable[int]] = ..., ends_scope: _Optional[str] = ..., refresh_only: _Optional[bool] = ...) -> None: ...

class IntentUpdated(_message.Message):
    __slots__ = ("block_id", "phase", "priority", "deadline_us", "slack_us", "pin_requested", "is_committed", "is_draft", "recompute_cost_us", "clear_deadline", "expected_reuse_window_tokens", "request_priority")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_US_FIELD_NUMBER: _ClassVar[int]
    SLACK_US_FIELD_NUMBER: _ClassVar[int]
    PIN_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    IS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    IS_DRAFT_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_COST_US_FIELD_NUMBER: _ClassVar[int]
    CLEAR_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_REUSE_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    block_id: str
    phase: Phase
    priority: Priority
    deadline_us: int
    slack_us: int
    pin_requested: bool
    is_committed: bool
    is_draft: bool
    recompute_cost_us: int
    clear_deadline: bool
    expected_reuse_window_tokens: int
    request_priority: int
    def __init__(self, block_id: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., priority: _Optional[_Union[Priority, str]] = ..., deadline_us: _Optional[int] = ..., slack_us: _Optional[int] = ..., pin_requested: _Optional[bool] = ..., is_committed: _Optional[bool] = ..., is_draft: _Optional[bool] = ..., recompute_cost_us: _Optional[int] = ..., clear_deadline: _Optional[bool] = ..., expected_reuse_window_tokens: _Optional[int] = ..., request_priority: _Optional[int] = ...) -> None: ...

class BlocksReleased(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BlocksFreed(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DirectiveAcked(_message.Message):
    __slots__ = ("directive_id", "status", "actual_tier", "error")
    DIRECTIVE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_TIER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    directive_id: int
    status: AckStatus
    actual_tier: str
    error: str
    def __init__(self, directive_id: _Optional[int] = ..., status: _Optional[_Union[AckStatus, str]] = ..., actual_tier: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class EvictionRequested(_message.Message):
    __slots__ = ("tier", "count", "protected_block_ids")
    TIER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    count: int
    protected_block_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tier: _Optional[str] = ..., count: _Optional[int] = ..., protected_block_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("ts_us", "allocated", "accessed", "intent_updated", "released", "freed", "cleared", "acked", "eviction_requested")
    TS_US_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    ACCESSED_FIELD_NUMBER: _ClassVar[int]
    INTENT_UPDATED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    EVICTION_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    ts_us: int
    allocated: BlockAllocated
    accessed: BlocksAccessed
    intent_updated: IntentUpdated
    released: BlocksReleased
    freed: BlocksFreed
    cleared: AllBlocksCleared
    acked: DirectiveAcked
    eviction_requested: EvictionRequested
    def __init__(self, ts_us: _Optional[int] = ..., allocated: _Optional[_Union[BlockAllocated, _Mapping]] = ..., accessed: _Optional[_Union[BlocksAccessed, _Mapping]] = ..., intent_updated: _Optional[_Union[IntentUpdated, _Mapping]] = ..., released: _Optional[_Union[BlocksReleased, _Mapping]] = ..., freed: _Optional[_Union[BlocksFreed, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ..., acked: _Optional[_Union[DirectiveAcked, _Mapping]] = ..., eviction_requested: _Optional[_Union[EvictionRequested, _Mapping]] = ...) -> None: ...

class IntentBatch(_message.Message):
    __slots__ = ("client_id", "batch_seq", "events", "tenant", "broker_received_us")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BROKER_RECEIVED_US_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    batch_seq: int
    events: _containers.RepeatedCompositeFieldContainer[Event]
    tenant: str
    broker_received_us: int
    def __init__(self, client_id: _Optional[str] = ..., batch_seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., tenant: _Optional[str] = ..., broker_received_us: _Optional[int] = ...) -> None: ...
