from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SegmentStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEGMENT_STATUS_UNSPECIFIED: _ClassVar[SegmentStatus]
    SEGMENT_OK: _ClassVar[SegmentStatus]
    SEGMENT_DRAINING: _ClassVar[SegmentStatus]
    SEGMENT_DRAINED: _ClassVar[SegmentStatus]

class TierTaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_TASK_UNSPECIFIED: _ClassVar[TierTaskKind]
    TIER_DEMOTE: _ClassVar[TierTaskKind]
    TIER_PROMOTE: _ClassVar[TierTaskKind]
    TIER_DELETE: _ClassVar[TierTaskKind]
SEGMENT_STATUS_UNSPECIFIED: SegmentStatus
SEGMENT_OK: SegmentStatus
SEGMENT_DRAINING: SegmentStatus
SEGMENT_DRAINED: SegmentStatus
TIER_TASK_UNSPECIFIED: TierTaskKind
TIER_DEMOTE: TierTaskKind
TIER_PROMOTE: TierTaskKind
TIER_DELETE: TierTaskKind

class Status(_message.Message):
    __slots__ = ("code", "message", "view", "leader")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    view: int
    leader: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., view: _Optional[int] = ..., leader: _Optional[str] = ...) -> None: ...

class SegmentInfo(_message.Message):
    __slots__ = ("id", "node", "store_id", "size", "tcp_endpoint", "shm_path", "rdma_desc", "status", "numa_node", "used", "objects", "tier")
    ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TCP_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    RDMA_DESC_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    id: int
    node: str
    store_id: str
    size: int
    tcp_endpoint: str
    shm_path: str
    rdma_desc: bytes
    status: SegmentStatus
    numa_node: int
    used: int
    objects: int
    tier: int
    def __init__(self, id: _Optional[int] = ..., node: _Optional[str] = ..., store_id: _Optional[str] = ..., size: _Optional[int] = ..., tcp_endpoint: _Optional[str] = ..., shm_path: _Optional[str] = ..., rdma_desc: _Optional[bytes] = ..., status: _Optional[_Union[SegmentStatus, str]] = ..., numa_node: _Optional[int] = ..., used: _Optional[int] = ..., objects: _Optional[int] = ..., tier: _Optional[int] = ...) -> None: ...

class InventoryEntry(_message.Message):
    __slots__ = ("key", "offset", "length", "checksum", "tier")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    length: int
    checksum: int
    tier: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., tier: _Optional[int] = ...) -> None: ...

class MountSegmentRequest(_message.Message):
    __slots__ = ("segment", "secret", "inventory", "remount")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    REMOUNT_FIELD_NUMBER: _ClassVar[int]
    segment: SegmentInfo
    secret: bytes
    inventory: _containers.RepeatedCompositeFieldContainer[InventoryEntry]
    remount: bool
    def __init__(self, segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., secret: _Optional[bytes] = ..., inventory: _Optional[_Iterable[_Union[InventoryEntry, _Mapping]]] = ..., remount: _Optional[bool] = ...) -> None: ...

class MountSegmentResponse(_message.Message):
    __slots__ = ("status", "adopted", "rejected")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    adopted: int
    rejected: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., adopted: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class UnmountSegmentRequest(_message.Message):
    __slots__ = ("segment_id", "store_id")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    store_id: str
    def __init__(self, segment_id: _Optional[int] = ..., store_id: _Optional[str] = ...) -> None: ...

class UnmountSegmentResponse(_message.Message):
    __slots__ = ("status", "objects_dropped")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    objects_dropped: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., objects_dropped: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("store_id", "segment_ids", "freed_ack")
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    FREED_ACK_FIELD_NUMBER: _ClassVar[int]
    store_id: str
    segment_ids: _containers.RepeatedScalarFieldContainer[int]
    freed_ack: int
    def __init__(self, store_id: _Optional[str] = ..., segment_ids: _Optional[_Iterable[int]] = ..., freed_ack: _Optional[int] = ...) -> None: ...

class FreedRange(_message.Message):
    __slots__ = ("segment_id", "offset", "seq", "key")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    offset: int
    seq: int
    key: str
    def __init__(self, segment_id: _Optional[int] = ..., offset: _Optional[int] = ..., seq: _Optional[int] = ..., key: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("status", "freed", "moves_pending")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    MOVES_PENDING_FIELD_NUMBER: _ClassVar[int]
    status: Status
    freed: _containers.RepeatedCompositeFieldContainer[FreedRange]
    moves_pending: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., freed: _Optional[_Iterable[_Union[FreedRange, _Mapping]]] = ..., moves_pending: _Optional[int] = ...) -> None: ...

