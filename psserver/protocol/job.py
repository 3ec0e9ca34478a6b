"""The job spec: what every trainer and shard of one training job must agree on.

Settings are a frozen dataclass validated on construction (as in
torch.distributed.elastic); errors quote the bad value.  A shard stores the spec
of the first trainer to register and refuses any later trainer whose spec
differs, naming the first field that differs and both values.  Every declared
size is capped (psserver.protocol.limits) and every quoted value goes through
logsafe.shorten, so a spec cannot make a shard allocate, loop or log without bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from psserver.common.logsafe import shorten
from psserver.protocol.epochs import LR_SCALINGS
from psserver.protocol.limits import (
    MAX_DIMS,
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    MAX_PARTITIONS,
    MAX_SHARDS,
    MAX_STALENESS,
    MAX_SYNC_TIMEOUT,
    MAX_TABLES,
    MAX_TENSORS,
    MAX_TOTAL_PARAMS,
    MAX_TRAINERS,
    text_problem,
)
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rows.init import Initializer
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import TableSpec
from psserver.protocol.rules import MODES, OPTIMIZERS, STALE_POLICIES, WIRE_DTYPE_CHOICES, Mode  # noqa: F401
from psserver.protocol.schedules import LrSchedule

WIRE_DTYPES = dict(zip(WIRE_DTYPE_CHOICES, (_pb.FLOAT32, _pb.FLOAT16, _pb.BFLOAT16)))
WIRE_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
SHOWN_CHARS = 160  # how much of each value a difference message shows: validated names fit whole


def _number(label: str, value) -> float:
    """``value`` if it is a finite real number; else ValueError naming ``label``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"The {label} ({shorten(value)}) must be a number.")
    if isinstance(value, float) and not math.isfinite(value):  # an int is finite (and may not fit a float)
        raise ValueError(f"The {label} ({value}) must be a finite number.")
    return value


def _text(field_name: str, value, limit: int) -> None:
    problem = text_problem(field_name, value, limit)
    if problem:
        raise ValueError(f"{problem}.")


@dataclass(frozen=True)
class OptimizerConfig:
    """Server-side optimizer and its hyper-parameters (same meaning as in torch.optim).

    Validated by the rules torch.optim's constructors apply, plus finiteness, so a spec a shard
    accepts never fails later inside torch.optim (which would leave the shard half set up).  Every
    field is checked whichever optimizer is named: the unused ones keep their valid defaults.
    """

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"The optimizer ({shorten(self.name)}) must be one of {', '.join(OPTIMIZERS)}.")
        if not _number("learning rate", self.lr) > 0:
            raise ValueError(f"The learning rate ({self.lr}) must be greater than zero.")
        for name in ("momentum", "weight_decay", "eps"):
            if _number(name, getattr(self, name)) < 0:
                raise ValueError(f"The {name} ({getattr(self, name)}) must be zero or more.")
        if not 0 <= _number("dampening", self.dampening) <= 1:
            raise ValueError(f"The dampening ({self.dampening}) must be between 0 and 1.")
        for name in ("beta1", "beta2"):
            if not 0 <= _number(name, getattr(self, name)) < 1:
                raise ValueError(f"The {name} ({getattr(self, name)}) must be at least 0 and less than 1.")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"Nesterov momentum needs momentum > 0 and dampening 0 (got momentum {self.momentum}, "
                f"dampening {self.dampening})."
            )


