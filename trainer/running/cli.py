"""`ps-trainer`: one trainer process of a psgrpc job."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from psserver.common.cli_support import EnvArgumentParser, ensure_malloc_tunables, run_cli, setup_logging
from psserver.protocol.schedules import KINDS
from psserver.protocol.security import add_client_flags, client_security
from trainer.running.choices import (
    CRITEO_BATCH,
    DATASETS,
    FLAG_HELP,
    LOOPBACK_REFUSED_SECONDS,
    MODELS,
    MODES,
    OPTIMIZERS,
    REC_BATCH,
    REC_DATASETS,
    REC_MODELS,
    SPARSE_OPTIMIZERS,
    STALE_POLICIES,
    WIRE_DTYPE_NAMES,
    rec_defaults,
)
from trainer.membership.torchrun import rank_and_world


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="ps-trainer", description="Train as one trainer of a psgrpc job.")
    p.add_argument("--ps", required=True, help="shard addresses in shard order: HOST:PORT[,HOST:PORT...]; a shard "
                   "with a hot standby is PRIMARY|STANDBY (docs/standby.md)")
    p.add_argument("--rank", type=int, default=None, help="this trainer's rank, 0..num-trainers-1 (default: $RANK "
                   "as torchrun sets it, else 0)")
    p.add_argument("--num-trainers", type=int, default=None,
                   help="trainers in the job (default: $WORLD_SIZE as torchrun sets it, else 1)")
    p.add_argument("--mode", choices=MODES, default="sync", help=FLAG_HELP["--mode"])
    p.add_argument("--join", action="store_true", help="join a running elastic job (no --rank: the job hands one "
                   "out; docs/elastic.md)")
    p.add_argument("--max-trainers", type=int, default=0, help="let up to this many trainers be members of the job "
                   "at once, joiners included (0: no joins); every trainer of the job gives the same value")
    p.add_argument("--lr-scaling", choices=("none", "linear"), default="none",
                   help="the rate as trainers join and leave: none keeps it, linear scales it with the members")
    p.add_argument("--hold-at-round", type=int, default=0, help="elastic jobs, for demos and tests: before round "
                   "N wait until the job's membership changes (a join or a leave) or this trainer is stopped")
    p.add_argument("--max-staleness", type=int, default=None, help="async: refuse gradients older than this")
    p.add_argument("--sync-timeout", type=float, default=0.0,
                   help="stale-timeout: seconds a round waits after its first gradient")
    p.add_argument("--replicas-to-aggregate", type=int, default=0, help=FLAG_HELP["--replicas-to-aggregate"])
    p.add_argument("--stale-policy", choices=STALE_POLICIES, default="drop", help=FLAG_HELP["--stale-policy"])
    p.add_argument("--model", choices=MODELS + REC_MODELS, default=None,
                   help="cnn (default), mlp, widemlp, resnet18; mf (the default) or ncf for --dataset movielens100k; "
                        "dlrm for --dataset criteo-synth")
    p.add_argument("--dataset", choices=DATASETS + REC_DATASETS, default="mnist5k",
                   help="the data to train on, read in the job's seeded order (default mnist5k)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"samples per trainer per step (default 32; {REC_BATCH} // num-trainers for movielens100k, "
                        f"{CRITEO_BATCH} // num-trainers for criteo-synth)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training data (default 1; --steps instead)")
    p.add_argument("--steps", type=int, default=0, help="run this many steps instead of --epochs")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="the dense parameters' optimizer on the shards (default sgd; adam for recommender datasets)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default 0.05; 0.05/num-trainers in async mode; 0.001 for recommender data)")
    p.add_argument("--momentum", type=float, default=0.9, help="sgd only")
    p.add_argument("--nesterov", action="store_true", help="sgd only")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="the dense optimizer's weight decay (added to the gradient for sgd and adam, decoupled for "
                        "adamw)")
    add_schedule_flags(p)
    add_table_flags(p)
    p.add_argument("--wire-dtype", choices=WIRE_DTYPE_NAMES, default="float32",
                   help="dtype of gradients and weights on the wire (shards keep fp32)")
    add_compress_flag(p)
    add_partition_flags(p)
    p.add_argument("--seed", type=int, default=0, help="model init and data order; the same on every trainer")
    p.add_argument("--job-id", default="",
                   help="names this run; every trainer of it passes the same (shards refuse another job's "
                        "trainers while one runs, and start a new job fresh once every trainer has left)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cuda or cuda:N (auto and cuda: GPU $LOCAL_RANK, else the rank on this host, "
                        "modulo the visible GPUs; auto falls back to the CPU)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: the cores divided by the trainers on this host -- $LOCAL_WORLD_SIZE, "
                        "or all trainers when every shard is on loopback; torch's default for a lone trainer)")
    p.add_argument("--output", default="", help="rank 0 writes the trained state dict here (also on SIGTERM)")
    p.add_argument("--save-every", type=int, default=0, help="rank 0 also writes --output every N steps")
    p.add_argument("--metrics-file", default="", help="append JSON-lines metrics here")
    p.add_argument("--tensorboard", default="",
                   help="write TensorBoard scalars (loss, accuracy, samples/s, staleness) to DIR/trainer<rank>")
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (simulate a straggler)")
    p.add_argument("--connect-timeout", type=float, default=120.0,
                   help="seconds to wait at start for the shards to answer and the other trainers to join")
    p.add_argument("--refused-timeout", type=float, default=LOOPBACK_REFUSED_SECONDS,
                   help="where every --ps address is on loopback: give up once they refused connections this many "
                        "seconds in a row (a wrong port), before --connect-timeout")
    p.add_argument("--retry-budget", type=float, default=60.0,
                   help="seconds a call to an unavailable shard is retried before the step fails")
    p.add_argument("--log-every", type=int, default=20, help="log and record metrics every N steps")
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps (0: each epoch only)")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    p.add_argument("--overlap", action="store_true",
                   help="async mode: pull the next weights in the background while computing")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="tables: pull each batch's rows one batch ahead (ps.prefetching, docs/prefetch.md): a step "
                        "is one Step call a shard; --no-prefetch pulls them in the forward instead (default: on)")
    p.add_argument("--push-during-backward", action="store_true",
                   help="any mode: push each shard its gradient slice as soon as backward has produced it")
    p.add_argument("--push-window", type=int, default=1, metavar="W",
                   help="async mode (or --embedding-mode async tables): up to W pushes in flight, acknowledged in the "
                        "background (1: each step waits "
                        "for its own; docs/push-window.md)")
    p.add_argument("--backend", choices=("ps", "ddp", "ddp-nccl", "local"), default="ps",
                   help="ps: the parameter servers; ddp (gloo) / ddp-nccl / local: the baselines ps-bench compares "
                        "against (ddp reads --ps as the process group's master HOST:PORT)")
    add_client_flags(p)
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p


SCHEDULE_FLAGS = ("lr_schedule", "warmup_steps", "warmup_start_factor", "lr_step_size", "lr_gamma",
                  "lr_cosine_steps", "lr_min", "clip_grad_norm")  # TrainConfig fields of the same names


def add_schedule_flags(p: EnvArgumentParser) -> None:
    """The learning-rate schedule and clipping flags, shared by ps-trainer and ps-cluster."""
    p.add_argument("--lr-schedule", choices=KINDS, default="constant",
                   help="the rate as the shards apply it, by version (async: one version per push)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up over the first N versions (0: none)")
    p.add_argument("--warmup-start-factor", type=float, default=0.1, help="the warm-up starts at lr times this")
    p.add_argument("--lr-step-size", type=int, default=1, help="step: multiply the rate by --lr-gamma every N versions")
    p.add_argument("--lr-gamma", type=float, default=0.1, help="step: the decay factor, in (0, 1]")
    p.add_argument("--lr-cosine-steps", type=int, default=0,
                   help="cosine: versions from --lr down to --lr-min (0: the rest of the run after the warm-up)")
    p.add_argument("--lr-min", type=float, default=0.0, help="cosine: the floor")
    p.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip each trainer's own gradient to this 2-norm before it is pushed (not the average "
                        "of the round, which is what clip_grad_norm_ clips under DDP)")


def add_compress_flag(p: EnvArgumentParser) -> None:
    """--compress, shared by ps-trainer and ps-cluster (checked by trainer.channels.compress.parse_compress)."""
    p.add_argument("--compress", default="", metavar="topk:RATIO[,warmup=STEPS]",
                   help="push each shard only the largest RATIO (0 < RATIO <= 1) of its gradient slice as "
                        "(index, value) pairs; what is not sent is kept and added to the next push (error "
                        "feedback); warmup=STEPS sends the first STEPS pushes dense. Default: dense")


def add_partition_flags(p: EnvArgumentParser) -> None:
    """--partition-bytes and --pipeline, shared by ps-trainer and ps-cluster (psserver.partition.host, trainer.stepping.pipeline)."""
    p.add_argument("--partition-bytes", type=int, default=0, metavar="BYTES",
                   help="cut each shard's slice into partitions of at most BYTES (e.g. 4194304), each with its own "
                        "round, pushed and pulled on its own (0: one per shard; every trainer must agree)")
    p.add_argument("--pipeline", action="store_true",
                   help="return from each step while its exchange goes on: the next forward waits, layer by "
                        "layer, only for the partitions holding that layer's parameters (sync stays exact)")


TABLE_FLAGS = ("embedding_dim", "sparse_optimizer", "sparse_lr", "embedding_mode", "admit_after", "max_rows")


def add_table_flags(p: EnvArgumentParser) -> None:
    """The embedding tables of --dataset movielens100k and criteo-synth (trainer.tables.embedding), shared by ps-trainer
    and ps-cluster.  Defaults are None so that only flags given are passed on (and refused with an image dataset)."""
    p.add_argument("--embedding-dim", type=int, default=None,
                   help="width of the rows (32 for movielens100k, 16 for criteo-synth)")
    p.add_argument("--sparse-optimizer", choices=SPARSE_OPTIMIZERS, default=None,
                   help="the tables' per-row optimizer on the shards (adam: torch's SparseAdam)")
    p.add_argument("--sparse-lr", type=float, default=None, help="the tables' learning rate (0.01)")
    p.add_argument("--embedding-mode", choices=MODES, default=None,
                   help="the tables' mode (default: --mode); --mode sync --embedding-mode async "
                        "gives async embeddings next to sync dense layers")
    p.add_argument("--admit-after", type=int, default=None,
                   help="store a row only after its id was seen more than N times (0)")
    p.add_argument("--max-rows", type=int, default=None,
                   help="live rows per table per shard; least recently used evicted past it")


def table_argv(args) -> list[str]:
    """The table flags as given, for ps-cluster to pass on to each ps-trainer."""
    return [a for name in TABLE_FLAGS if getattr(args, name) is not None
            for a in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def table_config(args) -> dict:
    """TrainConfig's table fields from the flags (None: TrainConfig's default)."""
    given = {name: getattr(args, name) for name in TABLE_FLAGS if getattr(args, name) is not None}
    return {"embedding_mode": "", "admit_after": 0, **given}


def schedule_argv(args) -> list[str]:
    """The flags of ``add_schedule_flags`` as given, for ps-cluster to pass on to each ps-trainer (which
    checks them with the trainer's own rules: cluster.check_trainer_flags, before any process starts)."""
    return [a for name in SCHEDULE_FLAGS if getattr(args, name) is not None
            for a in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def dataset_defaults(args) -> dict:
    """Model, batch size and dense optimizer when not given: a recommender dataset has its own (trainer.workloads.rectrain's,
    trainer.workloads.criteo's)."""
    rec = args.dataset in REC_DATASETS
    model, batch = rec_defaults(args.dataset, args.num_trainers) if rec else ("cnn", 32)
    return dict(model=args.model or model, optimizer=args.optimizer or ("adam" if rec else "sgd"),
                batch_size=batch if args.batch_size is None else args.batch_size)


def config_from_args(args, env: dict | None = None):
    """The run's TrainConfig; raises ValueError naming the first bad flag (nothing has started yet).  --rank and
    --num-trainers not given come from RANK and WORLD_SIZE in ``env`` (os.environ), as torchrun sets them."""
    if args.join and args.rank is not None:
        raise ValueError(f"--rank ({args.rank}) does not go with --join: the job hands a joiner the lowest free "
                         "rank (docs/elastic.md); drop --rank")
    rank, num_trainers = rank_and_world(args.rank, args.num_trainers, ("--rank", "--num-trainers"), env)
    args = argparse.Namespace(**{**vars(args), "rank": rank, "num_trainers": num_trainers})
    from trainer.running.config import TrainConfig  # torch: after the flags are checked

    return TrainConfig(
        ps=args.ps, rank=args.rank, num_trainers=args.num_trainers, mode=args.mode, join=args.join,
        max_trainers=args.max_trainers, lr_scaling=args.lr_scaling, hold_at_round=args.hold_at_round,
        dataset=args.dataset, epochs=args.epochs, steps=args.steps, **dataset_defaults(args),
        **table_config(args), lr=args.lr, momentum=args.momentum, nesterov=args.nesterov,
        weight_decay=args.weight_decay, seed=args.seed, device=args.device, output=args.output,
        metrics_file=args.metrics_file, max_staleness=args.max_staleness, sync_timeout=args.sync_timeout,
        replicas_to_aggregate=args.replicas_to_aggregate, stale_policy=args.stale_policy,
        wire_dtype=args.wire_dtype, step_delay=args.step_delay, threads=args.threads, log_every=args.log_every,
        eval_every=args.eval_every,
        progress=False if args.no_progress else None, connect_timeout=args.connect_timeout,
        refused_timeout=args.refused_timeout, security=client_security(args), backend=args.backend, overlap=args.overlap,
        push_during_backward=args.push_during_backward, prefetch=args.prefetch, push_window=args.push_window,
        job_id=args.job_id, save_every=args.save_every,
        retry_budget=args.retry_budget, tensorboard=args.tensorboard, compress=args.compress,
        partition_bytes=args.partition_bytes, pipeline=args.pipeline,
        **{name: getattr(args, name) for name in SCHEDULE_FLAGS},
    )


def install_signal_handlers(stop) -> None:
    """SIGTERM (what Kubernetes and ps-cluster send) and SIGINT: the first ends the run after the current
    step -- the trainer leaves, rank 0 writes --output, exit 0; a second, or one while still connecting,
    abandons at once (the trainer still leaves; exit 128 + the signal's number).  ``stop``: a StopRequest."""
    from trainer.running.stopping import Interrupted

    def handle(signum, frame):
        if stop.steps_running and not stop.is_set():
            stop.set()
            sys.stderr.write(f"ps-trainer: {signal.Signals(signum).name}: finishing the current step, then "
                             f"leaving the job (send it again to stop at once)\n")
            return
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    logging.getLogger("trainer.channels.client").setLevel(max(logging.getLogger().level, logging.INFO))
    cfg = config_from_args(args)
    from trainer.channels.client import JobEnded
    from trainer.running.loop import train  # torch: after the flags are checked
    from trainer.running.reporting import finite_json
    from trainer.running.stopping import Interrupted, StopRequest

    stop = StopRequest()
    install_signal_handlers(stop)
    try:
        summary = train(cfg, stop)
    except Interrupted as e:
        sys.stderr.write(f"ps-trainer: stopped by {signal.Signals(e.signum).name}; {e.leave_outcome}\n")
        return 128 + e.signum
    except JobEnded as e:  # a joiner after the job's end: nothing to do, not a failure (docs/elastic.md)
        print(f"ps-trainer: the job has ended; nothing to join: {e}", flush=True)
        return 0
    print(json.dumps(finite_json({"event": "done", "rank": cfg.rank, **summary}), allow_nan=False))
    return 0


def entrypoint() -> None:
    ensure_malloc_tunables("trainer.running.cli")
    run_cli("ps-trainer", main, skip_teardown=True)  # its work is done: no second spent freeing torch
