from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]

class PushOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_OUTCOME_UNSPECIFIED: _ClassVar[PushOutcome]
    APPLIED: _ClassVar[PushOutcome]
    ACCEPTED: _ClassVar[PushOutcome]
    DUPLICATE: _ClassVar[PushOutcome]
    SCALED: _ClassVar[PushOutcome]
    SKIPPED: _ClassVar[PushOutcome]
    STALE: _ClassVar[PushOutcome]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
PUSH_OUTCOME_UNSPECIFIED: PushOutcome
APPLIED: PushOutcome
ACCEPTED: PushOutcome
DUPLICATE: PushOutcome
SCALED: PushOutcome
SKIPPED: PushOutcome
STALE: PushOutcome

class TensorInfo(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "lr", "momentum", "dampening", "nesterov", "weight_decay", "beta1", "beta2", "eps")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    DAMPENING_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    lr: float
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    def __init__(self, name: _Optional[str] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., dampening: _Optional[float] = ..., nesterov: _Optional[bool] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ...) -> None: ...

class LrSchedule(_message.Message):
    __slots__ = ("kind", "warmup_steps", "warmup_start_factor", "step_size", "gamma", "cosine_steps", "min_lr")
    KIND_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_START_FACTOR_FIELD_NUMBER: _ClassVar[int]
    STEP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    COSINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_FIELD_NUMBER: _ClassVar[int]
    kind: str
    warmup_steps: int
    warmup_start_factor: float
    step_size: int
    gamma: float
    cosine_steps: int
    min_lr: float
    def __init__(self, kind: _Optional[str] = ..., warmup_steps: _Optional[int] = ..., warmup_start_factor: _Optional[float] = ..., step_size: _Optional[int] = ..., gamma: _Optional[float] = ..., cosine_steps: _Optional[int] = ..., min_lr: _Optional[float] = ...) -> None: ...

class SparseTable(_message.Message):
    __slots__ = ("name", "dim", "optimizer", "lr", "eps", "beta1", "beta2", "initial_accumulator_value", "initializer", "init_scale", "seed", "num_embeddings", "admit_after", "max_rows", "evict_after", "mode", "max_staleness")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    EVICT_AFTER_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    optimizer: str
    lr: float
    eps: float
    beta1: float
    beta2: float
    initial_accumulator_value: float
    initializer: str
    init_scale: float
    seed: int
    num_embeddings: int
    admit_after: int
    max_rows: int
    evict_after: int
    mode: str
    max_staleness: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., eps: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., initializer: _Optional[str] = ..., init_scale: _Optional[float] = ..., seed: _Optional[int] = ..., num_embeddings: _Optional[int] = ..., admit_after: _Optional[int] = ..., max_rows: _Optional[int] = ..., evict_after: _Optional[int] = ..., mode: _Optional[str] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("mode", "num_trainers", "num_shards", "total_params", "fingerprint", "max_staleness", "sync_timeout", "replicas_to_aggregate", "stale_policy", "optimizer", "wire_dtype", "tensors", "job_id", "lr_schedule", "tables", "partitions", "max_trainers", "lr_scaling")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAINERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PARAMS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    SYNC_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_TO_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    STALE_POLICY_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TRAINERS_FIELD_NUMBER: _ClassVar[int]
    LR_SCALING_FIELD_NUMBER: _ClassVar[int]
    mode: str
    num_trainers: int
    num_shards: int
    total_params: int
    fingerprint: str
    max_staleness: int
    sync_timeout: float
    replicas_to_aggregate: int
    stale_policy: str
    optimizer: OptimizerSpec
    wire_dtype: DType
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    job_id: str
    lr_schedule: LrSchedule
    tables: _containers.RepeatedCompositeFieldContainer[SparseTable]
    partitions: int
    max_trainers: int
    lr_scaling: str
    def __init__(self, mode: _Optional[str] = ..., num_trainers: _Optional[int] = ..., num_shards: _Optional[int] = ..., total_params: _Optional[int] = ..., fingerprint: _Optional[str] = ..., max_staleness: _Optional[int] = ..., sync_timeout: _Optional[float] = ..., replicas_to_aggregate: _Optional[int] = ..., stale_policy: _Optional[str] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., job_id: _Optional[str] = ..., lr_schedule: _Optional[_Union[LrSchedule, _Mapping]] = ..., tables: _Optional[_Iterable[_Union[SparseTable, _Mapping]]] = ..., partitions: _Optional[int] = ..., max_trainers: _Optional[int] = ..., lr_scaling: _Optional[str] = ...) -> None: ...