@dataclass(frozen=True)
class JobSpec:
    """Mode, its knobs, optimizer, sizes and layout of one job.

    Every size is capped (psserver.protocol.limits) and the layout must add up (the tensors hold
    ``total_params`` elements), so a shard can size its state from a spec it accepted.
    """

    mode: str
    num_trainers: int
    num_shards: int
    total_params: int
    fingerprint: str
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    max_staleness: int | None = None  # async: refuse pushes more than this many versions old
    sync_timeout: float = 0.0  # stale-timeout: seconds a round waits after its first gradient
    replicas_to_aggregate: int = 0  # stale-timeout: close after this many gradients (0: all live)
    stale_policy: str = "drop"  # stale-timeout: what a late gradient gets
    wire_dtype: str = "float32"
    tensors: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    job_id: str = ""  # names one run of a job ("" for an unnamed one): a trainer of another run is refused
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)  # the rate at each version (psserver.protocol.schedules)
    tables: tuple[TableSpec, ...] = ()  # sparse embedding tables (psserver.sparse), names unique
    partitions: int = 1  # pieces of each shard's slice with their own rounds (psserver.protocol.layout.partition_range)
    max_trainers: int = 0  # elastic jobs: admit joiners up to this many members (0: none; docs/elastic.md)
    lr_scaling: str = "none"  # the rate as the membership changes: "none" or "linear" (protocol.epochs.lr_factor)

    def __post_init__(self) -> None:
        _text("job_id", self.job_id, MAX_ID_CHARS)
        _text("fingerprint", self.fingerprint, MAX_ID_CHARS)
        if self.mode not in MODES:
            raise ValueError(f"The mode ({shorten(self.mode)}) must be one of {', '.join(MODES)}.")
        if not 1 <= self.num_trainers <= MAX_TRAINERS:
            raise ValueError(f"The number of trainers ({self.num_trainers}) must be between 1 and {MAX_TRAINERS}.")
        if not 1 <= self.num_shards <= MAX_SHARDS:
            raise ValueError(f"The number of shards ({self.num_shards}) must be between 1 and {MAX_SHARDS}.")
        if not 0 <= self.total_params <= MAX_TOTAL_PARAMS:
            raise ValueError(
                f"The total number of parameters ({self.total_params}) must be between 0 and {MAX_TOTAL_PARAMS}."
            )
        if self.max_staleness is not None and not 0 <= self.max_staleness <= MAX_STALENESS:
            raise ValueError(
                f"The maximum staleness ({self.max_staleness}) must be between 0 and {MAX_STALENESS} "
                f"(or unset: unbounded)."
            )
        if not 0 <= _number("sync timeout", self.sync_timeout) <= MAX_SYNC_TIMEOUT:
            raise ValueError(
                f"The sync timeout ({self.sync_timeout} s) must be between 0 and {MAX_SYNC_TIMEOUT} seconds."
            )
        if self.mode == Mode.STALE_TIMEOUT and not self.sync_timeout > 0:
            raise ValueError(f"stale-timeout mode needs a sync timeout > 0 seconds (got {self.sync_timeout}).")
        if not 0 <= self.replicas_to_aggregate <= self.num_trainers:
            raise ValueError(
                f"The replicas to aggregate ({self.replicas_to_aggregate}) must be between 0 and the number "
                f"of trainers ({self.num_trainers})."
            )
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(
                f"The stale policy ({shorten(self.stale_policy)}) must be one of {', '.join(STALE_POLICIES)}."
            )
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"The wire dtype ({shorten(self.wire_dtype)}) must be one of {', '.join(WIRE_DTYPES)}.")
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ValueError(f"The partitions per shard ({self.partitions}) must be between 1 and {MAX_PARTITIONS}.")
        if self.max_trainers and not self.num_trainers <= self.max_trainers <= MAX_TRAINERS:
            raise ValueError(f"The maximum number of trainers ({self.max_trainers}) must be 0 or between the number "
                             f"of trainers ({self.num_trainers}) and {MAX_TRAINERS}.")
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"The lr scaling ({shorten(self.lr_scaling)}) must be one of {', '.join(LR_SCALINGS)}.")
        _check_tensors(self.tensors, self.total_params)
        _check_tables(self.tables, self)
        if self.lr_schedule.kind == "cosine" and self.lr_schedule.min_lr > self.optimizer.lr:
            raise ValueError(f"The lr_schedule.min_lr ({self.lr_schedule.min_lr}) must be at most the learning "
                             f"rate ({self.optimizer.lr}).")

    # -- wire conversion -------------------------------------------------------------------------
    def to_proto(self) -> _pb.JobSpec:
        o = self.optimizer
        return _pb.JobSpec(
            mode=self.mode,
            num_trainers=self.num_trainers,
            num_shards=self.num_shards,
            total_params=self.total_params,
            fingerprint=self.fingerprint,
            max_staleness=-1 if self.max_staleness is None else self.max_staleness,
            sync_timeout=self.sync_timeout,
            replicas_to_aggregate=self.replicas_to_aggregate,
            stale_policy=self.stale_policy,
            optimizer=_pb.OptimizerSpec(
                name=o.name, lr=o.lr, momentum=o.momentum, dampening=o.dampening, nesterov=o.nesterov,
                weight_decay=o.weight_decay, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
            ),
            wire_dtype=WIRE_DTYPES[self.wire_dtype],
            tensors=[_pb.TensorInfo(name=n, shape=list(s), dtype=d) for n, s, d in self.tensors],
            job_id=self.job_id,
            lr_schedule=_pb.LrSchedule(**{f.name: getattr(self.lr_schedule, f.name) for f in fields(LrSchedule)}),
            tables=[table_to_proto(t) for t in self.tables],
            partitions=self.partitions,
            max_trainers=self.max_trainers,
            lr_scaling=self.lr_scaling,
        )

    @staticmethod
    def from_proto(msg: _pb.JobSpec) -> "JobSpec":
        """Decode and validate; raises ValueError naming the bad field."""
        _check_tensor_count(len(msg.tensors))  # before copying them out
        _check_table_count(len(msg.tables))
        o = msg.optimizer
        return JobSpec(
            mode=msg.mode,
            num_trainers=msg.num_trainers,
            num_shards=msg.num_shards,
            total_params=msg.total_params,
            fingerprint=msg.fingerprint,
            optimizer=OptimizerConfig(
                name=o.name, lr=o.lr, momentum=o.momentum, dampening=o.dampening, nesterov=o.nesterov,
                weight_decay=o.weight_decay, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
            ),
            max_staleness=None if msg.max_staleness == -1 else msg.max_staleness,  # -1 alone means unbounded
            sync_timeout=msg.sync_timeout,
            replicas_to_aggregate=msg.replicas_to_aggregate,
            stale_policy=msg.stale_policy,
            wire_dtype=WIRE_DTYPE_NAMES.get(msg.wire_dtype, f"dtype#{msg.wire_dtype}"),
            tensors=tuple((t.name, tuple(t.shape), t.dtype) for t in msg.tensors),
            job_id=msg.job_id,
            lr_schedule=(LrSchedule(**{f.name: getattr(msg.lr_schedule, f.name) for f in fields(LrSchedule)})
                         if msg.HasField("lr_schedule") else LrSchedule()),  # an older trainer's or checkpoint's
            tables=tuple(table_from_proto(t) for t in msg.tables),
            partitions=msg.partitions or 1,  # 0: an older trainer's or checkpoint's, one partition
            max_trainers=msg.max_trainers,
            lr_scaling=msg.lr_scaling or "none",
        )

    def joiner_difference(self, joiner: "JobSpec") -> str | None:
        """``difference`` for a trainer joining this running job: its initial trainer count is the job's to keep,
        not the joiner's to repeat (a joiner's --num-trainers is only what it started with)."""
        return self.difference(replace(joiner, num_trainers=self.num_trainers))

    def difference(self, other: "JobSpec") -> str | None:
        """One sentence naming the first field where ``other`` differs from self, or None."""
        # The job id comes first: a trainer of another run is told so, not how that run's settings differ.
        # The layout is compared before its hash so the message names a tensor, not two hex strings.
        first, last = ["job_id"], ["tensors", "total_params", "fingerprint"]
        order = first + [f.name for f in fields(self) if f.name not in first + last] + last
        for name in order:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine == theirs:
                continue
            if name in ("optimizer", "lr_schedule"):
                for g in fields(mine):
                    a, b = getattr(mine, g.name), getattr(theirs, g.name)
                    if a != b:
                        return f"{name}.{g.name} is {_show(b)} but the job has {_show(a)}"
            if name == "tensors":
                return _tensor_difference(mine, theirs)
            if name == "tables":
                return _table_difference(mine, theirs)
            return f"{name} is {_show(theirs)} but the job has {_show(mine)}"
        return None