class PutConfig(_message.Message):
    __slots__ = ("replica_num", "hard_pin", "soft_pin_ttl_ms", "preferred_segments", "preferred_node", "writer_node")
    REPLICA_NUM_FIELD_NUMBER: _ClassVar[int]
    HARD_PIN_FIELD_NUMBER: _ClassVar[int]
    SOFT_PIN_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_NODE_FIELD_NUMBER: _ClassVar[int]
    WRITER_NODE_FIELD_NUMBER: _ClassVar[int]
    replica_num: int
    hard_pin: bool
    soft_pin_ttl_ms: int
    preferred_segments: _containers.RepeatedScalarFieldContainer[str]
    preferred_node: str
    writer_node: str
    def __init__(self, replica_num: _Optional[int] = ..., hard_pin: _Optional[bool] = ..., soft_pin_ttl_ms: _Optional[int] = ..., preferred_segments: _Optional[_Iterable[str]] = ..., preferred_node: _Optional[str] = ..., writer_node: _Optional[str] = ...) -> None: ...

class ReplicaDescriptor(_message.Message):
    __slots__ = ("segment_id", "node", "tcp_endpoint", "shm_path", "offset", "length", "expiry_ms", "mac", "tier")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    TCP_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    node: str
    tcp_endpoint: str
    shm_path: str
    offset: int
    length: int
    expiry_ms: int
    mac: bytes
    tier: int
    def __init__(self, segment_id: _Optional[int] = ..., node: _Optional[str] = ..., tcp_endpoint: _Optional[str] = ..., shm_path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., expiry_ms: _Optional[int] = ..., mac: _Optional[bytes] = ..., tier: _Optional[int] = ...) -> None: ...

class BatchPutStartRequest(_message.Message):
    __slots__ = ("client_id", "keys", "sizes", "config")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    config: PutConfig
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ..., config: _Optional[_Union[PutConfig, _Mapping]] = ...) -> None: ...

class PutStartResult(_message.Message):
    __slots__ = ("code", "replicas")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    code: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaDescriptor]
    def __init__(self, code: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaDescriptor, _Mapping]]] = ...) -> None: ...

class BatchPutStartResponse(_message.Message):
    __slots__ = ("status", "results")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    results: _containers.RepeatedCompositeFieldContainer[PutStartResult]
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., results: _Optional[_Iterable[_Union[PutStartResult, _Mapping]]] = ...) -> None: ...

class BatchPutEndRequest(_message.Message):
    __slots__ = ("client_id", "keys", "checksums")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchPutRevokeRequest(_message.Message):
    __slots__ = ("client_id", "keys")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchCodesResponse(_message.Message):
    __slots__ = ("status", "codes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    status: Status
    codes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., codes: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchGetReplicasRequest(_message.Message):
    __slots__ = ("keys", "no_lease")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NO_LEASE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    no_lease: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., no_lease: _Optional[bool] = ...) -> None: ...

class GetReplicasResult(_message.Message):
    __slots__ = ("code", "size", "checksum", "lease_expiry_ms", "replicas")
    CODE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    code: int
    size: int
    checksum: int
    lease_expiry_ms: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaDescriptor]
    def __init__(self, code: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., lease_expiry_ms: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaDescriptor, _Mapping]]] = ...) -> None: ...

class BatchGetReplicasResponse(_message.Message):
    __slots__ = ("status", "results")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    results: _containers.RepeatedCompositeFieldContainer[GetReplicasResult]
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., results: _Optional[_Iterable[_Union[GetReplicasResult, _Mapping]]] = ...) -> None: ...

class BatchExistsRequest(_message.Message):
    __slots__ = ("keys", "prefix")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    prefix: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., prefix: _Optional[bool] = ...) -> None: ...

class BatchExistsResponse(_message.Message):
    __slots__ = ("status", "exists", "prefix_length")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    status: Status
    exists: _containers.RepeatedScalarFieldContainer[bool]
    prefix_length: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., exists: _Optional[_Iterable[bool]] = ..., prefix_length: _Optional[int] = ...) -> None: ...

class BatchRemoveRequest(_message.Message):
    __slots__ = ("keys", "force")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    force: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., force: _Optional[bool] = ...) -> None: ...

class RemoveAllRequest(_message.Message):
    __slots__ = ("force", "prefix")
    FORCE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    force: bool
    prefix: str
    def __init__(self, force: _Optional[bool] = ..., prefix: _Optional[str] = ...) -> None: ...

