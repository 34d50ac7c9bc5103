import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LossReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_REASON_UNSPECIFIED: _ClassVar[LossReason]
    LOSS_REASON_LEASE_EXPIRED: _ClassVar[LossReason]
    LOSS_REASON_LEASE_SUPERSEDED: _ClassVar[LossReason]
    LOSS_REASON_LEASE_RELEASED: _ClassVar[LossReason]
    LOSS_REASON_LEASE_REVOKED: _ClassVar[LossReason]
    LOSS_REASON_RUNTIME_EXCEEDED: _ClassVar[LossReason]
    LOSS_REASON_TASK_COMPLETED: _ClassVar[LossReason]
    LOSS_REASON_NOT_OWNER: _ClassVar[LossReason]
    LOSS_REASON_FENCE_UNKNOWN: _ClassVar[LossReason]
    LOSS_REASON_TASK_CANCELLED: _ClassVar[LossReason]
    LOSS_REASON_TASK_FAILED: _ClassVar[LossReason]
    LOSS_REASON_TASK_QUARANTINED: _ClassVar[LossReason]

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    TASK_STATE_FREE: _ClassVar[TaskState]
    TASK_STATE_HELD: _ClassVar[TaskState]
    TASK_STATE_EXPIRED: _ClassVar[TaskState]
    TASK_STATE_COMPLETED: _ClassVar[TaskState]
    TASK_STATE_QUARANTINED: _ClassVar[TaskState]
    TASK_STATE_CANCELLED: _ClassVar[TaskState]
    TASK_STATE_FAILED: _ClassVar[TaskState]

class EffectPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EFFECT_POLICY_UNSPECIFIED: _ClassVar[EffectPolicy]
    EFFECT_POLICY_ONCE: _ClassVar[EffectPolicy]
    EFFECT_POLICY_LATEST: _ClassVar[EffectPolicy]

class EffectState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EFFECT_STATE_UNSPECIFIED: _ClassVar[EffectState]
    EFFECT_STATE_RESERVED: _ClassVar[EffectState]
    EFFECT_STATE_SUCCEEDED: _ClassVar[EffectState]
    EFFECT_STATE_FAILED: _ClassVar[EffectState]

class EffectDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EFFECT_DECISION_UNSPECIFIED: _ClassVar[EffectDecision]
    EFFECT_DECISION_PROCEED: _ClassVar[EffectDecision]
    EFFECT_DECISION_ALREADY_APPLIED: _ClassVar[EffectDecision]
    EFFECT_DECISION_IN_DOUBT: _ClassVar[EffectDecision]

class TaskEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_EVENT_TYPE_UNSPECIFIED: _ClassVar[TaskEventType]
    TASK_EVENT_TYPE_SNAPSHOT: _ClassVar[TaskEventType]
    TASK_EVENT_TYPE_CLAIMED: _ClassVar[TaskEventType]
    TASK_EVENT_TYPE_RELEASED: _ClassVar[TaskEventType]
    TASK_EVENT_TYPE_EXPIRED: _ClassVar[TaskEventType]
    TASK_EVENT_TYPE_COMPLETED: _ClassVar[TaskEventType]
    TASK_EVENT_TYPE_REVOKED: _ClassVar[TaskEventType]
    TASK_EVENT_TYPE_QUARANTINED: _ClassVar[TaskEventType]
    TASK_EVENT_TYPE_RETRIED: _ClassVar[TaskEventType]
    TASK_EVENT_TYPE_CANCELLED: _ClassVar[TaskEventType]
    TASK_EVENT_TYPE_FAILED: _ClassVar[TaskEventType]

class HistoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HISTORY_KIND_UNSPECIFIED: _ClassVar[HistoryKind]
    HISTORY_KIND_GRANTED: _ClassVar[HistoryKind]
    HISTORY_KIND_RELEASED: _ClassVar[HistoryKind]
    HISTORY_KIND_EXPIRED: _ClassVar[HistoryKind]
    HISTORY_KIND_REVOKED: _ClassVar[HistoryKind]
    HISTORY_KIND_COMPLETED: _ClassVar[HistoryKind]
    HISTORY_KIND_FAILED: _ClassVar[HistoryKind]
    HISTORY_KIND_CANCELLED: _ClassVar[HistoryKind]
    HISTORY_KIND_QUARANTINED: _ClassVar[HistoryKind]
    HISTORY_KIND_RETRIED: _ClassVar[HistoryKind]
    HISTORY_KIND_CHECKPOINT_SAVED: _ClassVar[HistoryKind]
    HISTORY_KIND_EFFECT_RESERVED: _ClassVar[HistoryKind]
    HISTORY_KIND_EFFECT_COMPLETED: _ClassVar[HistoryKind]
    HISTORY_KIND_FENCE_REFUSED: _ClassVar[HistoryKind]
LOSS_REASON_UNSPECIFIED: LossReason
LOSS_REASON_LEASE_EXPIRED: LossReason
LOSS_REASON_LEASE_SUPERSEDED: LossReason
LOSS_REASON_LEASE_RELEASED: LossReason
LOSS_REASON_LEASE_REVOKED: LossReason
LOSS_REASON_RUNTIME_EXCEEDED: LossReason
LOSS_REASON_TASK_COMPLETED: LossReason
LOSS_REASON_NOT_OWNER: LossReason
LOSS_REASON_FENCE_UNKNOWN: LossReason
LOSS_REASON_TASK_CANCELLED: LossReason
LOSS_REASON_TASK_FAILED: LossReason
LOSS_REASON_TASK_QUARANTINED: LossReason
TASK_STATE_UNSPECIFIED: TaskState
TASK_STATE_FREE: TaskState
TASK_STATE_HELD: TaskState
TASK_STATE_EXPIRED: TaskState
TASK_STATE_COMPLETED: TaskState
TASK_STATE_QUARANTINED: TaskState
TASK_STATE_CANCELLED: TaskState
TASK_STATE_FAILED: TaskState
EFFECT_POLICY_UNSPECIFIED: EffectPolicy
EFFECT_POLICY_ONCE: EffectPolicy
EFFECT_POLICY_LATEST: EffectPolicy
EFFECT_STATE_UNSPECIFIED: EffectState
EFFECT_STATE_RESERVED: EffectState
EFFECT_STATE_SUCCEEDED: EffectState
EFFECT_STATE_FAILED: EffectState
EFFECT_DECISION_UNSPECIFIED: EffectDecision
EFFECT_DECISION_PROCEED: EffectDecision
EFFECT_DECISION_ALREADY_APPLIED: EffectDecision
EFFECT_DECISION_IN_DOUBT: EffectDecision
TASK_EVENT_TYPE_UNSPECIFIED: TaskEventType
TASK_EVENT_TYPE_SNAPSHOT: TaskEventType
TASK_EVENT_TYPE_CLAIMED: TaskEventType
TASK_EVENT_TYPE_RELEASED: TaskEventType
TASK_EVENT_TYPE_EXPIRED: TaskEventType
TASK_EVENT_TYPE_COMPLETED: TaskEventType
TASK_EVENT_TYPE_REVOKED: TaskEventType
TASK_EVENT_TYPE_QUARANTINED: TaskEventType
TASK_EVENT_TYPE_RETRIED: TaskEventType
TASK_EVENT_TYPE_CANCELLED: TaskEventType
TASK_EVENT_TYPE_FAILED: TaskEventType
HISTORY_KIND_UNSPECIFIED: HistoryKind
HISTORY_KIND_GRANTED: HistoryKind
HISTORY_KIND_RELEASED: HistoryKind
HISTORY_KIND_EXPIRED: HistoryKind
HISTORY_KIND_REVOKED: HistoryKind
HISTORY_KIND_COMPLETED: HistoryKind
HISTORY_KIND_FAILED: HistoryKind
HISTORY_KIND_CANCELLED: HistoryKind
HISTORY_KIND_QUARANTINED: HistoryKind
HISTORY_KIND_RETRIED: HistoryKind
HISTORY_KIND_CHECKPOINT_SAVED: HistoryKind
HISTORY_KIND_EFFECT_RESERVED: HistoryKind
HISTORY_KIND_EFFECT_COMPLETED: HistoryKind
HISTORY_KIND_FENCE_REFUSED: HistoryKind