class MembershipEpoch(_message.Message):
    __slots__ = ("number", "round", "members", "size")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    number: int
    round: int
    members: _containers.RepeatedScalarFieldContainer[int]
    size: int
    def __init__(self, number: _Optional[int] = ..., round: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., size: _Optional[int] = ...) -> None: ...

class LayoutEpoch(_message.Message):
    __slots__ = ("number", "round", "table_rounds", "num_shards", "partitions", "addresses", "fingerprint")
    class TableRoundsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TABLE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    number: int
    round: int
    table_rounds: _containers.ScalarMap[str, int]
    num_shards: int
    partitions: int
    addresses: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: str
    def __init__(self, number: _Optional[int] = ..., round: _Optional[int] = ..., table_rounds: _Optional[_Mapping[str, int]] = ..., num_shards: _Optional[int] = ..., partitions: _Optional[int] = ..., addresses: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class HandoffState(_message.Message):
    __slots__ = ("plan", "move", "phase", "version", "bytes")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    plan: str
    move: int
    phase: str
    version: int
    bytes: int
    def __init__(self, plan: _Optional[str] = ..., move: _Optional[int] = ..., phase: _Optional[str] = ..., version: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class ReshardRequest(_message.Message):
    __slots__ = ("op", "plan", "old_addresses", "new_addresses", "partitions", "round", "switch", "you")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PREPARE: _ClassVar[ReshardRequest.Op]
        PROPOSE: _ClassVar[ReshardRequest.Op]
        COMMIT: _ClassVar[ReshardRequest.Op]
        DECIDE: _ClassVar[ReshardRequest.Op]
        RETIRE: _ClassVar[ReshardRequest.Op]
        STATUS: _ClassVar[ReshardRequest.Op]
    PREPARE: ReshardRequest.Op
    PROPOSE: ReshardRequest.Op
    COMMIT: ReshardRequest.Op
    DECIDE: ReshardRequest.Op
    RETIRE: ReshardRequest.Op
    STATUS: ReshardRequest.Op
    OP_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    OLD_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    NEW_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SWITCH_FIELD_NUMBER: _ClassVar[int]
    YOU_FIELD_NUMBER: _ClassVar[int]
    op: ReshardRequest.Op
    plan: str
    old_addresses: _containers.RepeatedScalarFieldContainer[str]
    new_addresses: _containers.RepeatedScalarFieldContainer[str]
    partitions: int
    round: int
    switch: bool
    you: str
    def __init__(self, op: _Optional[_Union[ReshardRequest.Op, str]] = ..., plan: _Optional[str] = ..., old_addresses: _Optional[_Iterable[str]] = ..., new_addresses: _Optional[_Iterable[str]] = ..., partitions: _Optional[int] = ..., round: _Optional[int] = ..., switch: _Optional[bool] = ..., you: _Optional[str] = ...) -> None: ...

class ReshardReply(_message.Message):
    __slots__ = ("plan", "handoffs", "proposal", "version", "layout_epoch", "round", "drained", "followed")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    FOLLOWED_FIELD_NUMBER: _ClassVar[int]
    plan: str
    handoffs: _containers.RepeatedCompositeFieldContainer[HandoffState]
    proposal: int
    version: int
    layout_epoch: int
    round: int
    drained: str
    followed: bool
    def __init__(self, plan: _Optional[str] = ..., handoffs: _Optional[_Iterable[_Union[HandoffState, _Mapping]]] = ..., proposal: _Optional[int] = ..., version: _Optional[int] = ..., layout_epoch: _Optional[int] = ..., round: _Optional[int] = ..., drained: _Optional[str] = ..., followed: _Optional[bool] = ...) -> None: ...

class HandoffChunk(_message.Message):
    __slots__ = ("kind", "plan", "source", "move", "version", "data")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        COPY: _ClassVar[HandoffChunk.Kind]
        FORWARD: _ClassVar[HandoffChunk.Kind]
        VOTE: _ClassVar[HandoffChunk.Kind]
        ROWS_COPY: _ClassVar[HandoffChunk.Kind]
        ROWS_FORWARD: _ClassVar[HandoffChunk.Kind]
        ROWS_VOTE: _ClassVar[HandoffChunk.Kind]
    COPY: HandoffChunk.Kind
    FORWARD: HandoffChunk.Kind
    VOTE: HandoffChunk.Kind
    ROWS_COPY: HandoffChunk.Kind
    ROWS_FORWARD: HandoffChunk.Kind
    ROWS_VOTE: HandoffChunk.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    kind: HandoffChunk.Kind
    plan: str
    source: str
    move: int
    version: int
    data: bytes
    def __init__(self, kind: _Optional[_Union[HandoffChunk.Kind, str]] = ..., plan: _Optional[str] = ..., source: _Optional[str] = ..., move: _Optional[int] = ..., version: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class HandoffAck(_message.Message):
    __slots__ = ("plan", "move", "version", "phase")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    plan: str
    move: int
    version: int
    phase: str
    def __init__(self, plan: _Optional[str] = ..., move: _Optional[int] = ..., version: _Optional[int] = ..., phase: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("rank", "trainer_id", "expected_shard", "job", "partition", "join", "join_round", "layout_epoch", "follows_layouts", "join_confirm")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SHARD_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    JOIN_ROUND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    JOIN_CONFIRM_FIELD_NUMBER: _ClassVar[int]
    rank: int
    trainer_id: str
    expected_shard: int
    job: JobSpec
    partition: int
    join: bool
    join_round: int
    layout_epoch: int
    follows_layouts: bool
    join_confirm: bool
    def __init__(self, rank: _Optional[int] = ..., trainer_id: _Optional[str] = ..., expected_shard: _Optional[int] = ..., job: _Optional[_Union[JobSpec, _Mapping]] = ..., partition: _Optional[int] = ..., join: _Optional[bool] = ..., join_round: _Optional[int] = ..., layout_epoch: _Optional[int] = ..., follows_layouts: _Optional[bool] = ..., join_confirm: _Optional[bool] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("shard", "start", "end", "initialized", "version", "registered", "lease_seconds", "rank", "join_round", "membership_epoch", "layout_epoch")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    JOIN_ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    shard: int
    start: int
    end: int
    initialized: bool
    version: int
    registered: int
    lease_seconds: float
    rank: int
    join_round: int
    membership_epoch: int
    layout_epoch: int
    def __init__(self, shard: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., initialized: _Optional[bool] = ..., version: _Optional[int] = ..., registered: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., rank: _Optional[int] = ..., join_round: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., layout_epoch: _Optional[int] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("rank", "trainer_id", "fingerprint", "dtype", "length", "version", "num_samples", "wait_seconds", "sequence", "outcome", "staleness", "topk", "partition", "membership_epoch", "leaving", "claim", "batches_per_epoch", "batch", "batch_granted", "batch_reissued", "layout_epoch", "moved_from")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_GRANTED_FIELD_NUMBER: _ClassVar[int]
    BATCH_REISSUED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MOVED_FROM_FIELD_NUMBER: _ClassVar[int]
    rank: int
    trainer_id: str
    fingerprint: str
    dtype: DType
    length: int
    version: int
    num_samples: int
    wait_seconds: float
    sequence: int
    outcome: PushOutcome
    staleness: int
    topk: int
    partition: int
    membership_epoch: int
    leaving: bool
    claim: int
    batches_per_epoch: int
    batch: int
    batch_granted: bool
    batch_reissued: bool
    layout_epoch: int
    moved_from: int
    def __init__(self, rank: _Optional[int] = ..., trainer_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., length: _Optional[int] = ..., version: _Optional[int] = ..., num_samples: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., sequence: _Optional[int] = ..., outcome: _Optional[_Union[PushOutcome, str]] = ..., staleness: _Optional[int] = ..., topk: _Optional[int] = ..., partition: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., leaving: _Optional[bool] = ..., claim: _Optional[int] = ..., batches_per_epoch: _Optional[int] = ..., batch: _Optional[int] = ..., batch_granted: _Optional[bool] = ..., batch_reissued: _Optional[bool] = ..., layout_epoch: _Optional[int] = ..., moved_from: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("header", "offset", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    offset: int
    data: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class InitReply(_message.Message):
    __slots__ = ("version", "accepted")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    version: int
    accepted: bool
    def __init__(self, version: _Optional[int] = ..., accepted: _Optional[bool] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("rank", "trainer_id", "fingerprint", "min_version", "dtype", "partition", "layout_epoch")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    rank: int
    trainer_id: str
    fingerprint: str
    min_version: int
    dtype: DType
    partition: int
    layout_epoch: int
    def __init__(self, rank: _Optional[int] = ..., trainer_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., min_version: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., partition: _Optional[int] = ..., layout_epoch: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("outcome", "version", "staleness", "layout_epoch")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    outcome: PushOutcome
    version: int
    staleness: int
    layout_epoch: int
    def __init__(self, outcome: _Optional[_Union[PushOutcome, str]] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., layout_epoch: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("rank", "trainer_id", "fingerprint", "partition")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    trainer_id: str
    fingerprint: str
    partition: int
    def __init__(self, rank: _Optional[int] = ..., trainer_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., partition: _Optional[int] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("remaining",)
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    remaining: int
    def __init__(self, remaining: _Optional[int] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("rank", "trainer_id", "fingerprint", "claim", "batches_per_epoch", "release")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    trainer_id: str
    fingerprint: str
    claim: int
    batches_per_epoch: int
    release: bool
    def __init__(self, rank: _Optional[int] = ..., trainer_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., claim: _Optional[int] = ..., batches_per_epoch: _Optional[int] = ..., release: _Optional[bool] = ...) -> None: ...

class ClaimReply(_message.Message):
    __slots__ = ("batch", "granted", "reissued")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    REISSUED_FIELD_NUMBER: _ClassVar[int]
    batch: int
    granted: bool
    reissued: bool
    def __init__(self, batch: _Optional[int] = ..., granted: _Optional[bool] = ..., reissued: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("rank", "trainer_id", "fingerprint", "partition")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    trainer_id: str
    fingerprint: str
    partition: int
    def __init__(self, rank: _Optional[int] = ..., trainer_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., partition: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("version", "live", "layout_epoch")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    version: int
    live: int
    layout_epoch: int
    def __init__(self, version: _Optional[int] = ..., live: _Optional[int] = ..., layout_epoch: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("with_digest", "partition", "rank", "trainer_id", "fingerprint", "members_from_round")
    WITH_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FROM_ROUND_FIELD_NUMBER: _ClassVar[int]
    with_digest: bool
    partition: int
    rank: int
    trainer_id: str
    fingerprint: str
    members_from_round: int
    def __init__(self, with_digest: _Optional[bool] = ..., partition: _Optional[int] = ..., rank: _Optional[int] = ..., trainer_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., members_from_round: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("shard", "initialized", "version", "mode", "start", "end", "live_ranks", "counters", "job", "state_digest", "lr", "partitions", "epochs", "layouts", "handoffs", "drained")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SHARD_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LIVE_RANKS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    shard: int
    initialized: bool
    version: int
    mode: str
    start: int
    end: int
    live_ranks: _containers.RepeatedScalarFieldContainer[int]
    counters: _containers.ScalarMap[str, float]
    job: JobSpec
    state_digest: str
    lr: float
    partitions: int
    epochs: _containers.RepeatedCompositeFieldContainer[MembershipEpoch]
    layouts: _containers.RepeatedCompositeFieldContainer[LayoutEpoch]
    handoffs: _containers.RepeatedCompositeFieldContainer[HandoffState]
    drained: str
    def __init__(self, shard: _Optional[int] = ..., initialized: _Optional[bool] = ..., version: _Optional[int] = ..., mode: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., live_ranks: _Optional[_Iterable[int]] = ..., counters: _Optional[_Mapping[str, float]] = ..., job: _Optional[_Union[JobSpec, _Mapping]] = ..., state_digest: _Optional[str] = ..., lr: _Optional[float] = ..., partitions: _Optional[int] = ..., epochs: _Optional[_Iterable[_Union[MembershipEpoch, _Mapping]]] = ..., layouts: _Optional[_Iterable[_Union[LayoutEpoch, _Mapping]]] = ..., handoffs: _Optional[_Iterable[_Union[HandoffState, _Mapping]]] = ..., drained: _Optional[str] = ...) -> None: ...

class PullRowsRequest(_message.Message):
    __slots__ = ("rank", "trainer_id", "fingerprint", "table", "min_version", "ids", "layout_epoch", "remember", "packed_ids")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REMEMBER_FIELD_NUMBER: _ClassVar[int]
    PACKED_IDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    trainer_id: str
    fingerprint: str
    table: str
    min_version: int
    ids: bytes
    layout_epoch: int
    remember: bool
    packed_ids: bytes
    def __init__(self, rank: _Optional[int] = ..., trainer_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., table: _Optional[str] = ..., min_version: _Optional[int] = ..., ids: _Optional[bytes] = ..., layout_epoch: _Optional[int] = ..., remember: _Optional[bool] = ..., packed_ids: _Optional[bytes] = ...) -> None: ...

class RowsHeader(_message.Message):
    __slots__ = ("rank", "trainer_id", "fingerprint", "table", "version", "num_samples", "sequence", "num_ids", "dim", "wait_seconds", "pull_ids", "push", "layout_epoch", "pull_refs", "pull_ref", "extra_ids", "packed_pull_ids")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NUM_IDS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PULL_IDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PULL_REFS_FIELD_NUMBER: _ClassVar[int]
    PULL_REF_FIELD_NUMBER: _ClassVar[int]
    EXTRA_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_PULL_IDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    trainer_id: str
    fingerprint: str
    table: str
    version: int
    num_samples: int
    sequence: int
    num_ids: int
    dim: int
    wait_seconds: float
    pull_ids: bytes
    push: PushRowsReply
    layout_epoch: int
    pull_refs: _containers.RepeatedScalarFieldContainer[int]
    pull_ref: int
    extra_ids: bytes
    packed_pull_ids: bytes
    def __init__(self, rank: _Optional[int] = ..., trainer_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., table: _Optional[str] = ..., version: _Optional[int] = ..., num_samples: _Optional[int] = ..., sequence: _Optional[int] = ..., num_ids: _Optional[int] = ..., dim: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., pull_ids: _Optional[bytes] = ..., push: _Optional[_Union[PushRowsReply, _Mapping]] = ..., layout_epoch: _Optional[int] = ..., pull_refs: _Optional[_Iterable[int]] = ..., pull_ref: _Optional[int] = ..., extra_ids: _Optional[bytes] = ..., packed_pull_ids: _Optional[bytes] = ...) -> None: ...

class RowsChunk(_message.Message):
    __slots__ = ("header", "offset", "ids", "rows")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    header: RowsHeader
    offset: int
    ids: bytes
    rows: bytes
    def __init__(self, header: _Optional[_Union[RowsHeader, _Mapping]] = ..., offset: _Optional[int] = ..., ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ...) -> None: ...

class PushRowsReply(_message.Message):
    __slots__ = ("outcome", "version", "staleness", "rows_applied", "rows_stale", "layout_epoch")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    ROWS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    ROWS_STALE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    outcome: PushOutcome
    version: int
    staleness: int
    rows_applied: int
    rows_stale: int
    layout_epoch: int
    def __init__(self, outcome: _Optional[_Union[PushOutcome, str]] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., rows_applied: _Optional[int] = ..., rows_stale: _Optional[int] = ..., layout_epoch: _Optional[int] = ...) -> None: ...

class StepChunk(_message.Message):
    __slots__ = ("part", "dense", "rows", "more", "one_reply")
    PART_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    ONE_REPLY_FIELD_NUMBER: _ClassVar[int]
    part: int
    dense: Chunk
    rows: RowsChunk
    more: _containers.RepeatedCompositeFieldContainer[StepChunk]
    one_reply: bool
    def __init__(self, part: _Optional[int] = ..., dense: _Optional[_Union[Chunk, _Mapping]] = ..., rows: _Optional[_Union[RowsChunk, _Mapping]] = ..., more: _Optional[_Iterable[_Union[StepChunk, _Mapping]]] = ..., one_reply: _Optional[bool] = ...) -> None: ...
