"""`ps-cluster`: the one-command local cluster (the main job).

Starts M ``ps-server`` and N ``ps-trainer`` processes on free loopback ports,
shows live progress from the trainers' metrics files, prints a summary, and
leaves a run folder: each process's log, the metrics files, summary.json and
the trained model.  Everything is torn down on exit or Ctrl-C; the exit code is
non-zero if any process failed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc

from psserver.common.cli_support import EnvArgumentParser, run_cli, setup_logging
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rules import Mode
from psserver.protocol.stubs import fetch_stat
from trainer.local import console
from trainer.local import elastic_cluster
from trainer.local import elastic_schedule
from trainer.local import reshard_cluster
from trainer.local import standby_cluster
from trainer.running.choices import (
    CRITEO_BATCH,
    DATASETS,
    FLAG_HELP,
    KNOB_DEFAULTS,
    MODELS,
    MODES,
    OPTIMIZERS,
    REC_BATCH,
    REC_DATASETS,
    REC_MODELS,
    STALE_POLICIES,
    knobs_of_other_modes,
    rec_defaults,
)
from trainer.running.cli import (
    add_compress_flag,
    add_partition_flags,
    add_schedule_flags,
    add_table_flags,
    schedule_argv,
    table_argv,
)
from trainer.local.procs import Proc, start_shards, start_trainer

log = logging.getLogger("ps-cluster")
DEFAULT_SYNC_TIMEOUT = 0.1  # stale-timeout: seconds a round waits unless --sync-timeout says otherwise


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="ps-cluster", description="Run a local psgrpc cluster: shards and trainers as processes.")
    p.add_argument("--shards", type=int, default=2, help="ps-server processes, one shard each (default 2)")
    p.add_argument("--trainers", type=int, default=2, help="ps-trainer processes, ranks 0..N-1 (default 2)")
    p.add_argument("--mode", choices=MODES, default="sync", help=FLAG_HELP["--mode"])
    p.add_argument("--model", choices=MODELS + REC_MODELS, default=None,
                   help="cnn (default), mlp, widemlp, resnet18; mf (the default) or ncf for --dataset movielens100k; "
                        "dlrm for --dataset criteo-synth")
    p.add_argument("--dataset", choices=DATASETS + REC_DATASETS, default="mnist5k",
                   help="the data every trainer reads, in its seeded order (default mnist5k)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training data (default 3; --steps instead)")
    p.add_argument("--steps", type=int, default=0, help="run this many steps instead of --epochs")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"per trainer (default 32; {REC_BATCH} // trainers for movielens100k, "
                        f"{CRITEO_BATCH} // trainers for criteo-synth)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="the dense parameters' optimizer (default sgd; adam for movielens100k)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default 0.05; 0.05/trainers in async mode)")
    add_schedule_flags(p)
    add_compress_flag(p)
    add_partition_flags(p)
    add_table_flags(p)
    p.add_argument("--sync-timeout", type=float, default=None,
                   help=f"stale-timeout: seconds a round waits (default {DEFAULT_SYNC_TIMEOUT})")
    p.add_argument("--replicas-to-aggregate", type=int, default=0, help=FLAG_HELP["--replicas-to-aggregate"])
    p.add_argument("--stale-policy", choices=STALE_POLICIES, default="drop", help=FLAG_HELP["--stale-policy"])
    p.add_argument("--max-staleness", type=int, default=None, help="async only")
    p.add_argument("--push-window", type=int, default=1, metavar="W",
                   help="async (or --embedding-mode async tables) only: each trainer keeps up to W pushes in flight (docs/push-window.md)")
    p.add_argument("--straggler-delay", type=float, default=0.0,
                   help="extra seconds per step for the last trainer, to show what stale-timeout buys")
    p.add_argument("--elastic", action="store_true",
                   help="sync: start --trainers, add one a third of the way through --steps, stop rank 1 two thirds "
                        "of the way; the summary shows the membership timeline (docs/elastic.md)")
    p.add_argument("--elastic-schedule", default="", metavar="join@ROUND[,join@ROUND...]",
                   help="sync or async: start --trainers and add one trainer at each ROUND of shard 0; the summary "
                        "shows each membership epoch's throughput against the data-parallel model (docs/elastic.md)")
    p.add_argument("--reshard", default="", metavar="M@ROUND[,M@ROUND...]",
                   help="sync, dense: start the extra shards empty and move the job onto the first M live when "
                        "shard 0 reaches ROUND, step after step (a smaller M drains the last shards, then stops "
                        "them); the summary shows each hand-off (docs/design/handoff-io.md)")
    p.add_argument("--standbys", type=int, default=0, metavar="N",
                   help="1: every shard gets a hot standby and an etcd decides which replica is primary; a killed "
                        "primary costs no step (docs/standby.md; default 0)")
    p.add_argument("--kill-primary", default="", metavar="SHARD@ROUND[,...]",
                   help="with --standbys 1: SIGKILL that shard's primary when its version reaches ROUND; the "
                        "summary's failovers say how long the shard took to go on")
    p.add_argument("--eval-every", type=int, default=20, help="rank 0 evaluates every N steps (for the plot)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order, the same on every trainer (default 0)")
    p.add_argument("--job-id", default="", help="names the run's job (default: a fresh id per run)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cuda or cuda:N; with auto or cuda each trainer takes its own GPU when several "
                        "are visible (LOCAL_RANK = its rank)")
    p.add_argument("--host", default="127.0.0.1", help="loopback address for the shards")
    p.add_argument("--run-dir", default="", help="folder for logs, metrics and the model (default runs/<time>-<mode>)")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (the processes' logs)")
    return p


@dataclass
class Progress:
    """Follows the trainers' JSON-lines metrics files as they grow."""

    paths: list[Path]

    def __post_init__(self):
        self._offsets = [0] * len(self.paths)
        self.latest: list[dict] = [{} for _ in self.paths]
        self.total_steps: list[int] = [0] * len(self.paths)

    def poll(self) -> list[dict]:
        new = []
        for i, path in enumerate(self.paths):
            if not path.exists():
                continue
            with open(path) as f:
                f.seek(self._offsets[i])
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            self._offsets[i] += len(complete.encode())
            for line in complete.splitlines():
                rec = json.loads(line)
                if rec["event"] == "start":
                    self.total_steps[i] = rec["total_steps"]
                if rec["event"] in ("step", "done", "eval"):
                    self.latest[i] = {**self.latest[i], **rec}
                new.append(rec)
        return new