class Checkpoint(_message.Message):
    __slots__ = ("version", "data", "content_type", "fence", "write_time")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    WRITE_TIME_FIELD_NUMBER: _ClassVar[int]
    version: int
    data: bytes
    content_type: str
    fence: int
    write_time: _timestamp_pb2.Timestamp
    def __init__(self, version: _Optional[int] = ..., data: _Optional[bytes] = ..., content_type: _Optional[str] = ..., fence: _Optional[int] = ..., write_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("namespace", "task_id", "owner_id", "fence", "state", "expire_time", "remaining_ttl", "runtime_deadline", "claim_time", "end_reason", "revoke_reason", "attempts", "max_attempts", "cancel_reason", "fail_reason", "checkpoint_version", "checkpoint_size")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TTL_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TIME_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    REVOKE_REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REASON_FIELD_NUMBER: _ClassVar[int]
    FAIL_REASON_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SIZE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    owner_id: str
    fence: int
    state: TaskState
    expire_time: _timestamp_pb2.Timestamp
    remaining_ttl: _duration_pb2.Duration
    runtime_deadline: _timestamp_pb2.Timestamp
    claim_time: _timestamp_pb2.Timestamp
    end_reason: LossReason
    revoke_reason: str
    attempts: int
    max_attempts: int
    cancel_reason: str
    fail_reason: str
    checkpoint_version: int
    checkpoint_size: int
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., owner_id: _Optional[str] = ..., fence: _Optional[int] = ..., state: _Optional[_Union[TaskState, str]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., remaining_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., runtime_deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., claim_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_reason: _Optional[_Union[LossReason, str]] = ..., revoke_reason: _Optional[str] = ..., attempts: _Optional[int] = ..., max_attempts: _Optional[int] = ..., cancel_reason: _Optional[str] = ..., fail_reason: _Optional[str] = ..., checkpoint_version: _Optional[int] = ..., checkpoint_size: _Optional[int] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "owner_id", "ttl", "max_runtime", "request_id", "wait", "max_attempts")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    owner_id: str
    ttl: _duration_pb2.Duration
    max_runtime: _duration_pb2.Duration
    request_id: str
    wait: _duration_pb2.Duration
    max_attempts: int
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., owner_id: _Optional[str] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_runtime: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., request_id: _Optional[str] = ..., wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_attempts: _Optional[int] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("acquired", "lease", "holder_remaining_ttl", "holder_expire_time", "retry_after", "checkpoint")
    ACQUIRED_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_REMAINING_TTL_FIELD_NUMBER: _ClassVar[int]
    HOLDER_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    acquired: bool
    lease: Lease
    holder_remaining_ttl: _duration_pb2.Duration
    holder_expire_time: _timestamp_pb2.Timestamp
    retry_after: _duration_pb2.Duration
    checkpoint: Checkpoint
    def __init__(self, acquired: _Optional[bool] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., holder_remaining_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., holder_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., retry_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "owner_id", "fence", "ttl")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    owner_id: str
    fence: int
    ttl: _duration_pb2.Duration
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., owner_id: _Optional[str] = ..., fence: _Optional[int] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "owner_id", "fence", "complete", "fail", "fail_reason")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    FAIL_FIELD_NUMBER: _ClassVar[int]
    FAIL_REASON_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    owner_id: str
    fence: int
    complete: bool
    fail: bool
    fail_reason: str
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., owner_id: _Optional[str] = ..., fence: _Optional[int] = ..., complete: _Optional[bool] = ..., fail: _Optional[bool] = ..., fail_reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class ValidateFenceRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "fence")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    fence: int
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., fence: _Optional[int] = ...) -> None: ...

