from dataquay.protos import cache_pb2 as _cache_pb2
from dataquay.protos import jobs_pb2 as _jobs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node", "identity_key")
    NODE_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_KEY_FIELD_NUMBER: _ClassVar[int]
    node: _jobs_pb2.NodeInfo
    identity_key: bytes
    def __init__(self, node: _Optional[_Union[_jobs_pb2.NodeInfo, _Mapping]] = ..., identity_key: _Optional[bytes] = ...) -> None: ...

class Versions(_message.Message):
    __slots__ = ("nodes", "datasets", "jobs")
    NODES_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    nodes: int
    datasets: int
    jobs: int
    def __init__(self, nodes: _Optional[int] = ..., datasets: _Optional[int] = ..., jobs: _Optional[int] = ...) -> None: ...

class RegisterNodeReply(_message.Message):
    __slots__ = ("lease_seconds", "heartbeat_seconds", "versions", "session")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    heartbeat_seconds: float
    versions: Versions
    session: int
    def __init__(self, lease_seconds: _Optional[float] = ..., heartbeat_seconds: _Optional[float] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., session: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("name", "cache_used_bytes", "cache_entries", "session")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    cache_used_bytes: int
    cache_entries: int
    session: int
    def __init__(self, name: _Optional[str] = ..., cache_used_bytes: _Optional[int] = ..., cache_entries: _Optional[int] = ..., session: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "versions")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    versions: Versions
    def __init__(self, known: _Optional[bool] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("since_version",)
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    since_version: int
    def __init__(self, since_version: _Optional[int] = ...) -> None: ...

class ListNodesReply(_message.Message):
    __slots__ = ("nodes", "versions", "delta", "removed")
    NODES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[_jobs_pb2.NodeStatus]
    versions: Versions
    delta: bool
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, nodes: _Optional[_Iterable[_Union[_jobs_pb2.NodeStatus, _Mapping]]] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., delta: _Optional[bool] = ..., removed: _Optional[_Iterable[str]] = ...) -> None: ...
