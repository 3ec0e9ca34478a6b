"""The training loop behind `ps-trainer`: data, model, steps, evaluation, metrics.

Every way out of ``train()`` -- the last step, an exception, a stop request
(SIGTERM/SIGINT from the CLI) -- leaves the job, so no shard keeps waiting on
this trainer.  A stop request finishes the current step, then rank 0 writes
``--output`` and the run ends normally, its summary saying ``stopped``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from psserver.common.tboard import ScalarLog
from psserver.protocol.job import MODES, JobSpec, OptimizerConfig
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rules import Mode
from psserver.protocol.schedules import LrSchedule
from psserver.protocol.security import parse_addresses
from trainer.api import connect
from trainer.client import LOOPBACK_HOSTS
from trainer.clipping import check_max_norm
from trainer.compress import parse_compress
from trainer.data import epoch_order, load_dataset, local_batch_indices, steps_per_epoch
from trainer.models import build_model
from trainer.recmodels import REC_MODELS
from trainer.rectrain import REC_DATASETS, REC_L2, build_ratings_model, load_ratings_dataset, pairs_rmse
from trainer.stepper import Stepper

log = logging.getLogger(__name__)
WARMUP_STEPS = 2  # left out of the steady throughput (see SteadyClock)


@dataclass(frozen=True)
class TrainConfig:
    ps: str
    rank: int = 0
    num_trainers: int = 1
    mode: str = "sync"
    model: str = "cnn"
    dataset: str = "mnist5k"
    batch_size: int = 32
    epochs: int = 1
    steps: int = 0  # when > 0: run this many steps (over as many epochs as needed) instead of --epochs
    optimizer: str = "sgd"
    lr: float | None = None  # None: 0.05, divided by the number of trainers in async mode (see effective_lr)
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "auto"
    output: str = ""  # rank 0 writes the trained state dict here
    save_every: int = 0  # rank 0 also writes --output every N steps (0: at the end only)
    metrics_file: str = ""  # JSON lines
    tensorboard: str = ""  # TensorBoard scalars in DIR/trainer<rank> (loss, accuracy, samples/s, staleness)
    max_staleness: int | None = None
    sync_timeout: float = 0.0
    replicas_to_aggregate: int = 0
    stale_policy: str = "drop"
    wire_dtype: str = "float32"
    step_delay: float = 0.0  # extra seconds per step: simulates a slow trainer (a straggler)
    threads: int = 0  # torch intra-op threads (0: see default_threads)
    log_every: int = 20
    eval_every: int = 0  # also evaluate every N steps (0: at the end of each epoch only)
    progress: bool | None = None  # None: a bar on a terminal, log lines otherwise
    connect_timeout: float = 120.0
    retry_budget: float = 60.0  # seconds a call to a shard is retried before the step fails
    overlap: bool = False  # async: pull the next weights while computing
    push_during_backward: bool = False  # push each shard's slice as soon as backward has produced it
    backend: str = "ps"  # "ps"; or the ps-bench baselines "ddp" (gloo), "ddp-nccl" (--ps: the master), "local"
    security: object = None  # psserver.protocol.security.ClientSecurity; None: plaintext, no token
    job_id: str = ""  # names this run of the job; every trainer of it passes the same
    # The learning-rate schedule the shards apply by version (psserver.protocol.schedules; async: a version per push).
    lr_schedule: str = "constant"  # constant | step | cosine
    warmup_steps: int = 0  # linear warm-up over the first versions (0: none)
    warmup_start_factor: float = 0.1  # the warm-up starts at lr * this
    lr_step_size: int = 1  # step: the rate is multiplied by lr_gamma every lr_step_size versions
    lr_gamma: float = 0.1
    lr_cosine_steps: int = 0  # cosine: versions from lr down to lr_min (0: the rest of the run after warm-up)
    lr_min: float = 0.0  # cosine: the floor
    clip_grad_norm: float | None = None  # clip this trainer's own gradient to this 2-norm (not the round's average)
    compress: str = ""  # "topk:RATIO": push the largest RATIO of each slice, the rest kept for later (trainer.compress)
    partition_bytes: int = 0  # partitions of each shard's slice of at most this many bytes (0: one per shard)
    pipeline: bool = False  # the exchange runs behind the next forward, each layer waiting for its partitions
    # Recommender datasets (movielens100k): the tables of --model mf / ncf live on the shards (trainer.embedding).
    embedding_dim: int | None = None  # None: 32
    sparse_optimizer: str | None = None  # the tables' per-row optimizer (psserver.protocol.rows.optim); None: adam
    sparse_lr: float | None = None  # None: 0.01
    embedding_mode: str = ""  # "": the tables follow --mode; "async": async tables next to sync dense layers
    admit_after: int = 0  # a row is stored once its id was seen more than this many times
    max_rows: int | None = None  # live rows per table per shard (least recently used evicted past it)

    def __post_init__(self) -> None:
        problem = config_problem(self)
        if problem:
            raise ValueError(problem)

    @property
    def recommender(self) -> bool:
        return self.dataset in REC_DATASETS

    def sparse_optimizer_config(self) -> SparseOptimizerConfig:
        """The tables' optimizer; raises ValueError naming a bad hyper-parameter."""
        return SparseOptimizerConfig(name=self.sparse_optimizer or "adam",
                                     lr=0.01 if self.sparse_lr is None else self.sparse_lr)

    def optimizer_config(self) -> OptimizerConfig:
        """The shards' optimizer; raises ValueError naming a bad hyper-parameter."""
        extra = dict(momentum=self.momentum, nesterov=self.nesterov) if self.optimizer == "sgd" else {}
        return OptimizerConfig(name=self.optimizer, lr=effective_lr(self), weight_decay=self.weight_decay, **extra)


