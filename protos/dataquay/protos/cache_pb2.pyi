from dataquay.protos import jobs_pb2 as _jobs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_CACHE: _ClassVar[Tier]
    TIER_PEER: _ClassVar[Tier]
    TIER_PFS: _ClassVar[Tier]

class DatasetFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FORMAT_UNSPECIFIED: _ClassVar[DatasetFormat]
    FORMAT_FILES: _ClassVar[DatasetFormat]
    FORMAT_TAR: _ClassVar[DatasetFormat]
    FORMAT_NPY: _ClassVar[DatasetFormat]

class PrepRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREP_ROLE_UNSPECIFIED: _ClassVar[PrepRole]
    PREP_WAIT: _ClassVar[PrepRole]
    PREP_MEMBER: _ClassVar[PrepRole]
    PREP_SOLO: _ClassVar[PrepRole]
TIER_UNSPECIFIED: Tier
TIER_CACHE: Tier
TIER_PEER: Tier
TIER_PFS: Tier
FORMAT_UNSPECIFIED: DatasetFormat
FORMAT_FILES: DatasetFormat
FORMAT_TAR: DatasetFormat
FORMAT_NPY: DatasetFormat
PREP_ROLE_UNSPECIFIED: PrepRole
PREP_WAIT: PrepRole
PREP_MEMBER: PrepRole
PREP_SOLO: PrepRole

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("node", "version", "cache_path", "max_batch", "cache_capacity", "tcp_address", "pid", "directory", "metrics_address", "bulk_address", "pfs_bandwidth")
    NODE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHE_PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BULK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PFS_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    node: str
    version: str
    cache_path: str
    max_batch: int
    cache_capacity: int
    tcp_address: str
    pid: int
    directory: str
    metrics_address: str
    bulk_address: str
    pfs_bandwidth: int
    def __init__(self, node: _Optional[str] = ..., version: _Optional[str] = ..., cache_path: _Optional[str] = ..., max_batch: _Optional[int] = ..., cache_capacity: _Optional[int] = ..., tcp_address: _Optional[str] = ..., pid: _Optional[int] = ..., directory: _Optional[str] = ..., metrics_address: _Optional[str] = ..., bulk_address: _Optional[str] = ..., pfs_bandwidth: _Optional[int] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("dataset", "ids", "shm_name", "shm_size", "manifest_id", "job", "peer", "epoch")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_SIZE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    shm_name: str
    shm_size: int
    manifest_id: str
    job: str
    peer: bool
    epoch: int
    def __init__(self, dataset: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ..., shm_name: _Optional[str] = ..., shm_size: _Optional[int] = ..., manifest_id: _Optional[str] = ..., job: _Optional[str] = ..., peer: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("id", "tier", "data", "checksum", "in_shm", "shm_offset", "length", "missing", "value", "offset", "checked_in_place")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    IN_SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHECKED_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    id: int
    tier: Tier
    data: bytes
    checksum: int
    in_shm: bool
    shm_offset: int
    length: int
    missing: bool
    value: bytes
    offset: int
    checked_in_place: bool
    def __init__(self, id: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., in_shm: _Optional[bool] = ..., shm_offset: _Optional[int] = ..., length: _Optional[int] = ..., missing: _Optional[bool] = ..., value: _Optional[bytes] = ..., offset: _Optional[int] = ..., checked_in_place: _Optional[bool] = ...) -> None: ...

class ReadChunk(_message.Message):
    __slots__ = ("samples", "piece")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    piece: Sample
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., piece: _Optional[_Union[Sample, _Mapping]] = ...) -> None: ...

class AddDatasetRequest(_message.Message):
    __slots__ = ("name", "root", "format", "replace", "tar_member_samples")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    TAR_MEMBER_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    name: str
    root: str
    format: DatasetFormat
    replace: bool
    tar_member_samples: bool
    def __init__(self, name: _Optional[str] = ..., root: _Optional[str] = ..., format: _Optional[_Union[DatasetFormat, str]] = ..., replace: _Optional[bool] = ..., tar_member_samples: _Optional[bool] = ...) -> None: ...

class SampleSizeStats(_message.Message):
    __slots__ = ("min", "max", "mean", "median")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_FIELD_NUMBER: _ClassVar[int]
    min: int
    max: int
    mean: float
    median: int
    def __init__(self, min: _Optional[int] = ..., max: _Optional[int] = ..., mean: _Optional[float] = ..., median: _Optional[int] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("name", "root", "format", "num_samples", "total_bytes", "sample_size", "manifest_id", "cache_db", "manifest_bytes", "cached_samples", "cached_bytes", "created_unix", "record_dtype", "record_shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_DB_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    RECORD_DTYPE_FIELD_NUMBER: _ClassVar[int]
    RECORD_SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    root: str
    format: DatasetFormat
    num_samples: int
    total_bytes: int
    sample_size: SampleSizeStats
    manifest_id: str
    cache_db: str
    manifest_bytes: int
    cached_samples: int
    cached_bytes: int
    created_unix: float
    record_dtype: str
    record_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., root: _Optional[str] = ..., format: _Optional[_Union[DatasetFormat, str]] = ..., num_samples: _Optional[int] = ..., total_bytes: _Optional[int] = ..., sample_size: _Optional[_Union[SampleSizeStats, _Mapping]] = ..., manifest_id: _Optional[str] = ..., cache_db: _Optional[str] = ..., manifest_bytes: _Optional[int] = ..., cached_samples: _Optional[int] = ..., cached_bytes: _Optional[int] = ..., created_unix: _Optional[float] = ..., record_dtype: _Optional[str] = ..., record_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDatasetsReply(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ...) -> None: ...

class GetDatasetRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ManifestChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class DropDatasetRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DropDatasetReply(_message.Message):
    __slots__ = ("freed_samples",)
    FREED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    freed_samples: int
    def __init__(self, freed_samples: _Optional[int] = ...) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("dataset", "seed", "job")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    seed: int
    job: str
    def __init__(self, dataset: _Optional[str] = ..., seed: _Optional[int] = ..., job: _Optional[str] = ...) -> None: ...

class StageProgress(_message.Message):
    __slots__ = ("dataset", "total_samples", "done_samples", "skipped_samples", "total_bytes", "done_bytes", "read_bytes", "elapsed_seconds", "finished", "cache_full", "error", "failed_samples", "first_failure", "node", "held_for_others", "admission_need_bytes", "admission_fit_bytes", "evictions", "cached_bytes")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DONE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CACHE_FULL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FIRST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    HELD_FOR_OTHERS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_NEED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    total_samples: int
    done_samples: int
    skipped_samples: int
    total_bytes: int
    done_bytes: int
    read_bytes: int
    elapsed_seconds: float
    finished: bool
    cache_full: bool
    error: str
    failed_samples: int
    first_failure: str
    node: str
    held_for_others: int
    admission_need_bytes: int
    admission_fit_bytes: int
    evictions: _containers.RepeatedCompositeFieldContainer[CacheEviction]
    cached_bytes: int
    def __init__(self, dataset: _Optional[str] = ..., total_samples: _Optional[int] = ..., done_samples: _Optional[int] = ..., skipped_samples: _Optional[int] = ..., total_bytes: _Optional[int] = ..., done_bytes: _Optional[int] = ..., read_bytes: _Optional[int] = ..., elapsed_seconds: _Optional[float] = ..., finished: _Optional[bool] = ..., cache_full: _Optional[bool] = ..., error: _Optional[str] = ..., failed_samples: _Optional[int] = ..., first_failure: _Optional[str] = ..., node: _Optional[str] = ..., held_for_others: _Optional[int] = ..., admission_need_bytes: _Optional[int] = ..., admission_fit_bytes: _Optional[int] = ..., evictions: _Optional[_Iterable[_Union[CacheEviction, _Mapping]]] = ..., cached_bytes: _Optional[int] = ...) -> None: ...

class CacheHolding(_message.Message):
    __slots__ = ("cache_db", "datasets", "bytes", "samples", "last_use_unix", "uid", "pinned_by")
    CACHE_DB_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LAST_USE_UNIX_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    PINNED_BY_FIELD_NUMBER: _ClassVar[int]
    cache_db: str
    datasets: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    samples: int
    last_use_unix: float
    uid: int
    pinned_by: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cache_db: _Optional[str] = ..., datasets: _Optional[_Iterable[str]] = ..., bytes: _Optional[int] = ..., samples: _Optional[int] = ..., last_use_unix: _Optional[float] = ..., uid: _Optional[int] = ..., pinned_by: _Optional[_Iterable[str]] = ...) -> None: ...

class CacheEviction(_message.Message):
    __slots__ = ("cache_db", "datasets", "bytes", "whole")
    CACHE_DB_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    cache_db: str
    datasets: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    whole: bool
    def __init__(self, cache_db: _Optional[str] = ..., datasets: _Optional[_Iterable[str]] = ..., bytes: _Optional[int] = ..., whole: _Optional[bool] = ...) -> None: ...

class CacheCharge(_message.Message):
    __slots__ = ("kind", "id", "bytes", "quota_bytes", "quota")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    kind: str
    id: int
    bytes: int
    quota_bytes: int
    quota: str
    def __init__(self, kind: _Optional[str] = ..., id: _Optional[int] = ..., bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., quota: _Optional[str] = ...) -> None: ...

class ManageCacheRequest(_message.Message):
    __slots__ = ("action", "name", "dry_run", "force")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    action: str
    name: str
    dry_run: bool
    force: bool
    def __init__(self, action: _Optional[str] = ..., name: _Optional[str] = ..., dry_run: _Optional[bool] = ..., force: _Optional[bool] = ...) -> None: ...

class ManageCacheReply(_message.Message):
    __slots__ = ("holdings", "evictions", "charges", "capacity_bytes", "used_bytes", "evict_min_age_seconds")
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CHARGES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICT_MIN_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    holdings: _containers.RepeatedCompositeFieldContainer[CacheHolding]
    evictions: _containers.RepeatedCompositeFieldContainer[CacheEviction]
    charges: _containers.RepeatedCompositeFieldContainer[CacheCharge]
    capacity_bytes: int
    used_bytes: int
    evict_min_age_seconds: float
    def __init__(self, holdings: _Optional[_Iterable[_Union[CacheHolding, _Mapping]]] = ..., evictions: _Optional[_Iterable[_Union[CacheEviction, _Mapping]]] = ..., charges: _Optional[_Iterable[_Union[CacheCharge, _Mapping]]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., evict_min_age_seconds: _Optional[float] = ...) -> None: ...

class CacheBehindRequest(_message.Message):
    __slots__ = ("dataset", "manifest_id", "ids", "shm_name", "shm_size", "handed")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_SIZE_FIELD_NUMBER: _ClassVar[int]
    HANDED_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    manifest_id: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    shm_name: str
    shm_size: int
    handed: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, dataset: _Optional[str] = ..., manifest_id: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ..., shm_name: _Optional[str] = ..., shm_size: _Optional[int] = ..., handed: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class CacheBehindReply(_message.Message):
    __slots__ = ("queued", "not_in_page_cache")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    NOT_IN_PAGE_CACHE_FIELD_NUMBER: _ClassVar[int]
    queued: int
    not_in_page_cache: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, queued: _Optional[int] = ..., not_in_page_cache: _Optional[_Iterable[int]] = ...) -> None: ...

class CacheBehindCounts(_message.Message):
    __slots__ = ("page_cache_samples", "page_cache_bytes", "handed_samples", "handed_bytes", "not_in_page_cache", "refused_samples")
    PAGE_CACHE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PAGE_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    HANDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NOT_IN_PAGE_CACHE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    page_cache_samples: int
    page_cache_bytes: int
    handed_samples: int
    handed_bytes: int
    not_in_page_cache: int
    refused_samples: int
    def __init__(self, page_cache_samples: _Optional[int] = ..., page_cache_bytes: _Optional[int] = ..., handed_samples: _Optional[int] = ..., handed_bytes: _Optional[int] = ..., not_in_page_cache: _Optional[int] = ..., refused_samples: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierCount(_message.Message):
    __slots__ = ("tier", "samples", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    samples: int
    bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., samples: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("node", "reads", "cache_used_bytes", "cache_capacity_bytes", "cache_entries", "pfs_bytes", "pfs_errors", "corrupt_repaired", "cache_full", "inserts_dropped", "staging", "peers", "exchanges", "exchange_received_samples", "exchange_received_bytes", "previous_owner_samples", "prefetched_samples", "client_reads", "client_data_wait_seconds", "clients", "cache_disk_full", "prefetch", "prep_groups", "bulk", "cache_behind", "mcast_datagrams_dropped", "values_refused", "cache_holdings", "cache_charges", "healing", "exchange_multicast_note")
    class McastDatagramsDroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ValuesRefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    CACHE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PFS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PFS_ERRORS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_REPAIRED_FIELD_NUMBER: _ClassVar[int]
    CACHE_FULL_FIELD_NUMBER: _ClassVar[int]
    INSERTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGES_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_RECEIVED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_OWNER_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_READS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_DATA_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_DISK_FULL_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    PREP_GROUPS_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    CACHE_BEHIND_FIELD_NUMBER: _ClassVar[int]
    MCAST_DATAGRAMS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    VALUES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    CACHE_HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CHARGES_FIELD_NUMBER: _ClassVar[int]
    HEALING_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_MULTICAST_NOTE_FIELD_NUMBER: _ClassVar[int]
    node: str
    reads: _containers.RepeatedCompositeFieldContainer[TierCount]
    cache_used_bytes: int
    cache_capacity_bytes: int
    cache_entries: int
    pfs_bytes: int
    pfs_errors: int
    corrupt_repaired: int
    cache_full: bool
    inserts_dropped: int
    staging: _containers.RepeatedCompositeFieldContainer[StageProgress]
    peers: _containers.RepeatedCompositeFieldContainer[PeerHealth]
    exchanges: _containers.RepeatedCompositeFieldContainer[ExchangeProgress]
    exchange_received_samples: int
    exchange_received_bytes: int
    previous_owner_samples: int
    prefetched_samples: int
    client_reads: _containers.RepeatedCompositeFieldContainer[ClientReads]
    client_data_wait_seconds: float
    clients: int
    cache_disk_full: bool
    prefetch: Prefetch
    prep_groups: _containers.RepeatedCompositeFieldContainer[PrepGroupStatus]
    bulk: BulkCounts
    cache_behind: CacheBehindCounts
    mcast_datagrams_dropped: _containers.ScalarMap[str, int]
    values_refused: _containers.ScalarMap[str, int]
    cache_holdings: _containers.RepeatedCompositeFieldContainer[CacheHolding]
    cache_charges: _containers.RepeatedCompositeFieldContainer[CacheCharge]
    healing: HealCounts
    exchange_multicast_note: str
    def __init__(self, node: _Optional[str] = ..., reads: _Optional[_Iterable[_Union[TierCount, _Mapping]]] = ..., cache_used_bytes: _Optional[int] = ..., cache_capacity_bytes: _Optional[int] = ..., cache_entries: _Optional[int] = ..., pfs_bytes: _Optional[int] = ..., pfs_errors: _Optional[int] = ..., corrupt_repaired: _Optional[int] = ..., cache_full: _Optional[bool] = ..., inserts_dropped: _Optional[int] = ..., staging: _Optional[_Iterable[_Union[StageProgress, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[PeerHealth, _Mapping]]] = ..., exchanges: _Optional[_Iterable[_Union[ExchangeProgress, _Mapping]]] = ..., exchange_received_samples: _Optional[int] = ..., exchange_received_bytes: _Optional[int] = ..., previous_owner_samples: _Optional[int] = ..., prefetched_samples: _Optional[int] = ..., client_reads: _Optional[_Iterable[_Union[ClientReads, _Mapping]]] = ..., client_data_wait_seconds: _Optional[float] = ..., clients: _Optional[int] = ..., cache_disk_full: _Optional[bool] = ..., prefetch: _Optional[_Union[Prefetch, _Mapping]] = ..., prep_groups: _Optional[_Iterable[_Union[PrepGroupStatus, _Mapping]]] = ..., bulk: _Optional[_Union[BulkCounts, _Mapping]] = ..., cache_behind: _Optional[_Union[CacheBehindCounts, _Mapping]] = ..., mcast_datagrams_dropped: _Optional[_Mapping[str, int]] = ..., values_refused: _Optional[_Mapping[str, int]] = ..., cache_holdings: _Optional[_Iterable[_Union[CacheHolding, _Mapping]]] = ..., cache_charges: _Optional[_Iterable[_Union[CacheCharge, _Mapping]]] = ..., healing: _Optional[_Union[HealCounts, _Mapping]] = ..., exchange_multicast_note: _Optional[str] = ...) -> None: ...

class HealCounts(_message.Message):
    __slots__ = ("peer_samples", "peer_bytes", "pfs_samples", "pfs_bytes", "dropped_samples", "pending_samples", "lost_nodes")
    PEER_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PEER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PFS_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PFS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PENDING_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOST_NODES_FIELD_NUMBER: _ClassVar[int]
    peer_samples: int
    peer_bytes: int
    pfs_samples: int
    pfs_bytes: int
    dropped_samples: int
    pending_samples: int
    lost_nodes: int
    def __init__(self, peer_samples: _Optional[int] = ..., peer_bytes: _Optional[int] = ..., pfs_samples: _Optional[int] = ..., pfs_bytes: _Optional[int] = ..., dropped_samples: _Optional[int] = ..., pending_samples: _Optional[int] = ..., lost_nodes: _Optional[int] = ...) -> None: ...

class BulkCounts(_message.Message):
    __slots__ = ("served_samples", "served_bytes", "fetched_samples", "fetched_bytes", "refused_connections", "fallbacks", "exchange_samples", "forwarded_samples", "in_place_samples", "segment_reads")
    SERVED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCHED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FORWARDED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_READS_FIELD_NUMBER: _ClassVar[int]
    served_samples: int
    served_bytes: int
    fetched_samples: int
    fetched_bytes: int
    refused_connections: int
    fallbacks: int
    exchange_samples: int
    forwarded_samples: int
    in_place_samples: int
    segment_reads: int
    def __init__(self, served_samples: _Optional[int] = ..., served_bytes: _Optional[int] = ..., fetched_samples: _Optional[int] = ..., fetched_bytes: _Optional[int] = ..., refused_connections: _Optional[int] = ..., fallbacks: _Optional[int] = ..., exchange_samples: _Optional[int] = ..., forwarded_samples: _Optional[int] = ..., in_place_samples: _Optional[int] = ..., segment_reads: _Optional[int] = ...) -> None: ...

class Prefetch(_message.Message):
    __slots__ = ("memory_bytes", "held_bytes", "peak_bytes", "overflow_read_samples", "overflow_read_bytes", "overflow_served_samples", "overflow_served_bytes", "overflow_wasted_samples", "overflow_wasted_bytes", "overflow_failed_samples")
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_READ_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_SERVED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_WASTED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_WASTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_FAILED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    memory_bytes: int
    held_bytes: int
    peak_bytes: int
    overflow_read_samples: int
    overflow_read_bytes: int
    overflow_served_samples: int
    overflow_served_bytes: int
    overflow_wasted_samples: int
    overflow_wasted_bytes: int
    overflow_failed_samples: int
    def __init__(self, memory_bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ..., peak_bytes: _Optional[int] = ..., overflow_read_samples: _Optional[int] = ..., overflow_read_bytes: _Optional[int] = ..., overflow_served_samples: _Optional[int] = ..., overflow_served_bytes: _Optional[int] = ..., overflow_wasted_samples: _Optional[int] = ..., overflow_wasted_bytes: _Optional[int] = ..., overflow_failed_samples: _Optional[int] = ...) -> None: ...

class PeerHealth(_message.Message):
    __slots__ = ("node", "suspect", "failures", "samples", "bytes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    node: str
    suspect: bool
    failures: int
    samples: int
    bytes: int
    def __init__(self, node: _Optional[str] = ..., suspect: _Optional[bool] = ..., failures: _Optional[int] = ..., samples: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class ExchangeOffer(_message.Message):
    __slots__ = ("job", "dataset", "manifest_id", "epoch", "sender", "ids")
    JOB_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    dataset: str
    manifest_id: str
    epoch: int
    sender: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., dataset: _Optional[str] = ..., manifest_id: _Optional[str] = ..., epoch: _Optional[int] = ..., sender: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExchangeMessage(_message.Message):
    __slots__ = ("offer", "samples", "piece")
    OFFER_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    offer: ExchangeOffer
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    piece: Sample
    def __init__(self, offer: _Optional[_Union[ExchangeOffer, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., piece: _Optional[_Union[Sample, _Mapping]] = ...) -> None: ...

class ExchangeReply(_message.Message):
    __slots__ = ("held", "message_bytes", "after_reads")
    HELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    AFTER_READS_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedScalarFieldContainer[int]
    message_bytes: int
    after_reads: bool
    def __init__(self, held: _Optional[_Iterable[int]] = ..., message_bytes: _Optional[int] = ..., after_reads: _Optional[bool] = ...) -> None: ...

class ExchangeProgress(_message.Message):
    __slots__ = ("job", "epoch", "total_samples", "total_bytes", "delivered_samples", "delivered_bytes", "sent_bytes", "unavailable_samples", "refused_samples", "elapsed_seconds", "finished", "error", "coded_packets_sent", "coded_bytes_sent", "coded_samples_decoded", "coded_note", "first_delivery_seconds", "failed", "coded_datagrams_received", "coded_bytes_received", "coded_foreign_datagrams")
    JOB_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODED_PACKETS_SENT_FIELD_NUMBER: _ClassVar[int]
    CODED_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    CODED_SAMPLES_DECODED_FIELD_NUMBER: _ClassVar[int]
    CODED_NOTE_FIELD_NUMBER: _ClassVar[int]
    FIRST_DELIVERY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CODED_DATAGRAMS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CODED_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CODED_FOREIGN_DATAGRAMS_FIELD_NUMBER: _ClassVar[int]
    job: str
    epoch: int
    total_samples: int
    total_bytes: int
    delivered_samples: int
    delivered_bytes: int
    sent_bytes: int
    unavailable_samples: int
    refused_samples: int
    elapsed_seconds: float
    finished: bool
    error: str
    coded_packets_sent: int
    coded_bytes_sent: int
    coded_samples_decoded: int
    coded_note: str
    first_delivery_seconds: float
    failed: bool
    coded_datagrams_received: int
    coded_bytes_received: int
    coded_foreign_datagrams: int
    def __init__(self, job: _Optional[str] = ..., epoch: _Optional[int] = ..., total_samples: _Optional[int] = ..., total_bytes: _Optional[int] = ..., delivered_samples: _Optional[int] = ..., delivered_bytes: _Optional[int] = ..., sent_bytes: _Optional[int] = ..., unavailable_samples: _Optional[int] = ..., refused_samples: _Optional[int] = ..., elapsed_seconds: _Optional[float] = ..., finished: _Optional[bool] = ..., error: _Optional[str] = ..., coded_packets_sent: _Optional[int] = ..., coded_bytes_sent: _Optional[int] = ..., coded_samples_decoded: _Optional[int] = ..., coded_note: _Optional[str] = ..., first_delivery_seconds: _Optional[float] = ..., failed: _Optional[bool] = ..., coded_datagrams_received: _Optional[int] = ..., coded_bytes_received: _Optional[int] = ..., coded_foreign_datagrams: _Optional[int] = ...) -> None: ...

class CodedPassRequest(_message.Message):
    __slots__ = ("job", "epoch")
    JOB_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job: str
    epoch: int
    def __init__(self, job: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class CodedPassReply(_message.Message):
    __slots__ = ("pass_id",)
    PASS_ID_FIELD_NUMBER: _ClassVar[int]
    pass_id: int
    def __init__(self, pass_id: _Optional[int] = ...) -> None: ...

class ClientReads(_message.Message):
    __slots__ = ("tier", "samples", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    samples: int
    bytes: int
    def __init__(self, tier: _Optional[str] = ..., samples: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class RankPosition(_message.Message):
    __slots__ = ("job", "epoch", "rank", "position")
    JOB_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    job: str
    epoch: int
    rank: int
    position: int
    def __init__(self, job: _Optional[str] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class ClientStatsReport(_message.Message):
    __slots__ = ("client", "reads", "data_wait_seconds", "read_positions", "closing")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    DATA_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READ_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    client: str
    reads: _containers.RepeatedCompositeFieldContainer[ClientReads]
    data_wait_seconds: float
    read_positions: _containers.RepeatedCompositeFieldContainer[RankPosition]
    closing: bool
    def __init__(self, client: _Optional[str] = ..., reads: _Optional[_Iterable[_Union[ClientReads, _Mapping]]] = ..., data_wait_seconds: _Optional[float] = ..., read_positions: _Optional[_Iterable[_Union[RankPosition, _Mapping]]] = ..., closing: _Optional[bool] = ...) -> None: ...

class ClientStatsReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrepGroupSpec(_message.Message):
    __slots__ = ("group", "dataset", "manifest_id", "jobs", "batch_size", "seed", "drop_last", "num_batches", "memory_bytes", "timeout_seconds")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    group: str
    dataset: str
    manifest_id: str
    jobs: int
    batch_size: int
    seed: int
    drop_last: bool
    num_batches: int
    memory_bytes: int
    timeout_seconds: float
    def __init__(self, group: _Optional[str] = ..., dataset: _Optional[str] = ..., manifest_id: _Optional[str] = ..., jobs: _Optional[int] = ..., batch_size: _Optional[int] = ..., seed: _Optional[int] = ..., drop_last: _Optional[bool] = ..., num_batches: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class PreppedBatch(_message.Message):
    __slots__ = ("index", "segment", "bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    segment: str
    bytes: int
    def __init__(self, index: _Optional[int] = ..., segment: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class PrepSyncRequest(_message.Message):
    __slots__ = ("spec", "member", "pid", "epoch", "consumed", "prepped", "claim", "wait_seconds", "leave")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    PREPPED_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    spec: PrepGroupSpec
    member: str
    pid: int
    epoch: int
    consumed: int
    prepped: _containers.RepeatedCompositeFieldContainer[PreppedBatch]
    claim: int
    wait_seconds: float
    leave: bool
    def __init__(self, spec: _Optional[_Union[PrepGroupSpec, _Mapping]] = ..., member: _Optional[str] = ..., pid: _Optional[int] = ..., epoch: _Optional[int] = ..., consumed: _Optional[int] = ..., prepped: _Optional[_Iterable[_Union[PreppedBatch, _Mapping]]] = ..., claim: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., leave: _Optional[bool] = ...) -> None: ...

class PrepSyncReply(_message.Message):
    __slots__ = ("role", "claims", "ready", "free", "members", "daemon_pid")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_PID_FIELD_NUMBER: _ClassVar[int]
    role: PrepRole
    claims: _containers.RepeatedScalarFieldContainer[int]
    ready: _containers.RepeatedCompositeFieldContainer[PreppedBatch]
    free: _containers.RepeatedScalarFieldContainer[str]
    members: int
    daemon_pid: int
    def __init__(self, role: _Optional[_Union[PrepRole, str]] = ..., claims: _Optional[_Iterable[int]] = ..., ready: _Optional[_Iterable[_Union[PreppedBatch, _Mapping]]] = ..., free: _Optional[_Iterable[str]] = ..., members: _Optional[int] = ..., daemon_pid: _Optional[int] = ...) -> None: ...

class PrepGroupStatus(_message.Message):
    __slots__ = ("group", "dataset", "epoch", "members", "num_batches", "batches_prepped", "prepped_total", "slowest_consumed", "fastest_consumed", "staged_bytes", "memory_bytes", "dropped_total", "redealt_total")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PREPPED_FIELD_NUMBER: _ClassVar[int]
    PREPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    FASTEST_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REDEALT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    group: str
    dataset: str
    epoch: int
    members: int
    num_batches: int
    batches_prepped: int
    prepped_total: int
    slowest_consumed: int
    fastest_consumed: int
    staged_bytes: int
    memory_bytes: int
    dropped_total: int
    redealt_total: int
    def __init__(self, group: _Optional[str] = ..., dataset: _Optional[str] = ..., epoch: _Optional[int] = ..., members: _Optional[int] = ..., num_batches: _Optional[int] = ..., batches_prepped: _Optional[int] = ..., prepped_total: _Optional[int] = ..., slowest_consumed: _Optional[int] = ..., fastest_consumed: _Optional[int] = ..., staged_bytes: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., dropped_total: _Optional[int] = ..., redealt_total: _Optional[int] = ...) -> None: ...
