"""ps-trainer's settings: the flags as a TrainConfig, each checked before anything starts, and what follows from
them (the learning rate, the schedule, the job's mode settings, the device, the torch threads).

Every problem is one sentence naming the flag and its value (config_problem), so ps-trainer and ps-cluster
refuse a bad run before the data is loaded or a shard is called.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from psserver.protocol.job import MODES, JobSpec, OptimizerConfig
from psserver.protocol.limits import MAX_PUSH_WINDOW
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rules import Mode
from psserver.protocol.schedules import LrSchedule
from psserver.protocol.security import parse_addresses
from trainer.running.choices import knobs_of_other_modes
from trainer.channels.client import LOOPBACK_REFUSED_SECONDS, on_loopback
from trainer.stepping.clipping import check_max_norm
from trainer.channels.compress import parse_compress
from trainer.workloads.recmodels import REC_MODELS
from trainer.workloads.rectrain import DATASET_MODELS, REC_DATASETS


@dataclass(frozen=True)
class TrainConfig:
    ps: str
    rank: int = 0
    num_trainers: int = 1
    mode: str = "sync"
    join: bool = False  # join a running elastic job: the job hands out the rank (docs/elastic.md)
    max_trainers: int = 0  # the job admits joiners up to this many members (0: none)
    lr_scaling: str = "none"  # the rate as the membership changes: none | linear
    hold_at_round: int = 0  # elastic: wait before this round until the membership changes (demos, tests)
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
    refused_timeout: float = LOOPBACK_REFUSED_SECONDS  # on loopback: give up on refused connections after this
    retry_budget: float = 60.0  # seconds a call to a shard is retried before the step fails
    overlap: bool = False  # async: pull the next weights while computing
    push_during_backward: bool = False  # push each shard's slice as soon as backward has produced it
    prefetch: bool = False  # tables: each batch's rows pulled one batch ahead (ps.prefetching, docs/prefetch.md)
    push_window: int = 1  # async: pushes in flight at once, acknowledged in the background (trainer.stepping.windowed)
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
    compress: str = ""  # "topk:RATIO": push the largest RATIO of each slice, the rest kept for later (trainer.channels.compress)
    partition_bytes: int = 0  # partitions of each shard's slice of at most this many bytes (0: one per shard)
    pipeline: bool = False  # the exchange runs behind the next forward, each layer waiting for its partitions
    # Recommender datasets (movielens100k, criteo-synth): the tables of --model mf / ncf / dlrm live on the shards.
    embedding_dim: int | None = None  # None: 32 (movielens100k), 16 (criteo-synth)
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


def window_checks(cfg) -> list[tuple[bool, str]]:
    """--push-window's refusals, one line each (the same rules as trainer.stepping.api.check_window)."""
    w, s = cfg.push_window, cfg.max_staleness
    clash = next((f for f, on in (("--overlap", cfg.overlap), ("--push-during-backward", cfg.push_during_backward),
                                  ("--compress", cfg.compress), ("--pipeline", cfg.pipeline)) if on), None)
    return [
        (1 <= w <= MAX_PUSH_WINDOW, f"--push-window ({w}) must be 1 to {MAX_PUSH_WINDOW} pushes in flight"),
        (w == 1 or Mode.ASYNC in (cfg.mode, cfg.embedding_mode),
         f"--push-window {w} applies to --mode async (or --embedding-mode async) only, not {cfg.mode}: a sync "
         "round waits for every trainer's push (use --push-window 1)"),
        (w == 1 or cfg.backend == "ps", f"--push-window applies to --backend ps only, not {cfg.backend}"),
        (w == 1 or clash is None, f"--push-window {w} does not go with {clash}: choose one"),
        (w == 1 or s is None or w <= s + 1, f"--push-window {w} with --max-staleness {s}: this trainer's own "
                                            f"pushes in flight alone make a push {w - 1} versions stale; use at "
                                            f"most --push-window {(s or 0) + 1}"),
    ]