def config_problem(cfg: TrainConfig) -> str:
    """The first thing wrong with ``cfg``, as one sentence naming the flag and its value; "" if nothing."""
    device = device_problem(cfg.device, torch.cuda.device_count())
    checks = [
        (cfg.num_trainers >= 1, f"--num-trainers ({cfg.num_trainers}) must be at least 1"),
        (0 <= cfg.rank < cfg.num_trainers,
         f"--rank ({cfg.rank}) must be between 0 and --num-trainers - 1 ({cfg.num_trainers - 1})"),
        (cfg.batch_size >= 1, f"--batch-size ({cfg.batch_size}) must be at least 1"),
        (cfg.steps >= 0, f"--steps ({cfg.steps}) must be zero (use --epochs) or more"),
        (cfg.epochs >= 0, f"--epochs ({cfg.epochs}) must be zero or more"),
        (cfg.epochs >= 1 or cfg.steps >= 1, f"give --epochs >= 1 or --steps >= 1 (got {cfg.epochs} and {cfg.steps})"),
        (cfg.eval_every >= 0, f"--eval-every ({cfg.eval_every}) must be zero (each epoch only) or more"),
        (cfg.log_every >= 1, f"--log-every ({cfg.log_every}) must be at least 1"),
        (cfg.save_every >= 0, f"--save-every ({cfg.save_every}) must be zero (at the end only) or more"),
        (not cfg.save_every or cfg.output, f"--save-every ({cfg.save_every}) needs --output"),
        (cfg.threads >= 0, f"--threads ({cfg.threads}) must be zero (automatic) or more"),
        (math.isfinite(cfg.step_delay) and cfg.step_delay >= 0,
         f"--step-delay ({cfg.step_delay}) must be zero or more seconds"),
        (math.isfinite(cfg.connect_timeout) and cfg.connect_timeout > 0,
         f"--connect-timeout ({cfg.connect_timeout}) must be more than zero seconds"),
        (math.isfinite(cfg.retry_budget) and cfg.retry_budget >= 0,
         f"--retry-budget ({cfg.retry_budget}) must be zero or more seconds"),
        (cfg.mode in MODES, f"--mode ({cfg.mode}) must be one of {', '.join(MODES)}"),
        (cfg.mode == Mode.ASYNC or not cfg.overlap, f"--overlap applies to --mode async only, not {cfg.mode}"),
        (cfg.partition_bytes >= 0, f"--partition-bytes ({cfg.partition_bytes}) must be zero (one partition per "
                                   "shard) or more bytes"),
        (not (cfg.pipeline and cfg.overlap), "--pipeline and --overlap both hide the pull behind compute: choose one"),
        (not (cfg.pipeline and cfg.recommender),
         f"--pipeline does not apply to --dataset {cfg.dataset}: its embedding tables live on the shards"),
        (cfg.backend == "ps" or not (cfg.pipeline or cfg.partition_bytes),
         f"--pipeline and --partition-bytes apply to --backend ps only, not {cfg.backend}"),
        (cfg.optimizer == "sgd" or not cfg.nesterov, f"--nesterov applies to --optimizer sgd only, not {cfg.optimizer}"),
        (not device, device),
        (cfg.backend != "ddp-nccl" or (cfg.device != "cpu" and torch.cuda.device_count() > 0),
         f"--backend ddp-nccl needs a GPU (--device {cfg.device}, {torch.cuda.device_count()} visible); "
         "use --backend ddp (gloo) on the CPU"),
    ]
    for ok, message in checks + recommender_checks(cfg):
        if not ok:
            return message
    try:
        if cfg.backend == "ps":
            check_job_settings(cfg)
        else:
            cfg.optimizer_config()
            rec_table_specs(cfg)
            lr_schedule(cfg, total_steps=1)  # the run's length only fills in a cosine's default length
        check_max_norm(cfg.clip_grad_norm, cfg.push_during_backward)
        check_compress(cfg)
    except ValueError as e:
        return str(e)
    return ""


