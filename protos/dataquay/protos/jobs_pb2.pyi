from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_UP: _ClassVar[NodeState]
    NODE_DOWN: _ClassVar[NodeState]
NODE_STATE_UNSPECIFIED: NodeState
NODE_UP: NodeState
NODE_DOWN: NodeState

class NodeInfo(_message.Message):
    __slots__ = ("name", "tcp_address", "metrics_address", "cache_capacity", "pid", "version", "bulk_address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BULK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tcp_address: str
    metrics_address: str
    cache_capacity: int
    pid: int
    version: str
    bulk_address: str
    def __init__(self, name: _Optional[str] = ..., tcp_address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., cache_capacity: _Optional[int] = ..., pid: _Optional[int] = ..., version: _Optional[str] = ..., bulk_address: _Optional[str] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("info", "state", "registered_unix", "last_heartbeat_unix", "cache_used_bytes", "cache_entries")
    INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    CACHE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    info: NodeInfo
    state: NodeState
    registered_unix: float
    last_heartbeat_unix: float
    cache_used_bytes: int
    cache_entries: int
    def __init__(self, info: _Optional[_Union[NodeInfo, _Mapping]] = ..., state: _Optional[_Union[NodeState, str]] = ..., registered_unix: _Optional[float] = ..., last_heartbeat_unix: _Optional[float] = ..., cache_used_bytes: _Optional[int] = ..., cache_entries: _Optional[int] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("job_id", "dataset", "mode", "q", "seed", "drop_last", "nodes", "ranks_per_node", "partition", "batch_size", "exchange_coding")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    RANKS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_CODING_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    dataset: str
    mode: str
    q: float
    seed: int
    drop_last: bool
    nodes: _containers.RepeatedScalarFieldContainer[str]
    ranks_per_node: int
    partition: str
    batch_size: int
    exchange_coding: str
    def __init__(self, job_id: _Optional[str] = ..., dataset: _Optional[str] = ..., mode: _Optional[str] = ..., q: _Optional[float] = ..., seed: _Optional[int] = ..., drop_last: _Optional[bool] = ..., nodes: _Optional[_Iterable[str]] = ..., ranks_per_node: _Optional[int] = ..., partition: _Optional[str] = ..., batch_size: _Optional[int] = ..., exchange_coding: _Optional[str] = ...) -> None: ...

class NodeAbsence(_message.Message):
    __slots__ = ("node", "from_epoch", "until_epoch")
    NODE_FIELD_NUMBER: _ClassVar[int]
    FROM_EPOCH_FIELD_NUMBER: _ClassVar[int]
    UNTIL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    node: str
    from_epoch: int
    until_epoch: int
    def __init__(self, node: _Optional[str] = ..., from_epoch: _Optional[int] = ..., until_epoch: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("spec", "manifest_id", "num_samples", "epoch", "created_unix", "started", "last_active_unix", "absences")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVE_UNIX_FIELD_NUMBER: _ClassVar[int]
    ABSENCES_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    manifest_id: str
    num_samples: int
    epoch: int
    created_unix: float
    started: bool
    last_active_unix: float
    absences: _containers.RepeatedCompositeFieldContainer[NodeAbsence]
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., manifest_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., epoch: _Optional[int] = ..., created_unix: _Optional[float] = ..., started: _Optional[bool] = ..., last_active_unix: _Optional[float] = ..., absences: _Optional[_Iterable[_Union[NodeAbsence, _Mapping]]] = ...) -> None: ...

class JoinJobRequest(_message.Message):
    __slots__ = ("spec", "must_exist")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MUST_EXIST_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    must_exist: bool
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., must_exist: _Optional[bool] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class DropJobRequest(_message.Message):
    __slots__ = ("job_id", "min_idle_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    min_idle_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., min_idle_seconds: _Optional[float] = ...) -> None: ...

class DropJobReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportEpochRequest(_message.Message):
    __slots__ = ("job_id", "epoch", "node", "rank", "wait_exchange_seconds", "lost_nodes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WAIT_EXCHANGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOST_NODES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    node: str
    rank: int
    wait_exchange_seconds: float
    lost_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., node: _Optional[str] = ..., rank: _Optional[int] = ..., wait_exchange_seconds: _Optional[float] = ..., lost_nodes: _Optional[_Iterable[str]] = ...) -> None: ...