class ValidateFenceResponse(_message.Message):
    __slots__ = ("valid", "current_fence", "reason", "remaining_ttl", "expire_time")
    VALID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FENCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TTL_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    current_fence: int
    reason: LossReason
    remaining_ttl: _duration_pb2.Duration
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, valid: _Optional[bool] = ..., current_fence: _Optional[int] = ..., reason: _Optional[_Union[LossReason, str]] = ..., remaining_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ValidateFencesRequest(_message.Message):
    __slots__ = ("checks",)
    class Check(_message.Message):
        __slots__ = ("id", "request")
        ID_FIELD_NUMBER: _ClassVar[int]
        REQUEST_FIELD_NUMBER: _ClassVar[int]
        id: int
        request: ValidateFenceRequest
        def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[ValidateFenceRequest, _Mapping]] = ...) -> None: ...
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    checks: _containers.RepeatedCompositeFieldContainer[ValidateFencesRequest.Check]
    def __init__(self, checks: _Optional[_Iterable[_Union[ValidateFencesRequest.Check, _Mapping]]] = ...) -> None: ...

class ValidateFencesResponse(_message.Message):
    __slots__ = ("answers",)
    class Answer(_message.Message):
        __slots__ = ("id", "response", "error")
        ID_FIELD_NUMBER: _ClassVar[int]
        RESPONSE_FIELD_NUMBER: _ClassVar[int]
        ERROR_FIELD_NUMBER: _ClassVar[int]
        id: int
        response: ValidateFenceResponse
        error: bytes
        def __init__(self, id: _Optional[int] = ..., response: _Optional[_Union[ValidateFenceResponse, _Mapping]] = ..., error: _Optional[bytes] = ...) -> None: ...
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[ValidateFencesResponse.Answer]
    def __init__(self, answers: _Optional[_Iterable[_Union[ValidateFencesResponse.Answer, _Mapping]]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "owner_id", "fence", "ttl", "checkpoint")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    owner_id: str
    fence: int
    ttl: _duration_pb2.Duration
    checkpoint: Checkpoint
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., owner_id: _Optional[str] = ..., fence: _Optional[int] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("fence", "expire_time", "remaining_ttl", "renewed", "checkpoint_version", "checkpoint_saved")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TTL_FIELD_NUMBER: _ClassVar[int]
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SAVED_FIELD_NUMBER: _ClassVar[int]
    fence: int
    expire_time: _timestamp_pb2.Timestamp
    remaining_ttl: _duration_pb2.Duration
    renewed: bool
    checkpoint_version: int
    checkpoint_saved: bool
    def __init__(self, fence: _Optional[int] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., remaining_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., renewed: _Optional[bool] = ..., checkpoint_version: _Optional[int] = ..., checkpoint_saved: _Optional[bool] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("sequence", "add", "drop", "beat")
    class Add(_message.Message):
        __slots__ = ("id", "namespace", "task_id", "owner_id", "fence", "ttl")
        ID_FIELD_NUMBER: _ClassVar[int]
        NAMESPACE_FIELD_NUMBER: _ClassVar[int]
        TASK_ID_FIELD_NUMBER: _ClassVar[int]
        OWNER_ID_FIELD_NUMBER: _ClassVar[int]
        FENCE_FIELD_NUMBER: _ClassVar[int]
        TTL_FIELD_NUMBER: _ClassVar[int]
        id: int
        namespace: str
        task_id: str
        owner_id: str
        fence: int
        ttl: _duration_pb2.Duration
        def __init__(self, id: _Optional[int] = ..., namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., owner_id: _Optional[str] = ..., fence: _Optional[int] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    BEAT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    add: _containers.RepeatedCompositeFieldContainer[SessionRequest.Add]
    drop: _containers.RepeatedScalarFieldContainer[int]
    beat: bool
    def __init__(self, sequence: _Optional[int] = ..., add: _Optional[_Iterable[_Union[SessionRequest.Add, _Mapping]]] = ..., drop: _Optional[_Iterable[int]] = ..., beat: _Optional[bool] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("sequence", "held", "lost", "refused")
    class Held(_message.Message):
        __slots__ = ("id", "fence", "expire_time", "remaining_ttl", "renewed", "checkpoint_version")
        ID_FIELD_NUMBER: _ClassVar[int]
        FENCE_FIELD_NUMBER: _ClassVar[int]
        EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
        REMAINING_TTL_FIELD_NUMBER: _ClassVar[int]
        RENEWED_FIELD_NUMBER: _ClassVar[int]
        CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
        id: int
        fence: int
        expire_time: _timestamp_pb2.Timestamp
        remaining_ttl: _duration_pb2.Duration
        renewed: bool
        checkpoint_version: int
        def __init__(self, id: _Optional[int] = ..., fence: _Optional[int] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., remaining_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., renewed: _Optional[bool] = ..., checkpoint_version: _Optional[int] = ...) -> None: ...
    class Lost(_message.Message):
        __slots__ = ("id", "reason", "current_fence")
        ID_FIELD_NUMBER: _ClassVar[int]
        REASON_FIELD_NUMBER: _ClassVar[int]
        CURRENT_FENCE_FIELD_NUMBER: _ClassVar[int]
        id: int
        reason: LossReason
        current_fence: int
        def __init__(self, id: _Optional[int] = ..., reason: _Optional[_Union[LossReason, str]] = ..., current_fence: _Optional[int] = ...) -> None: ...
    class Refused(_message.Message):
        __slots__ = ("id", "error")
        ID_FIELD_NUMBER: _ClassVar[int]
        ERROR_FIELD_NUMBER: _ClassVar[int]
        id: int
        error: bytes
        def __init__(self, id: _Optional[int] = ..., error: _Optional[bytes] = ...) -> None: ...
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    held: _containers.RepeatedCompositeFieldContainer[SessionResponse.Held]
    lost: _containers.RepeatedCompositeFieldContainer[SessionResponse.Lost]
    refused: _containers.RepeatedCompositeFieldContainer[SessionResponse.Refused]
    def __init__(self, sequence: _Optional[int] = ..., held: _Optional[_Iterable[_Union[SessionResponse.Held, _Mapping]]] = ..., lost: _Optional[_Iterable[_Union[SessionResponse.Lost, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[SessionResponse.Refused, _Mapping]]] = ...) -> None: ...

class GetLeaseRequest(_message.Message):
    __slots__ = ("namespace", "task_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class GetLeaseResponse(_message.Message):
    __slots__ = ("lease", "checkpoint")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    checkpoint: Checkpoint
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ("namespace", "state", "page_size", "page_token", "owner_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    state: TaskState
    page_size: int
    page_token: str
    owner_id: str
    def __init__(self, namespace: _Optional[str] = ..., state: _Optional[_Union[TaskState, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., owner_id: _Optional[str] = ...) -> None: ...

class ListLeasesResponse(_message.Message):
    __slots__ = ("leases", "next_page_token")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    next_page_token: str
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class NamespaceSummary(_message.Message):
    __slots__ = ("namespace", "task_count", "task_count_capped")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_COUNT_FIELD_NUMBER: _ClassVar[int]
    TASK_COUNT_CAPPED_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_count: int
    task_count_capped: bool
    def __init__(self, namespace: _Optional[str] = ..., task_count: _Optional[int] = ..., task_count_capped: _Optional[bool] = ...) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces", "next_page_token")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceSummary]
    next_page_token: str
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetNamespaceStatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class GetNamespaceStatsResponse(_message.Message):
    __slots__ = ("namespace", "as_of", "leases_held", "leases_held_capped", "leases_expired", "leases_expired_capped", "tasks_quarantined", "tasks_quarantined_capped", "claims_last_minute", "claims_last_minute_capped", "stale_fences_last_minute", "stale_fences_last_minute_capped", "leases_lost_last_minute", "leases_lost_last_minute_capped", "effects_in_doubt", "effects_in_doubt_capped")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AS_OF_FIELD_NUMBER: _ClassVar[int]
    LEASES_HELD_FIELD_NUMBER: _ClassVar[int]
    LEASES_HELD_CAPPED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_CAPPED_FIELD_NUMBER: _ClassVar[int]
    TASKS_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    TASKS_QUARANTINED_CAPPED_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_LAST_MINUTE_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_LAST_MINUTE_CAPPED_FIELD_NUMBER: _ClassVar[int]
    STALE_FENCES_LAST_MINUTE_FIELD_NUMBER: _ClassVar[int]
    STALE_FENCES_LAST_MINUTE_CAPPED_FIELD_NUMBER: _ClassVar[int]
    LEASES_LOST_LAST_MINUTE_FIELD_NUMBER: _ClassVar[int]
    LEASES_LOST_LAST_MINUTE_CAPPED_FIELD_NUMBER: _ClassVar[int]
    EFFECTS_IN_DOUBT_FIELD_NUMBER: _ClassVar[int]
    EFFECTS_IN_DOUBT_CAPPED_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    as_of: _timestamp_pb2.Timestamp
    leases_held: int
    leases_held_capped: bool
    leases_expired: int
    leases_expired_capped: bool
    tasks_quarantined: int
    tasks_quarantined_capped: bool
    claims_last_minute: int
    claims_last_minute_capped: bool
    stale_fences_last_minute: int
    stale_fences_last_minute_capped: bool
    leases_lost_last_minute: int
    leases_lost_last_minute_capped: bool
    effects_in_doubt: int
    effects_in_doubt_capped: bool
    def __init__(self, namespace: _Optional[str] = ..., as_of: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., leases_held: _Optional[int] = ..., leases_held_capped: _Optional[bool] = ..., leases_expired: _Optional[int] = ..., leases_expired_capped: _Optional[bool] = ..., tasks_quarantined: _Optional[int] = ..., tasks_quarantined_capped: _Optional[bool] = ..., claims_last_minute: _Optional[int] = ..., claims_last_minute_capped: _Optional[bool] = ..., stale_fences_last_minute: _Optional[int] = ..., stale_fences_last_minute_capped: _Optional[bool] = ..., leases_lost_last_minute: _Optional[int] = ..., leases_lost_last_minute_capped: _Optional[bool] = ..., effects_in_doubt: _Optional[int] = ..., effects_in_doubt_capped: _Optional[bool] = ...) -> None: ...

class Effect(_message.Message):
    __slots__ = ("namespace", "task_id", "effect_key", "policy", "request_digest", "state", "fence", "complete_fence", "retryable", "result", "attempts", "begin_time", "complete_time", "external_operation_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FENCE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    BEGIN_TIME_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_TIME_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    effect_key: str
    policy: EffectPolicy
    request_digest: bytes
    state: EffectState
    fence: int
    complete_fence: int
    retryable: bool
    result: bytes
    attempts: int
    begin_time: _timestamp_pb2.Timestamp
    complete_time: _timestamp_pb2.Timestamp
    external_operation_id: str
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., effect_key: _Optional[str] = ..., policy: _Optional[_Union[EffectPolicy, str]] = ..., request_digest: _Optional[bytes] = ..., state: _Optional[_Union[EffectState, str]] = ..., fence: _Optional[int] = ..., complete_fence: _Optional[int] = ..., retryable: _Optional[bool] = ..., result: _Optional[bytes] = ..., attempts: _Optional[int] = ..., begin_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., complete_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., external_operation_id: _Optional[str] = ...) -> None: ...

class BeginEffectRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "fence", "effect_key", "policy", "request_digest")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    fence: int
    effect_key: str
    policy: EffectPolicy
    request_digest: bytes
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., fence: _Optional[int] = ..., effect_key: _Optional[str] = ..., policy: _Optional[_Union[EffectPolicy, str]] = ..., request_digest: _Optional[bytes] = ...) -> None: ...

class BeginEffectResponse(_message.Message):
    __slots__ = ("decision", "effect")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    EFFECT_FIELD_NUMBER: _ClassVar[int]
    decision: EffectDecision
    effect: Effect
    def __init__(self, decision: _Optional[_Union[EffectDecision, str]] = ..., effect: _Optional[_Union[Effect, _Mapping]] = ...) -> None: ...

class CompleteEffectRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "fence", "effect_key", "outcome", "retryable", "result", "external_operation_id", "next_checkpoint")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    fence: int
    effect_key: str
    outcome: EffectState
    retryable: bool
    result: bytes
    external_operation_id: str
    next_checkpoint: Checkpoint
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., fence: _Optional[int] = ..., effect_key: _Optional[str] = ..., outcome: _Optional[_Union[EffectState, str]] = ..., retryable: _Optional[bool] = ..., result: _Optional[bytes] = ..., external_operation_id: _Optional[str] = ..., next_checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class CompleteEffectResponse(_message.Message):
    __slots__ = ("effect", "checkpoint")
    EFFECT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    effect: Effect
    checkpoint: Checkpoint
    def __init__(self, effect: _Optional[_Union[Effect, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class ListEffectsRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "state", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    state: EffectState
    page_size: int
    page_token: str
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., state: _Optional[_Union[EffectState, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListEffectsResponse(_message.Message):
    __slots__ = ("effects", "next_page_token")
    EFFECTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    effects: _containers.RepeatedCompositeFieldContainer[Effect]
    next_page_token: str
    def __init__(self, effects: _Optional[_Iterable[_Union[Effect, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "reason", "fence")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    reason: str
    fence: int
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., reason: _Optional[str] = ..., fence: _Optional[int] = ...) -> None: ...

class RevokeResponse(_message.Message):
    __slots__ = ("revoked", "lease")
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    revoked: bool
    lease: Lease
    def __init__(self, revoked: _Optional[bool] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("namespace", "task_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class TaskEvent(_message.Message):
    __slots__ = ("type", "lease", "event_time")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    type: TaskEventType
    lease: Lease
    event_time: _timestamp_pb2.Timestamp
    def __init__(self, type: _Optional[_Union[TaskEventType, str]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "owner_id", "fence", "checkpoint")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    owner_id: str
    fence: int
    checkpoint: Checkpoint
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., owner_id: _Optional[str] = ..., fence: _Optional[int] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint", "lease")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    checkpoint: Checkpoint
    lease: Lease
    def __init__(self, checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "reason")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    reason: str
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("lease", "cancelled")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    cancelled: bool
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., cancelled: _Optional[bool] = ...) -> None: ...

class RetryRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "reason")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    reason: str
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RetryResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class HistoryEntry(_message.Message):
    __slots__ = ("sequence", "event_time", "kind", "fence", "owner_id", "attempt", "checkpoint_version", "checkpoint_size", "effect_key", "effect_outcome", "external_operation_id", "reason", "method")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SIZE_FIELD_NUMBER: _ClassVar[int]
    EFFECT_KEY_FIELD_NUMBER: _ClassVar[int]
    EFFECT_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    event_time: _timestamp_pb2.Timestamp
    kind: HistoryKind
    fence: int
    owner_id: str
    attempt: int
    checkpoint_version: int
    checkpoint_size: int
    effect_key: str
    effect_outcome: EffectState
    external_operation_id: str
    reason: str
    method: str
    def __init__(self, sequence: _Optional[int] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., kind: _Optional[_Union[HistoryKind, str]] = ..., fence: _Optional[int] = ..., owner_id: _Optional[str] = ..., attempt: _Optional[int] = ..., checkpoint_version: _Optional[int] = ..., checkpoint_size: _Optional[int] = ..., effect_key: _Optional[str] = ..., effect_outcome: _Optional[_Union[EffectState, str]] = ..., external_operation_id: _Optional[str] = ..., reason: _Optional[str] = ..., method: _Optional[str] = ...) -> None: ...

class ListTaskHistoryRequest(_message.Message):
    __slots__ = ("namespace", "task_id", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    task_id: str
    page_size: int
    page_token: str
    def __init__(self, namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListTaskHistoryResponse(_message.Message):
    __slots__ = ("entries", "next_page_token")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[HistoryEntry]
    next_page_token: str
    def __init__(self, entries: _Optional[_Iterable[_Union[HistoryEntry, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