def _show(value) -> str:
    return shorten(value, SHOWN_CHARS)


def _check_tensor_count(n: int) -> None:
    if n > MAX_TENSORS:
        raise ValueError(f"The job lists {n} tensors, over the limit of {MAX_TENSORS}.")


def _check_tensors(tensors, total_params: int) -> None:
    """Each (name, shape, dtype) within the caps, and (when any are given) their elements add up to
    ``total_params``: the layout and the flat vector a shard slices must be the same thing."""
    _check_tensor_count(len(tensors))
    elements = 0
    for i, (name, shape, dtype) in enumerate(tensors):
        _text(f"tensor #{i} name", name, MAX_NAME_CHARS)
        _text(f"tensor #{i} dtype", dtype, MAX_NAME_CHARS)
        if len(shape) > MAX_DIMS:
            raise ValueError(
                f"Tensor #{i} ({_show(name)}) has {len(shape)} dimensions, over the limit of {MAX_DIMS}."
            )
        if any(d < 0 for d in shape):
            raise ValueError(f"Tensor #{i} ({_show(name)}) has a negative dimension in its shape {list(shape)}.")
        elements += math.prod(shape)
    if tensors and elements != total_params:
        raise ValueError(f"The tensors hold {elements} elements but total_params is {total_params}.")