class RemoveAllResponse(_message.Message):
    __slots__ = ("status", "removed")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    removed: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., removed: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "hard", "soft_ttl_ms", "unpin")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HARD_FIELD_NUMBER: _ClassVar[int]
    SOFT_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    hard: bool
    soft_ttl_ms: int
    unpin: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., hard: _Optional[bool] = ..., soft_ttl_ms: _Optional[int] = ..., unpin: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("status", "segments", "objects", "capacity", "used", "hits", "misses", "evictions", "evicted_bytes", "puts", "reclaimed_puts", "role", "leader", "followers", "extra", "masters")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_PUTS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    MASTERS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    segments: _containers.RepeatedCompositeFieldContainer[SegmentInfo]
    objects: int
    capacity: int
    used: int
    hits: int
    misses: int
    evictions: int
    evicted_bytes: int
    puts: int
    reclaimed_puts: int
    role: str
    leader: str
    followers: _containers.RepeatedScalarFieldContainer[str]
    extra: _containers.ScalarMap[str, float]
    masters: _containers.RepeatedCompositeFieldContainer[MasterMember]
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[SegmentInfo, _Mapping]]] = ..., objects: _Optional[int] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., evicted_bytes: _Optional[int] = ..., puts: _Optional[int] = ..., reclaimed_puts: _Optional[int] = ..., role: _Optional[str] = ..., leader: _Optional[str] = ..., followers: _Optional[_Iterable[str]] = ..., extra: _Optional[_Mapping[str, float]] = ..., masters: _Optional[_Iterable[_Union[MasterMember, _Mapping]]] = ...) -> None: ...

class MasterMember(_message.Message):
    __slots__ = ("grpc", "state")
    GRPC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    grpc: str
    state: str
    def __init__(self, grpc: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class ClusterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterInfoResponse(_message.Message):
    __slots__ = ("status", "grpc_endpoint", "rpc_endpoint", "metrics_endpoint", "cluster", "lease_ttl_ms", "max_key_bytes", "max_object_bytes", "max_batch", "group", "groups")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    GRPC_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RPC_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    METRICS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    grpc_endpoint: str
    rpc_endpoint: str
    metrics_endpoint: str
    cluster: str
    lease_ttl_ms: int
    max_key_bytes: int
    max_object_bytes: int
    max_batch: int
    group: int
    groups: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., grpc_endpoint: _Optional[str] = ..., rpc_endpoint: _Optional[str] = ..., metrics_endpoint: _Optional[str] = ..., cluster: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., max_key_bytes: _Optional[int] = ..., max_object_bytes: _Optional[int] = ..., max_batch: _Optional[int] = ..., group: _Optional[int] = ..., groups: _Optional[int] = ...) -> None: ...

class SegmentStatusRequest(_message.Message):
    __slots__ = ("segment_ids", "node", "status")
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    segment_ids: _containers.RepeatedScalarFieldContainer[int]
    node: str
    status: SegmentStatus
    def __init__(self, segment_ids: _Optional[_Iterable[int]] = ..., node: _Optional[str] = ..., status: _Optional[_Union[SegmentStatus, str]] = ...) -> None: ...

class TierTask(_message.Message):
    __slots__ = ("id", "kind", "key", "src_segment", "src_offset", "dst_segment", "dst_offset", "length", "checksum", "deadline_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SRC_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DST_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    id: int
    kind: TierTaskKind
    key: str
    src_segment: int
    src_offset: int
    dst_segment: int
    dst_offset: int
    length: int
    checksum: int
    deadline_ms: int
    def __init__(self, id: _Optional[int] = ..., kind: _Optional[_Union[TierTaskKind, str]] = ..., key: _Optional[str] = ..., src_segment: _Optional[int] = ..., src_offset: _Optional[int] = ..., dst_segment: _Optional[int] = ..., dst_offset: _Optional[int] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class TierTaskResult(_message.Message):
    __slots__ = ("id", "code")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ...) -> None: ...

class TierTasksRequest(_message.Message):
    __slots__ = ("store_id", "done", "max_tasks")
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MAX_TASKS_FIELD_NUMBER: _ClassVar[int]
    store_id: str
    done: _containers.RepeatedCompositeFieldContainer[TierTaskResult]
    max_tasks: int
    def __init__(self, store_id: _Optional[str] = ..., done: _Optional[_Iterable[_Union[TierTaskResult, _Mapping]]] = ..., max_tasks: _Optional[int] = ...) -> None: ...

class TierTasksResponse(_message.Message):
    __slots__ = ("status", "tasks", "pending")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    status: Status
    tasks: _containers.RepeatedCompositeFieldContainer[TierTask]
    pending: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., tasks: _Optional[_Iterable[_Union[TierTask, _Mapping]]] = ..., pending: _Optional[int] = ...) -> None: ...

