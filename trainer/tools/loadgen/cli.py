"""`ps-loadgen` itself: a run over every N, and its command line."""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import platform
import resource
import shlex
import signal
import sys
from pathlib import Path

import grpc
import grpc.aio

from psserver.common.cli_support import EnvArgumentParser, run_cli, setup_logging
from psserver.common.logsafe import counted
from psserver.protocol.job import MODES
from psserver.protocol.security import read_token
from trainer.tools.loadgen.config import DEFAULT_TRAINERS, LoadConfig
from trainer.tools.loadgen.measure import ShardUnderTest, add_rss_growth, measure, measure_stall
from trainer.tools.loadgen.prober import Prober
from trainer.tools.loadgen.report import markdown, plot

log = logging.getLogger("ps-loadgen")


def run(cfg: LoadConfig, trainers: list[int], out: Path, ps: str = "", server_args: list[str] | None = None,
        stall: tuple[int, int, int] | None = None, health_port: bool = False, health_address: str = "") -> dict:
    """Every N in turn (a fresh shard each, unless ``ps``), then the stall scenario; writes out/loadgen.*.

    ``health_port``: start each shard with ps-server --health-port on a free loopback port and probe that port
    too; ``health_address``: the same for the external shard ``ps``."""
    check_health_flags(ps, health_port, health_address)
    raise_fd_limit()
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds gRPC state
    out.mkdir(parents=True, exist_ok=True)
    result = dict(mode=cfg.mode, params=cfg.params, client_procs=cfg.client_procs,
                  window=f"{cfg.seconds:g} s" + (f" or {counted(cfg.rounds, 'round')}" if cfg.rounds else ""),
                  machine=f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}, "
                          f"gRPC {grpc.__version__}",
                  server_args=server_args or [], shard=ps or "started per N", config=dataclasses.asdict(cfg),
                  rows=[], stall=None)
    if health_port or health_address:
        result["health_port"] = health_address or "--health-port on a free loopback port per shard"
    result["config"]["token"] = "set" if cfg.token else ""
    prober = Prober(ctx, cfg)
    port_prober = Prober(ctx, cfg, "loadgen-port-prober") if health_port or health_address else None
    shard_kw = dict(health_port=health_port, health_address=health_address)
    try:
        for n in trainers:
            log.info("N = %d: starting", n)
            shard = ShardUnderTest(ps, out / "logs", server_args or [], f"{cfg.mode}-n{n}", **shard_kw)
            try:
                row = measure(ctx, cfg, shard, prober, n, port_prober)
            finally:
                code = shard.stop()
            row["shard"]["exit_code"] = code  # after SIGTERM; None: not started here
            result["rows"].append(row)
            log.info("N = %d: %s, %s, %s pushes/s, errors %s", n, row["status"], counted(row["rounds"], "round"),
                     row["pushes_per_s"], row["errors"] or "none")
        add_rss_growth(result["rows"])
        if stall:
            streams, connections, k = stall
            log.info("stall: %d silent streams beside %d sync trainers", streams, k)
            shard = ShardUnderTest(ps, out / "logs", server_args or [], f"stall-{streams}", **shard_kw)
            try:
                result["stall"] = measure_stall(ctx, cfg, shard, prober, k, streams, connections, port_prober)
            finally:
                shard.stop()
    finally:
        prober.close()
        if port_prober is not None:
            port_prober.close()
    (out / "loadgen.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "loadgen.md").write_text(markdown(result))
    if result["rows"]:
        plot(result["rows"], out / "loadgen.png")
    return result


def check_health_flags(ps: str, health_port: bool, health_address: str) -> None:
    """--health-port picks the port of a shard started here; a running shard's (--ps) must be given."""
    if health_port and ps:
        raise ValueError("--health-port cannot go with --ps: it picks the port of the shards it starts; "
                         "give the running shard's health port as --health-address HOST:PORT instead")
    if health_address and not ps:
        raise ValueError("--health-address is for a running shard (--ps HOST:PORT); "
                         "for the shards started here use --health-port")


def raise_fd_limit() -> None:
    """A thousand trainers need a thousand sockets here and in the shard (which inherits the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))

def build_parser(stall_only: bool = False) -> EnvArgumentParser:
    prog = "ps-loadgen stall" if stall_only else "ps-loadgen"
    p = EnvArgumentParser(prog=prog, description=(
        "Stall scenario: a sync job unloaded, then beside a stranger holding silent Push streams open."
        if stall_only else "Drive one shard with N simulated trainers per measurement and report how it scales. "
        "Also: 'ps-loadgen stall --streams K'."))
    if not stall_only:
        p.add_argument("--trainers", default=DEFAULT_TRAINERS, help="comma list of N, one measurement each")
        p.add_argument("--mode", choices=MODES, default="sync")
        p.add_argument("--stall", type=int, default=0, help="also run the stall scenario with this many streams")
    else:
        p.add_argument("--streams", type=int, default=64, help="silent Push streams the stranger holds open")
    p.add_argument("--stall-connections", type=int, default=0,
                   help="connections the stranger spreads its streams over (0: one per stream)")
    p.add_argument("--stall-trainers", type=int, default=2, help="trainers of the legitimate job in the stall scenario")
    p.add_argument("--ps", default="", help="HOST:PORT of a running shard (default: start a fresh one per N)")
    p.add_argument("--server-args", default="", help="extra ps-server flags for the shards started here")
    p.add_argument("--params", type=int, default=1000, help="parameters in the job (P)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured window per N")
    p.add_argument("--rounds", type=int, default=0, help="or end the window after this many rounds (0: --seconds)")
    p.add_argument("--warmup", type=int, default=3, help="rounds (async: pushes per trainer) before the window")
    p.add_argument("--deadline", type=float, default=120.0, help="hard limit in seconds per N, setup included")
    p.add_argument("--step-timeout", type=float, default=30.0, help="deadline of one PushPull, seconds")
    p.add_argument("--sync-timeout", type=float, default=0.5, help="stale-timeout mode: seconds a round waits")
    p.add_argument("--client-procs", type=int, default=1, help="client processes the trainers are spread over")
    p.add_argument("--health-interval", type=float, default=0.02, help="seconds between health probes")
    p.add_argument("--health-port", action="store_true",
                   help="start each shard with ps-server --health-port on a free loopback port and probe that port "
                        "too (a second prober, same interval), beside the main port")
    p.add_argument("--health-address", default="",
                   help="with --ps: HOST:PORT where that shard answers health checks from its own thread "
                        "(its --health-port); probed beside the main port")
    p.add_argument("--auth-token-file", default="", help="token the trainers send (or set $PS_AUTH_TOKEN)")
    p.add_argument("--out", default="bench-results/loadgen", help="folder for loadgen.json, .md, .png and logs")
    p.add_argument("--quick", action="store_true", help="for CI: N = 1,4 for 2 s each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    return p


def parse_trainers(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--trainers ({text!r}) must be a comma list of whole numbers, e.g. 1,4,16") from None
    if not values or min(values) < 1:
        raise ValueError(f"--trainers ({text!r}) must list at least one N, each at least 1")
    return values


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    stall_only = argv[:1] == ["stall"]
    args = build_parser(stall_only).parse_args(argv[1:] if stall_only else argv)
    setup_logging(args.log_level)
    mode = "sync" if stall_only else args.mode
    trainers = [] if stall_only else parse_trainers(args.trainers)
    seconds, deadline, warmup = args.seconds, args.deadline, args.warmup
    if args.quick:
        trainers = [] if stall_only else [1, 4]
        seconds, deadline, warmup = 2.0, min(deadline, 60.0), min(warmup, 2)
    check_health_flags(args.ps, args.health_port, args.health_address)
    if args.ps and len(trainers) > 1:
        log.warning("--ps: every N registers a new job with the same shard; a shard that keeps its first job "
                    "refuses the later ones (FAILED_PRECONDITION)")
    cfg = LoadConfig(mode=mode, params=args.params, seconds=seconds, rounds=args.rounds, warmup=warmup,
                     deadline=deadline, step_timeout=args.step_timeout, sync_timeout=args.sync_timeout,
                     client_procs=args.client_procs, health_interval=args.health_interval,
                     token=read_token(args.auth_token_file), seed=args.seed)
    streams = args.streams if stall_only else args.stall
    if streams < 0 or args.stall_trainers < 1 or args.stall_connections < 0:
        raise ValueError("--streams/--stall must be >= 0, --stall-trainers >= 1 and --stall-connections >= 0")
    stall = (streams, args.stall_connections or streams, args.stall_trainers) if streams else None
    if stall_only and not stall:
        raise ValueError("ps-loadgen stall needs --streams of at least 1")
    result = run(cfg, trainers, Path(args.out), ps=args.ps, server_args=shlex.split(args.server_args), stall=stall,
                 health_port=args.health_port, health_address=args.health_address)
    print(markdown(result), end="")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def entrypoint() -> None:
    signal.signal(signal.SIGTERM, _interrupt)  # unwinds like Ctrl-C: the shards and client processes are stopped
    run_cli("ps-loadgen", main)