def _tensor_difference(mine, theirs) -> str:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return (f"parameter #{i} is {_show(b[0])} {list(b[1])} {b[2]} "
                    f"but the job has {_show(a[0])} {list(a[1])} {a[2]}")
    if len(theirs) > len(mine):
        extra = theirs[len(mine)]
        return f"the model has an extra parameter {_show(extra[0])} {list(extra[1])} beyond the job's {len(mine)}"
    missing = mine[len(theirs)]
    return (f"the model lacks parameter {_show(missing[0])} {list(missing[1])} "
            f"(it has {len(theirs)} of {len(mine)})")


# -- sparse tables ----------------------------------------------------------------------------------
def _check_table_count(n: int) -> None:
    if n > MAX_TABLES:
        raise ValueError(f"The job lists {n} sparse tables, over the limit of {MAX_TABLES}.")


def _check_tables(tables, job: "JobSpec") -> None:
    """Table specs, distinct names, and a mode each that the job's knobs can run."""
    _check_table_count(len(tables))
    seen = set()
    for i, t in enumerate(tables):
        if not isinstance(t, TableSpec):
            raise ValueError(f"Table #{i} ({_show(t)}) must be a psserver.protocol.rows.table.TableSpec.")
        if t.name in seen:
            raise ValueError(f"Table #{i} repeats the name {_show(t.name)}: table names must be distinct.")
        seen.add(t.name)
        if t.mode == Mode.STALE_TIMEOUT and not job.sync_timeout > 0:
            raise ValueError(f"Table {_show(t.name)} runs stale-timeout mode, which needs a sync timeout > 0 "
                             f"seconds (got {job.sync_timeout}).")


def table_mode(table: TableSpec, job: "JobSpec") -> str:
    """The mode a table runs in: its own, or the job's when it names none."""
    return table.mode or job.mode


def table_to_proto(t: TableSpec) -> _pb.SparseTable:
    o, init = t.optimizer, t.initializer
    return _pb.SparseTable(
        name=t.name, dim=t.dim, optimizer=o.name, lr=o.lr, eps=o.eps, beta1=o.beta1, beta2=o.beta2,
        initial_accumulator_value=o.initial_accumulator_value, initializer=init.kind, init_scale=init.scale,
        seed=t.seed, num_embeddings=t.num_embeddings or 0, admit_after=t.admit_after, max_rows=t.max_rows or 0,
        evict_after=t.evict_after or 0, mode=t.mode, max_staleness=-1 if t.max_staleness is None else t.max_staleness,
    )


def table_from_proto(m: _pb.SparseTable) -> TableSpec:
    """Decode and validate one table; raises ValueError naming the bad field."""
    return TableSpec(
        name=m.name, dim=m.dim,
        optimizer=SparseOptimizerConfig(name=m.optimizer, lr=m.lr, eps=m.eps, beta1=m.beta1, beta2=m.beta2,
                                        initial_accumulator_value=m.initial_accumulator_value),
        initializer=Initializer(kind=m.initializer, scale=m.init_scale), seed=m.seed,
        num_embeddings=m.num_embeddings or None, admit_after=m.admit_after, max_rows=m.max_rows or None,
        evict_after=m.evict_after or None, mode=m.mode,
        max_staleness=None if m.max_staleness == -1 else m.max_staleness,
    )


def _table_difference(mine, theirs) -> str:
    for a, b in zip(mine, theirs):
        if a != b:
            for f in fields(a):
                x, y = getattr(a, f.name), getattr(b, f.name)
                if x != y:
                    return f"table {_show(a.name)} {f.name} is {_show(y)} but the job has {_show(x)}"
    if len(theirs) > len(mine):
        return f"the model has an extra table {_show(theirs[len(mine)].name)} beyond the job's {len(mine)}"
    return f"the model lacks table {_show(mine[len(theirs)].name)} (it has {len(theirs)} of {len(mine)})"