def check_compress(cfg: TrainConfig) -> None:
    """--compress: a valid value, and only with the parameter servers (the baselines push nothing)."""
    if parse_compress(cfg.compress) is not None and cfg.backend != "ps":
        raise ValueError(f"--compress ({cfg.compress}) applies to --backend ps only, not {cfg.backend}")


REC_FLAGS = ("embedding_dim", "sparse_optimizer", "sparse_lr", "embedding_mode", "admit_after", "max_rows")


def recommender_checks(cfg: TrainConfig) -> list[tuple[bool, str]]:
    """The dataset, the model and the table flags must go together (image models take no tables)."""
    rec = f"--dataset {' or '.join(REC_DATASETS)}"
    defaults = TrainConfig.__dataclass_fields__
    given = [f for f in REC_FLAGS if getattr(cfg, f) != defaults[f].default]
    return [
        (not cfg.recommender or cfg.model in REC_MODELS,
         f"--model {cfg.model} does not fit --dataset {cfg.dataset}: choose one of {', '.join(REC_MODELS)}"),
        (cfg.recommender or cfg.model not in REC_MODELS,
         f"--model {cfg.model} is a recommender model: it needs {rec}, not --dataset {cfg.dataset}"),
        (cfg.recommender or not given,
         f"--{given[0].replace('_', '-') if given else ''} applies to {rec} only, not --dataset {cfg.dataset}"),
        (not cfg.recommender or not cfg.backend.startswith("ddp"),
         f"--backend {cfg.backend} cannot train the tables of {rec}"),
        (cfg.embedding_dim is None or cfg.embedding_dim >= 1, f"--embedding-dim ({cfg.embedding_dim}) must be at least 1"),
        (cfg.admit_after >= 0, f"--admit-after ({cfg.admit_after}) must be zero (store every row) or more"),
        (cfg.max_rows is None or cfg.max_rows >= 1, f"--max-rows ({cfg.max_rows}) must be at least 1"),
        (cfg.sparse_lr is None or (math.isfinite(cfg.sparse_lr) and cfg.sparse_lr > 0),
         f"--sparse-lr ({cfg.sparse_lr}) must be more than zero"),
        (cfg.embedding_mode != Mode.STALE_TIMEOUT or cfg.mode == Mode.STALE_TIMEOUT,  # the job's timeout is its knob
         f"--embedding-mode stale-timeout needs --mode stale-timeout (for its --sync-timeout), not {cfg.mode}"),
    ]


def rec_table_specs(cfg: TrainConfig) -> tuple:
    """Stand-ins for the job's tables, so their settings are checked with the job's rules before anything starts."""
    if not cfg.recommender:
        return ()
    from psserver.protocol.rows.table import TableSpec

    return (TableSpec(name="check", dim=cfg.embedding_dim or 32, optimizer=cfg.sparse_optimizer_config(),
                      admit_after=cfg.admit_after, max_rows=cfg.max_rows, mode=cfg.embedding_mode),)


def ignored_flags(cfg: TrainConfig) -> list[str]:
    """Knobs of another mode that were set: warned about and left out of the job, not refused.

    Not an error because deployments set them once for every mode (the compose file's
    PS_TRAINER_SYNC_TIMEOUT) and switch only the mode.
    """
    knobs = [("--sync-timeout", cfg.sync_timeout, 0.0, "stale-timeout"),
             ("--replicas-to-aggregate", cfg.replicas_to_aggregate, 0, "stale-timeout"),
             ("--stale-policy", cfg.stale_policy, "drop", "stale-timeout"),
             ("--max-staleness", cfg.max_staleness, None, "async")]
    return [f"{flag} ({value}) applies to --mode {mode} only, not {cfg.mode}: ignored"
            for flag, value, default, mode in knobs if cfg.mode != mode and value != default]


def effective_lr(cfg: TrainConfig) -> float:
    """The learning rate to use: the one given, else 0.05 -- over N in async mode.

    In sync modes one step averages N*b samples; in async mode every push is a
    step on b samples, N times as many steps, so by the linear scaling rule the
    learning rate is divided by N (with momentum 0.9, async at the sync rate diverges).
    """
    if cfg.lr is not None:
        return cfg.lr
    if cfg.recommender:
        return 0.001  # Adam on the dense layers, as trainer.rectrain's baseline
    return 0.05 / cfg.num_trainers if cfg.mode == Mode.ASYNC else 0.05


