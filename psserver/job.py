"""The job spec: what every trainer and shard of one training job must agree on.

Settings are a frozen dataclass validated on construction (as in
torch.distributed.elastic); errors quote the bad value.  A shard stores the spec
of the first trainer to register and refuses any later trainer whose spec
differs, naming the first field that differs and both values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from psserver.proto import ps_pb2 as _pb

MODES = ("sync", "async", "stale-timeout")
OPTIMIZERS = ("sgd", "adam", "adamw")
STALE_POLICIES = ("drop", "scale")
WIRE_DTYPES = {"float32": _pb.FLOAT32, "float16": _pb.FLOAT16, "bfloat16": _pb.BFLOAT16}
WIRE_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}


@dataclass(frozen=True)
class OptimizerConfig:
    """Server-side optimizer and its hyper-parameters (same meaning as in torch.optim)."""

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
            raise ValueError(f"The optimizer ({self.name!r}) must be one of {', '.join(OPTIMIZERS)}.")
        if not self.lr > 0:
            raise ValueError(f"The learning rate ({self.lr}) must be greater than zero.")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"Nesterov momentum needs momentum > 0 and dampening 0 (got momentum {self.momentum}, "
                f"dampening {self.dampening})."
            )


@dataclass(frozen=True)
class JobSpec:
    """Mode, its knobs, optimizer, sizes and layout of one job."""

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

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"The mode ({self.mode!r}) must be one of {', '.join(MODES)}.")
        if self.num_trainers < 1:
            raise ValueError(f"The number of trainers ({self.num_trainers}) must be at least 1.")
        if self.num_shards < 1:
            raise ValueError(f"The number of shards ({self.num_shards}) must be at least 1.")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"The maximum staleness ({self.max_staleness}) must be zero or more.")
        if self.mode == "stale-timeout" and not self.sync_timeout > 0:
            raise ValueError(f"stale-timeout mode needs a sync timeout > 0 seconds (got {self.sync_timeout}).")
        if not 0 <= self.replicas_to_aggregate <= self.num_trainers:
            raise ValueError(
                f"The replicas to aggregate ({self.replicas_to_aggregate}) must be between 0 and the number "
                f"of trainers ({self.num_trainers})."
            )
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"The stale policy ({self.stale_policy!r}) must be one of {', '.join(STALE_POLICIES)}.")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"The wire dtype ({self.wire_dtype!r}) must be one of {', '.join(WIRE_DTYPES)}.")

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
        )

    @staticmethod
    def from_proto(msg: _pb.JobSpec) -> "JobSpec":
        """Decode and validate; raises ValueError naming the bad field."""
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
        )

    def difference(self, other: "JobSpec") -> str | None:
        """One sentence naming the first field where ``other`` differs from self, or None."""
        # The layout is compared before its hash so the message names a tensor, not two hex strings.
        order = [f.name for f in fields(self) if f.name not in ("tensors", "total_params", "fingerprint")]
        for name in order + ["tensors", "total_params", "fingerprint"]:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine == theirs:
                continue
            if name == "optimizer":
                for g in fields(mine):
                    a, b = getattr(mine, g.name), getattr(theirs, g.name)
                    if a != b:
                        return f"optimizer.{g.name} is {b!r} but the job has {a!r}"
            if name == "tensors":
                return _tensor_difference(mine, theirs)
            return f"{name} is {theirs!r} but the job has {mine!r}"
        return None


def _tensor_difference(mine, theirs) -> str:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return (
                f"parameter #{i} is {b[0]!r} {list(b[1])} {b[2]} but the job has {a[0]!r} {list(a[1])} {a[2]}"
            )
    if len(theirs) > len(mine):
        extra = theirs[len(mine)]
        return f"the model has an extra parameter {extra[0]!r} {list(extra[1])} beyond the job's {len(mine)}"
    missing = mine[len(theirs)]
    return f"the model lacks parameter {missing[0]!r} {list(missing[1])} (it has {len(theirs)} of {len(mine)})"
