"""What one measurement is: its settings and the job the simulated trainers send."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from psserver.protocol.job import MODES, JobSpec, OptimizerConfig
from psserver.protocol.layout import Layout
from psserver.protocol.rules import Mode

# One TCP connection per channel: a simulated trainer must cost the shard what a real one does.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20)]
DEFAULT_TRAINERS = "1,4,16,64,256,1024"
NO_STOP = float(2 ** 53)  # "no stop version yet" on the board (doubles hold integers exactly up to 2^53)


@dataclass(frozen=True)
class LoadConfig:
    """What one measurement needs; picklable, so worker processes get it whole."""

    mode: str = "sync"
    params: int = 1000  # P: a tiny model, so the numbers are about serving, not bandwidth
    seconds: float = 10.0  # measured window per N
    rounds: int = 0  # or stop after this many rounds (versions in async mode); 0: --seconds only
    warmup: int = 3  # rounds (sync modes) or pushes per trainer (async) before the window opens
    deadline: float = 120.0  # hard limit per N, setup and teardown included
    step_timeout: float = 30.0  # per PushPull; a shard stuck longer counts DEADLINE_EXCEEDED and is retried
    connect_timeout: float = 30.0
    sync_timeout: float = 0.5  # stale-timeout mode
    client_procs: int = 1
    health_interval: float = 0.02
    health_timeout: float = 5.0
    token: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"The mode ({self.mode!r}) must be one of {', '.join(MODES)}.")
        if self.params < 1:
            raise ValueError(f"The parameter count ({self.params}) must be at least 1.")
        if not (self.seconds > 0 or self.rounds > 0):
            raise ValueError(f"Give a window: --seconds ({self.seconds}) or --rounds ({self.rounds}) must be > 0.")
        if self.warmup < 1:
            raise ValueError(f"The warm-up ({self.warmup}) must be at least 1 round.")
        if self.client_procs < 1:
            raise ValueError(f"The client process count ({self.client_procs}) must be at least 1.")
        if not self.deadline > 0 or not self.step_timeout > 0:
            raise ValueError(f"--deadline ({self.deadline}) and --step-timeout ({self.step_timeout}) must be > 0.")

    @property
    def sync_like(self) -> bool:
        return self.mode != Mode.ASYNC


@dataclass(frozen=True)
class JobWire:
    """One job as the simulated trainers send it."""

    address: str
    job: bytes  # serialized JobSpec proto
    job_id: str
    fingerprint: str
    num_trainers: int


def make_job(cfg: LoadConfig, address: str, num_trainers: int) -> JobWire:
    """A one-tensor job; ``job_id`` is set on the spec if this JobSpec knows it, else on the proto."""
    tensors = (("w", (cfg.params,), "float32"),)
    fingerprint = Layout.from_shapes(tensors, 1).fingerprint()
    job_id = f"loadgen-{uuid.uuid4().hex[:12]}"
    kw = dict(mode=cfg.mode, num_trainers=num_trainers, num_shards=1, total_params=cfg.params,
              fingerprint=fingerprint, optimizer=OptimizerConfig("sgd", lr=0.01), tensors=tensors,
              sync_timeout=cfg.sync_timeout if cfg.mode == Mode.STALE_TIMEOUT else 0.0)
    if "job_id" in {f.name for f in dataclasses.fields(JobSpec)}:
        kw["job_id"] = job_id
    msg = JobSpec(**kw).to_proto()
    msg.job_id = job_id
    return JobWire(address, msg.SerializeToString(), job_id, fingerprint, num_trainers)