def default_threads(cfg: TrainConfig, cores: int | None = None) -> int:
    """torch threads when --threads is not given: the cores divided by the trainers on this host.

    Trainers on one host that each take every core run several times slower than
    trainers sharing them (measured: 122 against 973-1,320 samples/s for two CNN
    trainers on 2 cores).  The trainers on this host are ``LOCAL_WORLD_SIZE`` (as
    torchrun sets it) when given, else all of them when every shard is on loopback
    (a one-machine job), else just this one -- then torch's default (0) is kept.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        trainers = int(local)
    elif not cfg.backend.startswith("ddp") and all(a.startswith(LOOPBACK_HOSTS) for a in parse_addresses(cfg.ps)):
        trainers = cfg.num_trainers
    else:
        return 0
    return max(1, cores // trainers) if trainers > 1 else 0


DEVICE_HELP = "auto, cpu, cuda or cuda:N"


def device_problem(name: str, count: int) -> str:
    """What is wrong with ``--device NAME`` when ``count`` GPUs are visible, as one sentence with a hint; "" if nothing."""
    if name in ("auto", "cpu"):
        return ""
    index = name.partition(":")[2] if name.startswith("cuda:") else ""
    if name != "cuda" and not index.isdigit():
        return f"--device ({name}) must be {DEVICE_HELP}"
    if count == 0:
        return f"--device {name} was asked for but no CUDA device is visible; use --device auto or cpu"
    if index and int(index) >= count:
        return (f"--device {name} names GPU {index} but {count} {'is' if count == 1 else 'are'} visible "
                f"(cuda:0 to cuda:{count - 1}); pick one of those or check CUDA_VISIBLE_DEVICES")
    return ""


def local_rank(cfg: TrainConfig, env: dict | None = None) -> int:
    """This trainer's index among the trainers on its host, to choose its GPU.

    ``LOCAL_RANK`` when set (torchrun and ps-cluster set it), else the rank modulo the trainers on this host as
    default_threads counts them: ``LOCAL_WORLD_SIZE``, or all of them when every address is on loopback (a
    one-machine job), else this one alone (0).
    """
    env = os.environ if env is None else env
    given, local = env.get("LOCAL_RANK", ""), env.get("LOCAL_WORLD_SIZE", "")
    if given.isdigit():
        return int(given)
    if local.isdigit() and int(local) > 0:
        return cfg.rank % int(local)
    if all(a.startswith(LOOPBACK_HOSTS) for a in parse_addresses(cfg.ps)):
        return cfg.rank
    return 0


def pick_device(name: str, local: int = 0, count: int | None = None) -> torch.device:
    """The device of ``--device``: auto and cuda take GPU ``local % count`` so trainers on one host spread over
    its GPUs (as torchrun and DDP users expect), auto falls back to the CPU; cuda:N is checked against ``count``
    (the visible GPUs; torch's count when None)."""
    count = torch.cuda.device_count() if count is None else count
    problem = device_problem(name, count)
    if problem:
        raise ValueError(problem)
    if name == "cpu" or (name == "auto" and count == 0):
        return torch.device("cpu")
    if name in ("auto", "cuda"):
        return torch.device("cuda", local % count)
    return torch.device(name)


def finite_json(value):
    """``value`` with every NaN or infinite float replaced by None: JSON has no NaN (a diverged loss is null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


class MetricsWriter:
    """JSON lines, flushed per record so a watcher (ps-cluster) can follow the run live.

    Written with ``allow_nan=False``: every line is valid JSON (a value never measured is null).
    """

    def __init__(self, path: str, rank: int):
        self.rank = rank
        self.f = open(path, "a", buffering=1) if path else None

    def write(self, event: str, **fields) -> None:
        if self.f:
            record = {"event": event, "rank": self.rank, "time": time.time(), **fields}
            self.f.write(json.dumps(finite_json(record), allow_nan=False) + "\n")

    def close(self) -> None:
        if self.f:
            self.f.close()


class SteadyClock:
    """Throughput over the steady part of a run, the number ps-bench compares across systems.

    The first ``warmup`` steps (lazy initialisation, first allocations, connection set-up) and every
    evaluation are left out: a short benchmark run would otherwise be dominated by them, and they
    cost every system about the same, which pulls all ratios towards 1.
    """

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.eval_seconds = 0.0
        self._start: tuple[float, float, dict] | None = None  # (time, eval seconds, timing) after warm-up
        self._last: tuple[int, float, float, dict] | None = None  # (step, time, eval seconds, timing)

    def after_step(self, step: int, timing: dict) -> None:
        now = time.perf_counter()
        if step == self.warmup:
            self._start = (now, self.eval_seconds, dict(timing))
        self._last = (step, now, self.eval_seconds, dict(timing))

    def summary(self, batch_size: int) -> dict:
        """steady_steps, steady_samples_per_sec and per-step compute/push/pull/wait seconds (empty if too short)."""
        if self._start is None or self._last[0] <= self.warmup:
            return {}
        t0, e0, timing0 = self._start
        step, t1, e1, timing1 = self._last
        n = step - self.warmup
        seconds = (t1 - t0) - (e1 - e0)
        return dict(steady_steps=n, steady_samples_per_sec=n * batch_size / seconds,
                    **{f"steady_{k}_seconds": (timing1[k] - timing0[k]) / n for k in timing1})


class Progress:
    """What a person watching sees: a bar on a terminal (log lines go above it), log lines otherwise.

    Shows the latest training loss and the latest *evaluated* accuracy -- none until the first evaluation.
    """

    def __init__(self, cfg: TrainConfig, total_steps: int):
        self.cfg, self.total = cfg, total_steps
        self.accuracy: float | None = None
        self.bar = None
        self._redirect = nullcontext()
        if sys.stderr.isatty() if cfg.progress is None else cfg.progress:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, desc=f"rank {cfg.rank}", unit="step", dynamic_ncols=True)
            self._redirect = logging_redirect_tqdm()  # log records are written above the bar, not into it
        self._redirect.__enter__()

    def step(self, step: int, epoch: int, loss: float, rate: float, stale_steps: int, versions: list[int]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            shown = dict(loss=f"{loss:.3f}", samples_s=f"{rate:.0f}", stale_steps=stale_steps)
            if self.accuracy is not None:
                shown["rmse" if self.cfg.recommender else "acc"] = f"{self.accuracy:.3f}"
            self.bar.set_postfix(shown, refresh=False)
        elif step % self.cfg.log_every == 0 or step == self.total:
            log.info("rank %d: step %d/%d epoch %d loss %.4f versions %s %.1f samples/s, %d stale steps",
                     self.cfg.rank, step, self.total, epoch, loss, versions, rate, stale_steps)

    def evaluated(self, step: int, epoch: int, accuracy: float, end_of_epoch: bool) -> None:
        """``accuracy``: the test accuracy, or for a recommender dataset the test RMSE."""
        self.accuracy = accuracy
        where = f"epoch {epoch} done at step {step}" if end_of_epoch else f"step {step} (epoch {epoch})"
        log.info("rank %d: %s: test %s %.4f", self.cfg.rank, where, score_name(self.cfg)[1], accuracy)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._redirect.__exit__(None, None, None)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """(accuracy, mean loss) on a held-out set."""
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(x), 500):
        xb, yb = x[i : i + 500].to(device), y[i : i + 500].to(device)
        out = model(xb)
        loss += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    model.train()
    return correct / len(x), loss / len(x)


class Run:
    """One trainer's run: the model, its stepper, and what is measured along the way."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        torch.set_num_threads(cfg.threads or default_threads(cfg) or torch.get_num_threads())
        self.device = pick_device(cfg.device, local_rank(cfg))
        if self.device.type == "cuda":  # streams, synchronize() and allocations without a device go to this GPU
            torch.cuda.set_device(self.device)
        self.data = load_ratings_dataset(cfg.dataset) if cfg.recommender else load_dataset(cfg.dataset, cfg.model)
        self.spe = steps_per_epoch(len(self.data.x_train), cfg.num_trainers, cfg.batch_size)
        if self.spe == 0:
            raise ValueError(
                f"{len(self.data.x_train)} training samples cannot fill one global batch of {cfg.num_trainers} x "
                f"{cfg.batch_size}; lower --batch-size")
        self.total_steps = cfg.steps or cfg.epochs * self.spe  # --steps, when given, overrides --epochs
        self.model = build_run_model(cfg, self.data).to(self.device)
        self.step, self.epoch, self.stale_steps = 0, 0, 0
        self.versions: list[int] = []
        self.accuracy: float | None = None
        self.accuracy_step: int | None = None  # the step whose weights the accuracy is of
        self.losses: list[float] = []
        self.timing = dict(compute=0.0, push=0.0, pull=0.0, wait=0.0)
        self.clock = SteadyClock(warmup=min(WARMUP_STEPS, self.total_steps - 1))
        self.metrics = MetricsWriter(cfg.metrics_file, cfg.rank)
        self.board = ScalarLog(os.path.join(cfg.tensorboard, f"trainer{cfg.rank}") if cfg.tensorboard else "")
        self.staleness = 0  # summed over the logged steps' shards, for the mean staleness per push
        self.ps: Stepper | None = None
        self.t_start = 0.0

    def start(self) -> None:
        """Join the job (the shards, or a ps-bench baseline); a failure leaves nothing behind."""
        self.ps = make_stepper(self.cfg, self.model, self.total_steps)
        self.metrics.write("start", config={k: v for k, v in asdict(self.cfg).items() if k != "security"},
                           device=str(self.device), steps_per_epoch=self.spe, total_steps=self.total_steps,
                           params=self.ps.num_params, threads=torch.get_num_threads())
        log.info("rank %d: %s on %s, %d steps (%d per epoch), %d parameters, %s, %d torch threads", self.cfg.rank,
                 self.cfg.model, self.device, self.total_steps, self.spe, self.ps.num_params, self.ps.describe,
                 torch.get_num_threads())
        self.t_start = time.perf_counter()

    def train_step(self, idx: torch.Tensor) -> float:
        """Forward, backward and the exchange with the shards for one local batch; returns the loss."""
        cfg = self.cfg
        xb, yb = self.data.x_train[idx].to(self.device), self.data.y_train[idx].to(self.device)
        t0 = time.perf_counter()
        self.ps.prepare_step(len(idx))
        loss = self.forward_backward(xb, yb)
        if cfg.step_delay:
            time.sleep(cfg.step_delay)  # simulated slow compute, not synchronisation
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        forward_wait = self.ps.take_forward_wait()
        self.timing["compute"] += time.perf_counter() - t0 - forward_wait  # --pipeline: layers waiting for weights
        info = self.ps.step(num_samples=len(idx))
        self.timing["push"] += info.push_seconds
        self.timing["pull"] += info.pull_seconds
        self.timing["wait"] += info.wait_seconds
        self.stale_steps += info.stale > 0
        self.staleness = info.staleness
        self.step += 1
        self.versions = info.versions
        self.clock.after_step(self.step, self.timing)
        return loss.detach().item()

    def forward_backward(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        """The loss of one batch, backward done: cross-entropy, or for ratings MSE (L2 on the touched rows added
        to what is minimised, as in trainer.rectrain; the MSE alone is reported)."""
        if self.cfg.recommender:
            objective, loss = self.ps.forward_module.objective(xb, yb, REC_L2)
            objective.backward()
            return loss
        loss = F.cross_entropy(self.ps.forward_module(xb), yb)
        loss.backward()
        return loss

    def evaluate(self, **fields) -> float:
        """Evaluate the current weights (test accuracy, or test RMSE for ratings); the event's ``train_elapsed``
        is the time to them, evaluations left out."""
        t_eval = time.perf_counter()
        self.ps.flush()
        key, _ = score_name(self.cfg)
        if self.cfg.recommender:
            score = pairs_rmse(self.model, self.data.x_test.to(self.device), self.data.y_test.to(self.device))
            test_loss = score ** 2
        else:
            score, test_loss = evaluate(self.model, self.data.x_test, self.data.y_test, self.device)
        self.metrics.write("eval", step=self.step, epoch=self.epoch, **fields, **{key: score},
                           test_loss=test_loss, elapsed=time.perf_counter() - self.t_start,
                           train_elapsed=t_eval - self.t_start - self.clock.eval_seconds)
        self.clock.eval_seconds += time.perf_counter() - t_eval
        self.accuracy, self.accuracy_step = score, self.step
        self.board.add(self.step, {f"test/{key.removeprefix('test_')}": score, "test/loss": test_loss})
        return score

    def save(self) -> None:
        """Rank 0 writes the model (atomically) to --output."""
        if self.cfg.rank == 0 and self.cfg.output:
            self.ps.flush()
            save_model(self.model, self.cfg.output)

    def record_step(self, loss: float) -> None:
        cfg = self.cfg
        self.losses.append(loss)
        if self.step % cfg.log_every == 0 or self.step == self.total_steps:
            elapsed = time.perf_counter() - self.t_start
            self.board.add(self.step, {"train/loss": loss, "train/samples_per_s": self.step * cfg.batch_size / elapsed,
                                       "train/staleness": self.staleness, "train/stale_steps": self.stale_steps})
            self.metrics.write("step", step=self.step, epoch=self.epoch, loss=loss, versions=self.versions,
                               samples_per_sec=self.step * cfg.batch_size / elapsed, stale_steps=self.stale_steps,
                               stale_pushes=self.ps.counters.get("stale_pushes", 0), elapsed=elapsed,
                               push_bytes_sent=self.ps.counters.get("push_bytes_sent", 0),
                               push_bytes_dense=self.ps.counters.get("push_bytes_dense", 0),
                               **{f"{k}_seconds": v for k, v in self.timing.items()})
        if cfg.save_every and self.step % cfg.save_every == 0:
            self.save()

    def summary(self, stopped: str) -> dict:
        elapsed = time.perf_counter() - self.t_start
        counters = self.ps.counters
        tail = self.losses[-min(len(self.losses), self.spe):]
        # test_accuracy holds a ratings run's RMSE under its own name (test_rmse), accuracy then None
        scores = (dict(test_accuracy=None, test_rmse=self.accuracy, test_rmse_step=self.accuracy_step)
                  if self.cfg.recommender else dict(test_accuracy=self.accuracy, test_accuracy_step=self.accuracy_step))
        return dict(
            steps=self.step, epochs=self.epoch, seconds=elapsed,
            samples_per_sec=self.step * self.cfg.batch_size / elapsed if elapsed > 0 else 0.0,
            **scores, final_loss=sum(tail) / len(tail) if tail else None,
            stale_steps=self.stale_steps, stale_pushes=counters.get("stale_pushes", 0),
            retries=counters.get("retries", 0), duplicate_pushes=counters.get("duplicate_pushes", 0),
            reconnects=counters.get("reconnects", 0), steps_lost=counters.get("steps_lost", 0),
            steps_failed=counters.get("steps_failed", 0), connect_retries=counters.get("connect_retries", 0),
            heartbeat_failures=counters.get("heartbeat_failures", 0),
            compute_seconds=self.timing["compute"], push_seconds=self.timing["push"],
            pull_seconds=self.timing["pull"], wait_seconds=self.timing["wait"],
            **self.clock.summary(self.cfg.batch_size),
            versions=list(self.ps.versions), bytes_out=counters.get("bytes_out", 0),
            bytes_in=counters.get("bytes_in", 0), push_bytes_sent=counters.get("push_bytes_sent", 0),
            push_bytes_dense=counters.get("push_bytes_dense", 0),
            **{k: v for k, v in counters.items() if k.startswith("rows_")},  # the tables' client (trainer.sparse_client)
            stopped=stopped or None,
        )


class StopRequest(threading.Event):
    """Set (from a signal handler) to end the run after the current step.

    ``steps_running`` tells the handler whether steps have begun: before that
    (loading, connecting) there is no step to finish and it interrupts at once.
    """

    steps_running = False


class Interrupted(BaseException):
    """Raised by a signal handler to abandon the run now; like KeyboardInterrupt, not an Exception."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum
        self.left = True  # set False when a shard that knew the trainer could not be told it left
        self.leave_outcome = "before it registered with any shard"  # what the shards answered (set by train())


def train(cfg: TrainConfig, stop: StopRequest | None = None) -> dict:
    """Train as one trainer of the job; returns the summary also written as the last metrics line.

    ``stop``, once set, ends the run after the current step ("stopped": "signal" in the summary).
    From the first step until the trainer has left, a signal only sets it: saving and leaving are not
    cut short.  Whatever happens, the trainer leaves the job before this returns or raises.
    """
    run = Run(cfg)
    stop = stop or StopRequest()
    try:
        run.start()
        stop.steps_running = True
        stopped = run_steps(run, stop)
        run.save()
        summary = run.summary(stopped)
        run.ps.close()
        run.metrics.write("done", **summary)
    except BaseException as e:
        if run.ps is not None:
            run.ps.close(leave=True, best_effort=True)
            if isinstance(e, Interrupted):
                e.left, e.leave_outcome = run.ps.left, run.ps.leave_outcome()
        raise
    finally:
        stop.steps_running = False
        run.metrics.close()
        run.board.close()
    log.info("rank %d: done%s: %d steps, test %s %s, %.1f samples/s, %d stale steps", cfg.rank,
             f" (stopped by {stopped})" if stopped else "", run.step, score_name(cfg)[1],
             "n/a" if run.accuracy is None else f"{run.accuracy:.4f}", summary["samples_per_sec"], run.stale_steps)
    return summary


def run_steps(run: Run, stop: StopRequest) -> str:
    """Epochs of steps until the total, or until ``stop`` is set; returns "" or what stopped the run."""
    cfg = run.cfg
    progress = Progress(cfg, run.total_steps)
    try:
        while run.step < run.total_steps:
            order = epoch_order(len(run.data.x_train), cfg.seed, run.epoch)
            epoch_losses = []
            for k in range(run.spe):
                if run.step >= run.total_steps:
                    break
                if stop.is_set():
                    return "signal"
                loss = run.train_step(local_batch_indices(order, k, cfg.rank, cfg.num_trainers, cfg.batch_size))
                epoch_losses.append(loss)
                run.record_step(loss)
                elapsed = time.perf_counter() - run.t_start
                progress.step(run.step, run.epoch, loss, run.step * cfg.batch_size / elapsed, run.stale_steps,
                              run.versions)
                last = k == run.spe - 1 or run.step == run.total_steps  # evaluated below in any case
                if cfg.eval_every and run.step % cfg.eval_every == 0 and not last:
                    progress.evaluated(run.step, run.epoch, run.evaluate(end_of_epoch=False), end_of_epoch=False)
            whole = len(epoch_losses) == run.spe  # --steps may end the run inside an epoch
            acc = run.evaluate(train_loss=sum(epoch_losses) / max(1, len(epoch_losses)), end_of_epoch=whole)
            progress.evaluated(run.step, run.epoch, acc, end_of_epoch=whole)
            run.epoch += whole
        return ""
    finally:
        progress.close()


def score_name(cfg: TrainConfig) -> tuple[str, str]:
    """(metrics key, words) of what evaluation measures: test accuracy, or test RMSE for a ratings dataset."""
    return ("test_rmse", "RMSE") if cfg.recommender else ("test_accuracy", "accuracy")


def build_run_model(cfg: TrainConfig, data) -> torch.nn.Module:
    """The model of --model; for a ratings dataset with its tables as trainer.embedding modules (their rows
    live on the shards, or in this process with --backend local)."""
    if not cfg.recommender:
        return build_model(cfg.model, data.shape, data.num_classes, seed=cfg.seed)
    from trainer.recmodels import sharded_factories

    factories = sharded_factories(cfg.sparse_optimizer_config(), seed=cfg.seed, admit_after=cfg.admit_after,
                                  max_rows=cfg.max_rows)
    return build_ratings_model(cfg.model, data, cfg.embedding_dim or 32, cfg.seed, **factories)


def lr_schedule(cfg: TrainConfig, total_steps: int) -> LrSchedule:
    """The schedule of the flags; a cosine without its length spans the run's versions after the warm-up
    (async mode takes a version per push: N per step).  Other kinds keep the default length, so trainers
    that run different numbers of steps (a restarted one) still agree on the job."""
    versions = total_steps * (cfg.num_trainers if cfg.mode == Mode.ASYNC else 1)
    cosine = cfg.lr_cosine_steps or (max(1, versions - cfg.warmup_steps) if cfg.lr_schedule == "cosine" else 1)
    return LrSchedule(kind=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                      warmup_start_factor=cfg.warmup_start_factor, step_size=cfg.lr_step_size, gamma=cfg.lr_gamma,
                      cosine_steps=cosine, min_lr=cfg.lr_min)


def mode_knobs(cfg: TrainConfig) -> dict:
    """The job spec's mode settings of ``cfg``, those of another mode left out (see ignored_flags)."""
    stale_timeout = cfg.mode == Mode.STALE_TIMEOUT
    return dict(mode=cfg.mode, num_trainers=cfg.num_trainers, wire_dtype=cfg.wire_dtype, job_id=cfg.job_id,
                max_staleness=cfg.max_staleness if cfg.mode == Mode.ASYNC else None,
                sync_timeout=cfg.sync_timeout if stale_timeout else 0.0,
                replicas_to_aggregate=cfg.replicas_to_aggregate if stale_timeout else 0,
                stale_policy=cfg.stale_policy if stale_timeout else "drop")


def check_job_settings(cfg: TrainConfig) -> None:
    """The job spec the shards will be sent, on a stand-in layout: its rules (ranges, combinations) refuse a
    bad setting here, before the data is loaded or anything is started (ps-cluster calls this too)."""
    JobSpec(num_shards=len(parse_addresses(cfg.ps)), total_params=1, fingerprint="0" * 16,
            tensors=(("check", (1,), "float32"),), optimizer=cfg.optimizer_config(), tables=rec_table_specs(cfg),
            lr_schedule=lr_schedule(cfg, total_steps=1), **{k: v for k, v in mode_knobs(cfg).items()})


def make_stepper(cfg: TrainConfig, model: torch.nn.Module, total_steps: int) -> Stepper:
    """What exchanges gradients: the parameter servers, or a ps-bench baseline."""
    optimizer = cfg.optimizer_config()
    schedule, clip = lr_schedule(cfg, total_steps), cfg.clip_grad_norm
    if cfg.backend == "ps":
        for note in ignored_flags(cfg):
            log.warning("rank %d: %s", cfg.rank, note)
        return connect(cfg.ps, model, rank=cfg.rank, optimizer=optimizer, **mode_knobs(cfg),
                       connect_timeout=cfg.connect_timeout, security=cfg.security, overlap=cfg.overlap,
                       push_during_backward=cfg.push_during_backward, retry_budget=cfg.retry_budget,
                       lr_schedule=schedule, clip_grad_norm=clip, compress=cfg.compress,
                       embedding_mode=cfg.embedding_mode, partition_bytes=cfg.partition_bytes,
                       pipeline=cfg.pipeline)
    from trainer.baselines import DDPStepper, LocalStepper, LocalTables

    if cfg.backend in ("ddp", "ddp-nccl"):
        return DDPStepper(model, optimizer, cfg.ps, cfg.rank, cfg.num_trainers, schedule, clip,
                          process_group="nccl" if cfg.backend == "ddp-nccl" else "gloo")
    if cfg.backend == "local":
        local = LocalStepper(model, optimizer, schedule, clip)
        return LocalTables(local, model) if cfg.recommender else local
    raise ValueError(f"unknown backend {cfg.backend!r}: choose ps, ddp or local")


def save_model(model: torch.nn.Module, path: str) -> None:
    """A plain state dict (parameters and buffers) that loads into the same model class; written atomically."""
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    Path(tmp).replace(path)