def config_problem(cfg: TrainConfig) -> str:
    """The first thing wrong with ``cfg``, as one sentence naming the flag and its value; "" if nothing."""
    device = device_problem(cfg.device, torch.cuda.device_count())
    checks = [
        (cfg.num_trainers >= 1, f"--num-trainers ({cfg.num_trainers}) must be at least 1"),
        (cfg.join or 0 <= cfg.rank < cfg.num_trainers,
         f"--rank ({cfg.rank}) must be between 0 and --num-trainers - 1 ({cfg.num_trainers - 1})"),
        (cfg.hold_at_round >= 0, f"--hold-at-round ({cfg.hold_at_round}) must be zero (no hold) or more"),
        (not cfg.hold_at_round or cfg.join or cfg.max_trainers,
         f"--hold-at-round ({cfg.hold_at_round}) waits for a membership change: give --max-trainers K (an elastic job)"),
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
        (math.isfinite(cfg.refused_timeout) and cfg.refused_timeout > 0,
         f"--refused-timeout ({cfg.refused_timeout}) must be more than zero seconds"),
        (math.isfinite(cfg.retry_budget) and cfg.retry_budget >= 0,
         f"--retry-budget ({cfg.retry_budget}) must be zero or more seconds"),
        (cfg.mode in MODES, f"--mode ({cfg.mode}) must be one of {', '.join(MODES)}"),
        (cfg.mode == Mode.ASYNC or not cfg.overlap, f"--overlap applies to --mode async only, not {cfg.mode}"),
        *window_checks(cfg),
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
        (not cfg.recommender or cfg.model in DATASET_MODELS[cfg.dataset],
         f"--model {cfg.model} does not fit --dataset {cfg.dataset}: choose one of "
         f"{', '.join(DATASET_MODELS.get(cfg.dataset, REC_MODELS))}"),
        (cfg.recommender or cfg.model not in REC_MODELS,
         f"--model {cfg.model} is a recommender model: it needs --dataset "
         f"{' or '.join(d for d, models in DATASET_MODELS.items() if cfg.model in models)}, "
         f"not --dataset {cfg.dataset}"),
        (cfg.recommender or not given,
         f"--{given[0].replace('_', '-') if given else ''} applies to {rec} only, not --dataset {cfg.dataset}"),
        (not cfg.recommender or not cfg.backend.startswith("ddp"),
         f"--backend {cfg.backend} cannot train the tables of --dataset {cfg.dataset}"),
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
    """Knobs of another mode that were set (trainer.running.choices.knobs_of_other_modes, shared with ps-cluster)."""
    return knobs_of_other_modes(cfg)


def effective_lr(cfg: TrainConfig) -> float:
    """The learning rate to use: the one given, else 0.05 -- over N in async mode.

    In sync modes one step averages N*b samples; in async mode every push is a
    step on b samples, N times as many steps, so by the linear scaling rule the
    learning rate is divided by N (with momentum 0.9, async at the sync rate diverges), and by the push
    window W too (trainer.stepping.windowed: W-1 more versions of staleness per push).
    """
    if cfg.lr is not None:
        return cfg.lr
    if cfg.recommender:
        return 0.001  # Adam on the dense layers, as trainer.workloads.rectrain's baseline
    # --push-window W: each push may also be W-1 of this trainer's own pushes stale; at 0.05/N, W=4 diverged
    # (MLP, 2 x 2, momentum 0.9: loss 5e9 by step 100) and 0.05/(N*W) trained (test accuracy 0.87 at step 300)
    return 0.05 / (cfg.num_trainers * cfg.push_window) if cfg.mode == Mode.ASYNC else 0.05


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
    elif not cfg.backend.startswith("ddp") and on_loopback(parse_addresses(cfg.ps)):
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
    if on_loopback(parse_addresses(cfg.ps)):
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
                max_trainers=cfg.max_trainers, lr_scaling=cfg.lr_scaling,
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