class MoveTask(_message.Message):
    __slots__ = ("task_id", "key", "size", "checksum", "source", "target")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    key: str
    size: int
    checksum: int
    source: ReplicaDescriptor
    target: ReplicaDescriptor
    def __init__(self, task_id: _Optional[int] = ..., key: _Optional[str] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., source: _Optional[_Union[ReplicaDescriptor, _Mapping]] = ..., target: _Optional[_Union[ReplicaDescriptor, _Mapping]] = ...) -> None: ...

class MoveResult(_message.Message):
    __slots__ = ("task_id", "code")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    code: int
    def __init__(self, task_id: _Optional[int] = ..., code: _Optional[int] = ...) -> None: ...

class SyncMovesRequest(_message.Message):
    __slots__ = ("store_id", "results", "max_tasks")
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TASKS_FIELD_NUMBER: _ClassVar[int]
    store_id: str
    results: _containers.RepeatedCompositeFieldContainer[MoveResult]
    max_tasks: int
    def __init__(self, store_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[MoveResult, _Mapping]]] = ..., max_tasks: _Optional[int] = ...) -> None: ...

class SyncMovesResponse(_message.Message):
    __slots__ = ("status", "tasks", "pending")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    status: Status
    tasks: _containers.RepeatedCompositeFieldContainer[MoveTask]
    pending: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., tasks: _Optional[_Iterable[_Union[MoveTask, _Mapping]]] = ..., pending: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node", "remove")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    node: str
    remove: bool
    def __init__(self, node: _Optional[str] = ..., remove: _Optional[bool] = ...) -> None: ...

class DrainStatusRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class DrainJobStatus(_message.Message):
    __slots__ = ("node", "state", "objects_moved", "bytes_moved", "objects_remaining", "bytes_remaining", "in_flight", "seconds", "message", "segment_ids", "failures", "remove")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_REMAINING_FIELD_NUMBER: _ClassVar[int]
    BYTES_REMAINING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    node: str
    state: str
    objects_moved: int
    bytes_moved: int
    objects_remaining: int
    bytes_remaining: int
    in_flight: int
    seconds: float
    message: str
    segment_ids: _containers.RepeatedScalarFieldContainer[int]
    failures: int
    remove: bool
    def __init__(self, node: _Optional[str] = ..., state: _Optional[str] = ..., objects_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., objects_remaining: _Optional[int] = ..., bytes_remaining: _Optional[int] = ..., in_flight: _Optional[int] = ..., seconds: _Optional[float] = ..., message: _Optional[str] = ..., segment_ids: _Optional[_Iterable[int]] = ..., failures: _Optional[int] = ..., remove: _Optional[bool] = ...) -> None: ...

class DrainStatusResponse(_message.Message):
    __slots__ = ("status", "jobs")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    jobs: _containers.RepeatedCompositeFieldContainer[DrainJobStatus]
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., jobs: _Optional[_Iterable[_Union[DrainJobStatus, _Mapping]]] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("max_moves", "tolerance")
    MAX_MOVES_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    max_moves: int
    tolerance: float
    def __init__(self, max_moves: _Optional[int] = ..., tolerance: _Optional[float] = ...) -> None: ...

class RebalanceStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RebalanceStatusResponse(_message.Message):
    __slots__ = ("status", "state", "objects_moved", "bytes_moved", "in_flight", "spread", "seconds", "message", "planned")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    state: str
    objects_moved: int
    bytes_moved: int
    in_flight: int
    spread: float
    seconds: float
    message: str
    planned: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., state: _Optional[str] = ..., objects_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., in_flight: _Optional[int] = ..., spread: _Optional[float] = ..., seconds: _Optional[float] = ..., message: _Optional[str] = ..., planned: _Optional[int] = ...) -> None: ...

class ReportStoreFailuresRequest(_message.Message):
    __slots__ = ("client_id", "tcp_endpoints")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TCP_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    tcp_endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_id: _Optional[str] = ..., tcp_endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportStoreFailuresResponse(_message.Message):
    __slots__ = ("status", "suspected")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SUSPECTED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    suspected: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., suspected: _Optional[_Iterable[str]] = ...) -> None: ...

class StandbyDeltaRequest(_message.Message):
    __slots__ = ("store_id", "segment_id", "epoch", "changes", "removed")
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    store_id: str
    segment_id: int
    epoch: str
    changes: _containers.RepeatedCompositeFieldContainer[InventoryEntry]
    removed: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, store_id: _Optional[str] = ..., segment_id: _Optional[int] = ..., epoch: _Optional[str] = ..., changes: _Optional[_Iterable[_Union[InventoryEntry, _Mapping]]] = ..., removed: _Optional[_Iterable[bool]] = ...) -> None: ...

class StandbyFeedResponse(_message.Message):
    __slots__ = ("status", "epoch", "adopted", "rejected")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    epoch: str
    adopted: int
    rejected: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., epoch: _Optional[str] = ..., adopted: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...
