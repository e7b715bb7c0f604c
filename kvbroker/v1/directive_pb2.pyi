from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DirectiveKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTIVE_KIND_UNSPECIFIED: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_EVICT: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_DEMOTE: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_PROMOTE: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_PREFETCH: _ClassVar[DirectiveKind]
DIRECTIVE_KIND_UNSPECIFIED: DirectiveKind
DIRECTIVE_KIND_EVICT: DirectiveKind
DIRECTIVE_KIND_DEMOTE: DirectiveKind
DIRECTIVE_KIND_PROMOTE: DirectiveKind
DIRECTIVE_KIND_PREFETCH: DirectiveKind

class Directive(_message.Message):
    __slots__ = ("directive_id", "kind", "block_id", "from_tier", "to_tier", "policy", "score", "reason", "arrive_by_us", "size_bytes", "config_generation")
    DIRECTIVE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_TIER_FIELD_NUMBER: _ClassVar[int]
    TO_TIER_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ARRIVE_BY_US_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_GENERATION_FIELD_NUMBER: _ClassVar[int]
    directive_id: int
    kind: DirectiveKind
    block_id: str
    from_tier: str
    to_tier: str
    policy: str
    score: float
    reason: str
    arrive_by_us: int
    size_bytes: int
    config_generation: int
    def __init__(self, directive_id: _Optional[int] = ..., kind: _Optional[_Union[DirectiveKind, str]] = ..., block_id: _Optional[str] = ..., from_tier: _Optional[str] = ..., to_tier: _Optional[str] = ..., policy: _Optional[str] = ..., score: _Optional[float] = ..., reason: _Optional[str] = ..., arrive_by_us: _Optional[int] = ..., size_bytes: _Optional[int] = ..., config_generation: _Optional[int] = ...) -> None: ...

class EventRejection(_message.Message):
    __slots__ = ("event_index", "field", "reason", "code")
    EVENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    event_index: int
    field: str
    reason: str
    code: str
    def __init__(self, event_index: _Optional[int] = ..., field: _Optional[str] = ..., reason: _Optional[str] = ..., code: _Optional[str] = ...) -> None: ...

class DirectiveBatch(_message.Message):
    __slots__ = ("client_id", "batch_seq", "directives", "rejections", "accepted_events", "duplicate", "config_generation")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_SEQ_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_GENERATION_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    batch_seq: int
    directives: _containers.RepeatedCompositeFieldContainer[Directive]
    rejections: _containers.RepeatedCompositeFieldContainer[EventRejection]
    accepted_events: int
    duplicate: bool
    config_generation: int
    def __init__(self, client_id: _Optional[str] = ..., batch_seq: _Optional[int] = ..., directives: _Optional[_Iterable[_Union[Directive, _Mapping]]] = ..., rejections: _Optional[_Iterable[_Union[EventRejection, _Mapping]]] = ..., accepted_events: _Optional[int] = ..., duplicate: _Optional[bool] = ..., config_generation: _Optional[int] = ...) -> None: ...