def shard_stats(address: str) -> _pb.StatsReply | None:
    try:
        return fetch_stat(address)
    except grpc.RpcError as e:
        log.warning("could not read stats from %s: %s", address, e.details())
        return None


def trainer_args(args, rank: int, run: Path) -> list[str]:
    a = [
        "--num-trainers", str(args.trainers), "--mode", args.mode, "--dataset", args.dataset,
        "--epochs", str(args.epochs), "--steps", str(args.steps), "--seed", str(args.seed), "--device", args.device,
        "--metrics-file", str(run / f"trainer{rank}.jsonl"), "--no-progress", "--log-every", "5",
        "--threads", str(max(1, (os.cpu_count() or 1) // args.trainers)), "--job-id", args.job_id,
    ]
    for flag, value in (("--model", args.model), ("--batch-size", args.batch_size), ("--optimizer", args.optimizer),
                        ("--lr", args.lr)):
        if value is not None:  # else the trainer's default, which depends on the dataset
            a += [flag, str(value)]
    a += schedule_argv(args)
    if args.compress:
        a += ["--compress", args.compress]
    if args.partition_bytes:
        a += ["--partition-bytes", str(args.partition_bytes)]
    if args.pipeline:
        a += ["--pipeline"]
    if args.push_window != 1:
        a += ["--push-window", str(args.push_window)]
    a += table_argv(args)
    if args.mode == Mode.STALE_TIMEOUT:
        timeout = DEFAULT_SYNC_TIMEOUT if args.sync_timeout is None else args.sync_timeout
        a += ["--sync-timeout", str(timeout), "--replicas-to-aggregate", str(args.replicas_to_aggregate),
              "--stale-policy", args.stale_policy]
    if args.mode == Mode.ASYNC and args.max_staleness is not None:
        a += ["--max-staleness", str(args.max_staleness)]
    if rank == 0:
        a += ["--output", str(run / "model.pt"), "--eval-every", str(args.eval_every)]
    if args.straggler_delay and rank == args.trainers - 1:
        a += ["--step-delay", str(args.straggler_delay)]
    if getattr(args, "elastic", False):
        a += elastic_cluster.trainer_flags(args, rank)
    if getattr(args, "elastic_schedule", ""):
        a += elastic_schedule.trainer_flags(args, rank)  # its --threads, last, is the one taken
    if getattr(args, "reshard", ""):
        a += reshard_cluster.trainer_flags(args, rank)
    return a


def ignored_knobs(args) -> list[str]:
    """Knobs of another mode that were given: each named in a warning (as ps-trainer does), none passed on.
    --sync-timeout's default is None here (its value is chosen only for stale-timeout)."""
    return knobs_of_other_modes(args, dict(KNOB_DEFAULTS, sync_timeout=None))


def trainer_env(rank: int, trainers: int) -> dict:
    """Every trainer runs on this host: its local rank is its rank, so --device auto/cuda spreads the trainers
    over the visible GPUs (trainer.running.config.pick_device), as torchrun sets it."""
    return {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(trainers)}


def summarize(args, run: Path, progress: Progress, stats: list, codes: dict, wall: float) -> dict:
    done = [p for p in progress.latest if p.get("event") == "done"]
    counters: dict[str, float] = {}
    for s in stats:
        if s is not None:
            for k, v in s.counters.items():
                counters[k] = counters.get(k, 0) + v
    s0 = stats[0].counters if stats and stats[0] is not None else {}
    return dict(
        mode=args.mode, model=args.model, dataset=args.dataset, shards=args.shards, trainers=args.trainers,
        straggler_delay=args.straggler_delay, wall_seconds=wall,
        test_accuracy=progress.latest[0].get("test_accuracy") if progress.latest else None,
        # every trainer's final figure: in async and stale-timeout modes a straggler ends apart from rank 0
        test_accuracy_by_rank=[p.get("test_accuracy") for p in progress.latest],
        **({score_key(args.dataset): progress.latest[0].get(score_key(args.dataset)) if progress.latest else None}
           if args.dataset in REC_DATASETS else {}),
        samples_per_sec=sum(p.get("samples_per_sec", 0) for p in done),
        steps=[p.get("steps") for p in progress.latest],
        rounds=int(stats[0].version) if stats and stats[0] is not None else None,
        # async mode has no rounds: each push is its own step
        rounds_by_reason=None if args.mode == Mode.ASYNC else
        {r: int(s0.get(f"rounds_{r}", 0)) for r in ("all_arrived", "quorum", "timeout", "membership")},
        pushes_applied=int(counters.get("pushes_applied", 0)),
        stale_dropped=int(counters.get("stale_dropped", 0)), stale_scaled=int(counters.get("stale_scaled", 0)),
        duplicates=int(counters.get("duplicates", 0)),
        refused=int(sum(v for k, v in counters.items() if k.startswith("refused_"))),
        trainer_stale_pushes=sum(p.get("stale_pushes", 0) for p in done),
        trainer_stale_steps=sum(p.get("stale_steps", 0) for p in done),
        steps_lost=sum(p.get("steps_lost", 0) for p in done),
        push_bytes_sent=sum(p.get("push_bytes_sent", 0) for p in done),
        push_bytes_dense=sum(p.get("push_bytes_dense", 0) for p in done),  # what dense pushes would have sent
        table_bytes_pushed=sum(p.get("rows_bytes_pushed", 0) for p in done),  # the tables' rows (and their ids)
        table_bytes_pulled=sum(p.get("rows_bytes_pulled", 0) for p in done),
        stopped=sorted({p["stopped"] for p in done if p.get("stopped")}) or None,
        exit_codes=codes, run_dir=str(run),
        **({"membership": elastic_cluster.membership_rows(stats[0] if stats else None,
                                                          read_records(Path(run) / "trainer0.jsonl"),
                                                          args.steps, args.batch_size or 32)}
           if getattr(args, "elastic", False) else {}),
        **({"scaling": elastic_schedule.summarize(args, stats, Path(run), read_records,
                                                  getattr(args, "load", []), getattr(args, "cpu", []))}
           if getattr(args, "elastic_schedule", "") else {}),
        **({"reshard": reshard_cluster.last_with_shards(args.handoff, stats)}
           if getattr(args, "handoff", None) else {}),
    )


def read_records(path: Path) -> list[dict]:
    """A metrics file's complete JSON lines (none if it is missing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def score_key(dataset: str) -> str:
    """The metrics key of a recommender dataset's test score (trainer.running.reporting.score_name's, torch-free)."""
    return "test_logloss" if dataset == "criteo-synth" else "test_rmse"


def by_rank_row(s: dict) -> tuple:
    """A row with every trainer's final test accuracy when they differ (async, stale-timeout), else none."""
    accs = s.get("test_accuracy_by_rank") or []
    if len({a for a in accs}) <= 1:
        return ()
    return (("test accuracy (by rank)", ", ".join("n/a" if a is None else f"{a:.4f}" for a in accs)),)


def print_summary(s: dict) -> None:
    key = next((k for k in ("test_rmse", "test_logloss") if k in s), "test_accuracy")
    words = {"test_rmse": "test RMSE", "test_logloss": "test log-loss", "test_accuracy": "test accuracy"}[key]
    score = (f"{words} (rank 0)", "n/a" if s[key] is None else f"{s[key]:.4f}")
    rows = [
        ("mode", s["mode"]), ("model / data", f"{s['model']} / {s['dataset']}"),
        ("shards x trainers", f"{s['shards']} x {s['trainers']}"
                              + (" (+1 joined, rank 1 left)" if "membership" in s else "")
                              + (f" (+{len(elastic_schedule.parse(s['scaling']['schedule']))} joining)"
                                 if "scaling" in s else "")
                              + (f" (re-sharded live: {' -> '.join(str(n) for n in reshard_counts(s))} shards)"
                                 if "reshard" in s else "")
                              + (" (+ a hot standby each)" if "failovers" in s else "")),
        *((("stopped early by", ", ".join(s["stopped"])),) if s.get("stopped") else ()),
        score,
        *by_rank_row(s),
        ("samples/s (all trainers)", f"{s['samples_per_sec']:.1f}"),
        ("wall time", f"{s['wall_seconds']:.1f} s"),
        *((("versions (shard 0)", s["rounds"]), ("gradients applied (all shards)", s["pushes_applied"]))
          if s["rounds_by_reason"] is None else
          (("rounds (shard 0 version)", s["rounds"]),
           ("rounds closed by", ", ".join(f"{k} {v}" for k, v in s["rounds_by_reason"].items())))),
        ("stale dropped / scaled", f"{s['stale_dropped']} / {s['stale_scaled']} gradients "
                                   f"({s['trainer_stale_steps']} trainer steps had one)"),
        ("steps lost to restarts", s["steps_lost"]),
        ("bytes pushed / dense", f"{s['push_bytes_sent']:,} / {s['push_bytes_dense']:,}"),
        *((("table bytes pushed / pulled", f"{s['table_bytes_pushed']:,} / {s['table_bytes_pulled']:,}"),)
          if s.get("table_bytes_pushed") or s.get("table_bytes_pulled") else ()),
        ("duplicates / refused", f"{s['duplicates']} / {s['refused']}"),
        *((("membership epochs", len(s["membership"])), *elastic_cluster.summary_rows(s["membership"]))
          if "membership" in s else ()),
        *(elastic_schedule.summary_rows(s["scaling"]) if "scaling" in s else ()),
        *(reshard_cluster.steps_rows(s["reshard"]) if "reshard" in s else ()),
        *((("failovers", "; ".join(
            f"shard {f['shard']} at version {f['round']}: went on after "
            + (f"{f['seconds']:.2f} s, {f['steps_lost']} versions lost" if f["seconds"] is not None else "?")
            for f in s["failovers"]) or "none"),) if "failovers" in s else ()),
        ("run folder", s["run_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("\npsgrpc run summary")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def check_trainer_flags(args, run: Path) -> None:
    """Every trainer's flags validated as ps-trainer will, before any process starts (one-line error)."""
    from trainer.running.cli import build_parser as trainer_parser
    from trainer.running.cli import config_from_args

    placeholder = ",".join(f"{args.host}:1" for _ in range(args.shards))
    for rank in range(args.trainers):
        config_from_args(trainer_parser().parse_args(["--ps", placeholder, "--rank", str(rank),
                                                      *trainer_args(args, rank, run)]))
    if args.elastic:
        config_from_args(trainer_parser().parse_args(["--ps", placeholder, "--join",
                                                      *trainer_args(args, args.trainers, run)]))
    for rank in range(args.trainers, elastic_schedule.most_trainers(args) if args.elastic_schedule else 0):
        config_from_args(trainer_parser().parse_args(["--ps", placeholder, "--join", *trainer_args(args, rank, run)]))


def set_aside_old_metrics(run: Path) -> list[Path]:
    """A reused run folder's trainer metrics files, renamed ``trainerR.previous.jsonl``: trainers append, so this
    run's console and summary would otherwise start from the last run's records.  Returns the new names."""
    moved = []
    for f in sorted(run.glob("trainer*.jsonl")):
        if f.name.endswith(".previous.jsonl"):
            continue
        moved.append(f.replace(f.with_name(f.name[: -len(".jsonl")] + ".previous.jsonl")))
    return moved


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.job_id = args.job_id or f"cluster-{uuid.uuid4().hex[:12]}"
    args.model = args.model or (rec_defaults(args.dataset, 1)[0] if args.dataset in REC_DATASETS else "cnn")
    setup_logging(args.log_level)
    if args.shards < 1 or args.trainers < 1:
        raise ValueError(f"--shards ({args.shards}) and --trainers ({args.trainers}) must be at least 1")
    if not args.timeout > 0:
        raise ValueError(f"--timeout ({args.timeout}) must be more than zero seconds")
    if args.elastic_schedule:
        elastic_schedule.check(args)  # first: it names the scenario it does not go with
    if args.elastic:
        elastic_cluster.check(args)
    moves = reshard_cluster.check(args) if args.reshard else []
    kills = standby_cluster.check(args)
    grow_to = max([args.shards] + [m for m, _ in moves])
    run = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{args.mode}")
    check_trainer_flags(args, run)
    for note in ignored_knobs(args):
        log.warning("%s", note)
    run.mkdir(parents=True, exist_ok=True)
    for old in set_aside_old_metrics(run):
        log.warning("run folder %s was used before: its %s is now %s (trainers append to their metrics files, and "
                    "the console and summary read them from the start)", run, old.name.replace(".previous", ""),
                    old.name)
    shards: list[Proc] = []
    watched: list[Proc] = []  # the shards follow() stops the run for: --reshard takes the drained ones off
    trainers: list[Proc] = []
    scenario = None
    replicas = standby_cluster.StandbyCluster(run, args.shards, kills, args.host) if args.standbys else None
    t0 = time.monotonic()
    log.info("starting %s on %s (run folder %s) ...", plural(grow_to, "shard"), args.host, run)
    try:
        def up(s: Proc) -> None:
            log.info("%s up at %s after %.1f s", s.name, s.address, time.monotonic() - t0)

        if replicas is not None:  # every shard a primary and a standby (trainer.local.standby_cluster)
            ps = replicas.start(args.job_id, shards, watched, up)
            scenario = replicas
        else:
            shards += start_shards(grow_to, run, host=args.host, on_up=up)
            watched += shards
            ps = ",".join(s.address for s in shards[:args.shards])  # --reshard: the rest start empty
        log.info("%s up; starting %s (%s mode) with --ps %s", plural(grow_to, "shard"),
                 plural(args.trainers, "trainer"), args.mode, ps)
        for r in range(args.trainers):
            trainers.append(start_trainer(r, ps, run / f"trainer{r}.log", trainer_args(args, r, run),
                                          env=trainer_env(r, args.trainers)))
        ranks = elastic_schedule.most_trainers(args) if args.elastic_schedule else args.trainers + args.elastic
        progress = Progress([run / f"trainer{r}.jsonl" for r in range(ranks)])
        scenario = elastic_cluster.ElasticScenario(
            args, run, ps, trainers, trainer_args(args, args.trainers, run),
            trainer_env(args.trainers, ranks)) if args.elastic else elastic_schedule.ScheduleScenario(
            args, run, ps, trainers, shards, lambda r: trainer_args(args, r, run),
            lambda r: trainer_env(r, ranks)) if args.elastic_schedule else reshard_cluster.ReshardSteps(
            moves, args.shards, shards, watched, run) if args.reshard else scenario
        codes = follow(trainers, watched, progress, args.timeout, t0, scenario.poll if scenario else None)
        wall = time.monotonic() - t0
        if args.elastic_schedule:  # the load and the CPU samples of the run, for the summary
            args.load, args.cpu = scenario.load + [os.getloadavg()[0]], scenario.cpu
        if args.reshard:
            results = scenario.finish()
            codes.update({p.name: r[0] for p, r in zip(scenario.procs, results)})
            args.handoff = reshard_cluster.handoffs(results, read_records(run / "trainer0.jsonl"), moves,
                                                    args.shards)
        stats = ([shard_stats(a) for a in ps.split(",")] if replicas is not None else
                 [shard_stats(s.address) for s in watched])  # a drained shard was stopped: no stats
    finally:
        # Trainers first, all at once (each finishes its step and leaves), then the shards (final checkpoints);
        # a second Ctrl-C meanwhile kills what is left rather than leaving shards behind.
        try:
            terminate_all(trainers)
            terminate_all(shards)
            if replicas is not None:
                replicas.stop_etcd()
        finally:
            for p in trainers + shards + coordinators(scenario) + ([replicas.etcd] if replicas and replicas.etcd
                                                                   else []):
                p.kill()
    for s in shards:
        codes[s.name] = s.popen.returncode
    killed = replicas.killed() if replicas is not None else set()
    failed = [p for p in trainers + shards + coordinators(scenario) if p.popen.returncode != 0 and p.name not in killed]
    summary = summarize(args, run, progress, stats, codes, wall)
    if replicas is not None:
        summary["failovers"] = replicas.summary()
        def replicated(k: str) -> float:
            return sum(st.counters.get(f"replica_{k}", 0) for st in stats if st is not None)
        summary["replication"] = {**{k: int(replicated(k)) for k in ("shipments", "shipments_whole", "bytes",
                                                                     "reads_on_shipped", "standby_lost",
                                                                     "capture_failures")},
                                  **{k: round(replicated(k), 3) for k in ("capture_seconds", "ship_seconds")}}
        # (since each shard's last promotion; reads_on_shipped: pulls answered on a shipment begun before them)
    if not failed and args.dataset not in REC_DATASETS:  # trainer.local.plots draws accuracy, which ratings runs lack
        try:
            from trainer.local.plots import plot_runs

            summary["plot"] = str(plot_runs([run], run / "plot.png",
                                            f"psgrpc {args.mode}: {args.model or 'cnn'} on {args.dataset}"))
        except (ValueError, OSError) as e:
            log.warning("could not draw the plot: %s", e)
    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if failed:
        for p in failed:
            sys.stderr.write(f"\n{p.name} exited with {p.popen.returncode}; last lines of {p.log_path}:\n"
                             f"{p.log_tail()}\n")
        raise RuntimeError(f"{failed[0].name} failed (exit code {failed[0].popen.returncode}); "
                           f"logs and metrics are in {run}")
    missed = [f"{m}@{at}" for (m, at), h in zip(moves, getattr(args, "handoff", None) or []) if h["layout"] is None]
    if args.reshard and missed:
        raise RuntimeError(f"the job ended before step {missed[0]} of --reshard {args.reshard} was done; "
                           f"hint: smaller ROUNDs in --reshard, or more --steps")
    if replicas is not None and replicas.missed():
        raise RuntimeError(f"the job ended before --kill-primary {','.join(replicas.missed())} was done (a shard is "
                           f"killed again only once its restarted replica caught up); hint: more --steps")
    print_summary(summary)
    return 0


def coordinators(scenario) -> list[Proc]:
    """The ``--reshard`` coordinators started (none for another scenario)."""
    return list(getattr(scenario, "procs", []))


def reshard_counts(s: dict) -> list[int]:
    """The shard counts a re-sharded run went through (summary.json's ``reshard``, either shape)."""
    hs = reshard_cluster.as_steps(s["reshard"])
    return [s["shards"]] + [h.get("shards_after", len(h.get("shard_versions", []))) for h in hs]


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def terminate_all(procs: list[Proc], timeout: float = 30.0) -> None:
    """SIGTERM every process at once, then wait for each (SIGKILL past ``timeout``)."""
    for p in procs:
        p.signal(signal.SIGTERM)
    for p in procs:
        p.terminate(timeout, signalled=True)


class Console:
    """What ps-cluster shows while the trainers run: one status line per trainer, redrawn in place on a terminal,
    a compact line every few seconds otherwise, and each trainer's end-of-epoch evaluation; the per-step lines
    stay in the run folder's logs (trainer.local.console formats)."""

    def __init__(self, progress: Progress, tty: bool, stream=None, clock=time.monotonic,
                 every: float = console.COMPACT_EVERY):
        self.progress, self.tty, self.clock = progress, tty, clock
        self.t0 = clock()
        self.periodic = console.Periodic(every, self.t0)
        self.block = console.LiveBlock(stream or sys.stderr) if tty else None
        self._handlers: list[logging.Handler] = []

    def __enter__(self) -> "Console":
        if self.block is not None:  # log lines go above the block, never through it
            root = logging.getLogger()
            self._handlers = [h for h in root.handlers if isinstance(h, logging.StreamHandler)
                              and getattr(h, "stream", None) is self.block.stream]
            formatter = self._handlers[0].formatter if self._handlers else None
            for h in self._handlers:
                root.removeHandler(h)
            self._above = console.AboveBlock(self.block, formatter)
            root.addHandler(self._above)
        return self

    def __exit__(self, *exc) -> None:
        if self.block is not None:
            root = logging.getLogger()
            root.removeHandler(self._above)
            for h in self._handlers:
                root.addHandler(h)

    def record(self, rec: dict) -> None:
        line = console.epoch_line(rec)
        if line:
            log.info("%s", line)

    def refresh(self) -> None:
        lines = console.status_lines(self.progress.latest, self.progress.total_steps)
        if self.block is not None:
            self.block.update(lines)
        elif self.periodic.due(self.clock(), " | ".join(lines)):
            log.info("%s", console.compact_line(self.clock() - self.t0, lines))


def follow(trainers: list[Proc], shards: list[Proc], progress: Progress, timeout: float, t0: float,
           on_poll=None) -> dict:
    """Show progress until every trainer has exited; stop early if a process fails.  ``on_poll``: called at
    each refresh (``ps-cluster --elastic``'s scenario, which may add a trainer to ``trainers``)."""
    with Console(progress, sys.stderr.isatty()) as view:
        try:
            while any(t.alive() for t in trainers):
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"the run took longer than --timeout {timeout:.0f} s")
                if on_poll is not None:  # first: a death the scenario expects (a fenced replica) is not a failure
                    on_poll()
                dead = ([p for p in shards if not p.alive()]
                        + [p for p in trainers if not p.alive() and p.popen.returncode])
                if dead:
                    log.error("%s exited with %s; stopping the cluster", dead[0].name, dead[0].popen.returncode)
                    break
                for rec in progress.poll():
                    view.record(rec)
                view.refresh()
                time.sleep(0.2)  # refresh rate of the display
        finally:
            for rec in progress.poll():
                view.record(rec)
            view.refresh()
    return {t.name: (t.popen.poll() if t.popen.poll() is not None else -1) for t in trainers}


def entrypoint() -> None:
    run_cli("ps-cluster", main, skip_teardown=True)  # the summary is out: no second spent freeing torch
