"""`ps-server`: serve one shard."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from psserver.common.cli_support import EnvArgumentParser, ensure_malloc_tunables, run_cli, setup_logging
from psserver.common.tboard import Sampler, ScalarLog
from psserver.protocol import admin_token
from psserver.protocol.limits import MAX_CALLS_PER_RANK
from psserver.protocol.security import ServerSecurity, read_token
from psserver.resharding.handoff.machine import DEFAULT_HANDOFF_TIMEOUT, handoff_timeout_error
from psserver.serving.ports import check_bindable

log = logging.getLogger("psserver")


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(
        prog="ps-server",
        description="Serve one shard of a psgrpc parameter server. "
        "Also: 'ps-server stats --ps HOST:PORT[,...]' prints shards' state; 'ps-server health --ps HOST:PORT' "
        "exits 0 iff the shard is SERVING; 'ps-server export --checkpoint-dir DIR[,...] --output model.pt' "
        "assembles a state dict from the shards' newest checkpoints; 'ps-server reshard --ps A,B --to A,B,C' "
        "moves a running sync job to more shards (docs/design/handoff-io.md).",
    )
    p.add_argument("--shard", type=int, required=True, help="index of the shard this process serves (0-based)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=int, default=0, help="port to listen on; 0 picks a free one")
    p.add_argument("--ready-file", help="write HOST:PORT here (atomically) once serving; '-' prints it on stdout")
    p.add_argument("--exit-when-done", action="store_true",
                   help="exit 0 once every trainer of the job has registered and left")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (0 picks one; unset: none)")
    p.add_argument("--tensorboard", default="", metavar="DIR",
                   help="write TensorBoard scalars (version, pushes by outcome, rounds closed by reason, lr) to "
                        "DIR/shard<i>, sampled from a thread of its own (unset: none)")
    p.add_argument("--tensorboard-every", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between TensorBoard samples")
    p.add_argument("--lease-timeout", type=float, default=5.0,
                   help="seconds of silence after which a trainer is dropped from the live set (0: never)")
    p.add_argument("--join-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="seconds a joiner's admission holds the next round for its commit before it is dropped "
                        "(0: 3 s, or --lease-timeout if shorter; docs/elastic.md)")
    p.add_argument("--handoff-timeout", type=float, default=DEFAULT_HANDOFF_TIMEOUT, metavar="SECONDS",
                   help="a live re-shard's hold: how long round R-1's replies and the block wait for DECIDE, and "
                        "a throttle or a hold for its forwards or commit (default %(default)g; raise it for a large "
                        "model, whose block can outlast 3 s; docs/design/handoff-io.md)")
    p.add_argument("--checkpoint-dir", default="", help="write checkpoints here (atomic, checksummed)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="versions between checkpoints")
    p.add_argument("--restore", action="store_true", help="resume from the newest valid checkpoint")
    p.add_argument("--restore-from", default="", metavar="DIR[,DIR...]",
                   help="re-shard on restore: read the old shards' checkpoint folders (all of them; one folder may "
                        "hold several shards) and serve this shard's part of the job on --num-shards shards "
                        "(docs/reshard.md)")
    p.add_argument("--num-shards", type=int, default=None,
                   help="with --restore-from: the job's new number of shards (default: as before)")
    p.add_argument("--partitions", type=int, default=None,
                   help="with --restore-from: partitions per shard from now on (default: as before)")
    p.add_argument("--partition-bytes", type=int, default=None, metavar="BYTES",
                   help="with --restore-from: partitions per shard as a trainer's --partition-bytes BYTES "
                        "computes them for the new shard count")
    p.add_argument("--tls-cert", default="", help="server certificate (PEM): turns on TLS")
    p.add_argument("--tls-key", default="", help="server private key (PEM)")
    p.add_argument("--tls-client-ca", default="", help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument("--auth-token-file", default="",
                   help="require this shared token from every caller but the health service (or set $PS_AUTH_TOKEN)")
    p.add_argument("--admin-token-file", default="",
                   help="the token a live re-shard's coordinator must send (or set $PS_ADMIN_TOKEN); without one the "
                        "shard makes its own and writes it where `ps-server reshard` on this host reads it, for this "
                        "user only (docs/security.md)")
    p.add_argument("--insecure", action="store_true",
                   help="serve beyond loopback with neither a token nor mutual TLS (refused without this flag; "
                        "see docs/security.md for what a stranger on the network can then do)")
    p.add_argument("--nonfinite", choices=("refuse", "skip"), default="refuse",
                   help="a gradient with NaN/Inf: refuse it (INVALID_ARGUMENT) or skip it (acknowledged, counted)")
    p.add_argument("--no-step-engine", dest="step_engine", action="store_false",
                   help="answer every StepOnce through the general path, none through the step engine (for "
                        "diagnosis: both give the same replies and state; docs/design/step-engine.md)")
    p.add_argument("--stream-idle-timeout", type=float, default=30.0,
                   help="end a stream that sends nothing for this many seconds")
    p.add_argument("--max-call-seconds", type=float, default=900.0,
                   help="no call lives longer than this, whatever deadline its client set; a reply stream counts "
                        "until its reader took the last chunk, and one still unread then is cut (DEADLINE_EXCEEDED)")
    p.add_argument("--max-pull-wait", type=float, default=600.0, help="longest a pull waits for a version")
    p.add_argument("--max-calls-per-peer", type=int, default=64,
                   help="data calls and health Watch streams in flight on one connection")
    p.add_argument("--max-connections", type=int, default=4096,
                   help="connections with calls in flight; a call from one more is refused RESOURCE_EXHAUSTED")
    p.add_argument("--max-watch-streams", type=int, default=64,
                   help="health Watch streams open at once on the main port (Check is not limited)")
    p.add_argument("--max-reply-bytes", type=int, default=1 << 30,
                   help="bytes unread replies (pulls being streamed) may hold on this shard; a pull past it is "
                        "refused RESOURCE_EXHAUSTED (one reply is always allowed)")
    p.add_argument("--max-request-bytes", type=int, default=2 << 30,
                   help="bytes requests being received (Step parts, row pushes) may hold on this shard; a call past "
                        "it is refused RESOURCE_EXHAUSTED before anything is allocated for it (one always goes on)")
    p.add_argument("--max-request-bytes-per-peer", type=int, default=1 << 30,
                   help="bytes requests being received may hold on one connection (one request is always allowed)")
    p.add_argument("--max-reply-bytes-per-peer", type=int, default=256 << 20,
                   help="bytes unread replies may hold on one connection (one reply is always allowed)")
    p.add_argument("--max-calls-per-rank", type=int, default=MAX_CALLS_PER_RANK,
                   help="data calls in flight naming one rank")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="intra-op threads for the shard's tensor work (0: torch's default); more pays only on a "
                        "host with idle cores and slices of millions of parameters")
    p.add_argument("--health-port", type=int, default=-1,
                   help="also answer gRPC health checks on this port, from a thread of its own: a liveness probe "
                        "there is not queued behind a saturated shard's calls (-1: off; 0: pick one)")
    p.add_argument("--receive-buffers", type=int, default=8,
                   help="slice-sized receive buffers; pushes beyond this wait their turn (bounds memory)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="bytes per streamed chunk")
    p.add_argument("--max-memory", default="", metavar="BYTES",
                   help="memory a job may hold on this shard, e.g. 8G or 512M: a Register whose dense slice, "
                        "optimizer state and tables do not fit is refused (RESOURCE_EXHAUSTED), and tables without "
                        "max_rows share what is left as row limits (unset: half the memory available at start-up, "
                        "cgroup limit included; see docs/memory.md)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    r = p.add_argument_group("hot standby (docs/standby.md)")
    r.add_argument("--etcd", default="", metavar="HOST:PORT",
                   help="run as one replica of the shard: etcd decides which replica is primary; the others are hot "
                        "standbys that take over, with nothing rolled back, when it dies (unset: no replication)")
    r.add_argument("--replica", default="", metavar="ID",
                   help="this replica's id among the shard's replicas (default: HOST:PORT)")
    r.add_argument("--job-name", default="default", help="the job's name in etcd's keys (one per job sharing etcd)")
    r.add_argument("--lease-seconds", type=int, default=2,
                   help="the primary's etcd lease: a standby takes over this long after the primary stops "
                        "renewing it (shorter: faster failover, more false ones on a loaded host)")
    r.add_argument("--replica-port", type=int, default=0,
                   help="the port a standby takes its primary's state on (0: pick one; published in etcd)")
    r.add_argument("--advertise-host", default="", metavar="HOST",
                   help="the host the other replicas reach this one at, published in etcd with its ports (default: "
                        "--host, or where --host is 0.0.0.0 or ::, this machine's address for its host name: a "
                        "container's or a pod's)")
    r.add_argument("--replica-lag", type=int, default=0, metavar="K",
                   help="answer trainers without waiting for the standby while it is at most K shipments (rounds) "
                        "behind: faster steps, and a failover may roll back up to K rounds (default 0: no loss)")
    r.add_argument("--require-standby", action="store_true",
                   help="never answer unreplicated: while no standby is in sync (none yet, or one lost and the "
                        "next catching up) replies wait for one instead of going out from the primary alone")
    r.add_argument("--ship-timeout", type=float, default=2.0,
                   help="seconds a standby may take to acknowledge a state before the primary drops it and "
                        "runs unreplicated")
    return p


def write_ready_file(path: str, address: str) -> None:
    if path == "-":
        print(address, flush=True)
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(address + "\n")
    os.replace(tmp, path)


def start_board(args, snapshot, scalar_log: ScalarLog) -> Sampler | None:
    """``--tensorboard DIR``: the shard's stats ``snapshot()`` (its newest layout's, as GetStats) into DIR/shard<i>
    every few seconds (step: seconds since the shard started, so a new job's version restarting at 0 draws no
    zigzag)."""
    if not scalar_log.enabled:
        return None
    from psserver.state.metrics import board_scalars

    t0 = time.monotonic()
    board = Sampler(scalar_log, lambda: (round(time.monotonic() - t0), board_scalars(snapshot())),
                    args.tensorboard_every, name=f"shard{args.shard}-tensorboard")
    log.info("shard %d: TensorBoard scalars every %g s in %s", args.shard, args.tensorboard_every,
             scalar_log.directory)
    return board


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.partitions is not None and args.partition_bytes is not None:
        parser.error("pass --partitions or --partition-bytes, not both")
    why = handoff_timeout_error(args.handoff_timeout)
    if why:
        parser.error(f"--handoff-timeout: {why}")
    if not args.tensorboard_every > 0:
        parser.error(f"--tensorboard-every must be more than 0 seconds (got {args.tensorboard_every})")
    from psserver.common.cli_support import parse_bytes

    try:
        max_memory = parse_bytes(args.max_memory) if args.max_memory else None
    except ValueError as e:
        parser.error(f"--max-memory: {e}")
    setup_logging(args.log_level)
    # Imported after parsing, not at the top: they import torch, which --help, a flag error, `ps-server stats`
    # and `health` need not wait for.
    from psserver.serving.server import ServerConfig, ShardServer
    from psserver.serving.service import ServiceLimits

    try:  # the operator's admin token, or one of the shard's own (psserver.protocol.admin_token)
        admin = admin_token.read_admin_token(args.admin_token_file)
    except ValueError as e:
        parser.error(str(e))
    made_admin_token = not admin
    admin = admin or admin_token.new_token()
    try:  # a value only the config checks (a --join-timeout out of range): one line and exit 2, as argparse's
        limits = ServiceLimits(max_pull_wait=args.max_pull_wait, stream_idle_timeout=args.stream_idle_timeout,
                               max_call_seconds=args.max_call_seconds, max_calls_per_peer=args.max_calls_per_peer,
                               max_calls_per_rank=args.max_calls_per_rank, receive_buffers=args.receive_buffers,
                               max_connections=args.max_connections, max_watch_streams=args.max_watch_streams,
                               max_reply_bytes=args.max_reply_bytes,
                               max_reply_bytes_per_peer=args.max_reply_bytes_per_peer, step_engine=args.step_engine,
                               max_request_bytes=args.max_request_bytes,
                               max_request_bytes_per_peer=args.max_request_bytes_per_peer)
        cfg = ServerConfig(shard=args.shard, host=args.host, port=args.port, limits=limits,
                           health_port=args.health_port, torch_threads=args.torch_threads,
                           chunk_bytes=args.chunk_bytes, lease_timeout=args.lease_timeout,
                           join_timeout=args.join_timeout, handoff_timeout=args.handoff_timeout,
                           checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                           restore=args.restore, nonfinite=args.nonfinite, max_memory=max_memory,
                           insecure=args.insecure,
                           restore_from=tuple(d.strip() for d in args.restore_from.split(",") if d.strip()),
                           num_shards=args.num_shards, partitions=args.partitions,
                           partition_bytes=args.partition_bytes,
                           security=ServerSecurity(args.tls_cert, args.tls_key, args.tls_client_ca,
                                                   read_token(args.auth_token_file), admin))
    except ValueError as e:
        parser.error(str(e))
    # Opened before the shard serves: a missing tensorboard package is a start-up error, not a late one.
    scalar_log = ScalarLog(os.path.join(args.tensorboard, f"shard{args.shard}") if args.tensorboard else "")
    if args.metrics_port:
        check_bindable(args.host, args.metrics_port, "--metrics-port")  # before the shard serves, not after
    replica = start_replica(parser, args, cfg, made_admin_token) if args.etcd else None  # (its flags checked before anything starts)
    stop = threading.Event()  # (before the ready file: a launcher that reads it may signal at once)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        if replica is not None:
            server = replica.start(stop, on_standby=lambda address: args.ready_file and write_ready_file(
                args.ready_file, address))
            if server is None:
                replica.stop()
                log.info("shard %d: standby stopped", cfg.shard)
                return 0
        else:
            server = ShardServer(cfg).start()
    except ValueError as e:
        from psserver.resharding import layout_restore
        from psserver.resharding.reshard import HINT, ReshardError

        if isinstance(e, layout_restore.RestoreError):
            print(f"ps-server: error: cannot restore: {e}\nhint: {layout_restore.HINT}", file=sys.stderr)
            return 1
        if not isinstance(e, ReshardError):
            raise
        print(f"ps-server: error: cannot re-shard: {e}\nhint: {HINT} (docs/reshard.md)", file=sys.stderr)
        return 1
    if args.metrics_port is not None:
        port = server.shard.metrics.serve(args.metrics_port, args.host)
        log.info("shard %d: Prometheus metrics on http://%s:%d/metrics", cfg.shard, args.host, port)
    board = start_board(args, lambda: server.layouts.current.snapshot(), scalar_log)
    if made_admin_token:  # (after the start: the file is named by the port the shard was given)
        where = admin_token.publish(admin, server.address)
        log.info("shard %d: its admin token for `ps-server reshard` is in %s (readable by this user only)",
                 cfg.shard, where)
    if args.ready_file and not (replica is not None and replica.standby is not None):  # (a standby wrote it)
        write_ready_file(args.ready_file, server.address)
    # A timed wait keeps the main thread responsive to signals; it also checks whether the job is done.
    while not stop.wait(0.5):
        if args.exit_when_done and server.shard.job_done():
            if replica is not None:
                replica.mark_done(server.shard.version)  # (its standby leaves too)
            break
    log.info("shard %d stopping (version %d): NOT_SERVING, draining calls%s", cfg.shard, server.shard.version,
             ", final checkpoint" if cfg.checkpoint_dir else "")
    server.stop()
    if replica is not None:
        replica.stop()  # the lease revoked: a standby takes over now, not a lease later
    if made_admin_token:
        admin_token.withdraw(admin, server.address)
    if board is not None:
        board.stop()  # a last sample: the files hold the final counts
    log.info("shard %d stopped", cfg.shard)
    return 0


def start_replica(parser, args, cfg, made_admin_token: bool):
    """``--etcd``: this process is one replica of its shard (psserver.replication.replica)."""
    if made_admin_token:
        parser.error(f"--etcd needs the operator's admin token (--admin-token-file or ${admin_token.ADMIN_TOKEN_ENV}), "
                     f"the same on every replica: a standby takes its primary's state only with it")
    if not args.port:
        parser.error("--etcd needs --port: trainers name every replica's port up front (--ps PRIMARY|STANDBY)")
    if cfg.restore_from or args.num_shards is not None:
        parser.error("--etcd with --restore-from is not supported: re-shard the checkpoints first, then start replicas")
    if args.lease_seconds < 1:
        parser.error(f"--lease-seconds must be 1 or more (got {args.lease_seconds}): etcd grants whole seconds")
    if args.replica_lag < 0:
        parser.error(f"--replica-lag must be 0 or more (got {args.replica_lag})")
    if not args.ship_timeout > 0:
        parser.error(f"--ship-timeout must be more than 0 seconds (got {args.ship_timeout})")
    if cfg.security.tls_cert and not cfg.security.tls_client_ca:
        parser.error("--etcd with --tls-cert needs --tls-client-ca: the replicas present their certificates to each "
                     "other on the replication port and verify them against it (sign every replica's with that CA)")
    from psserver.replication.replica import Replica, ReplicaOptions

    opts = ReplicaOptions(etcd=args.etcd, replica=args.replica or f"{args.host}:{args.port}", job=args.job_name,
                          lease_seconds=args.lease_seconds, replica_port=args.replica_port,
                          advertise_host=args.advertise_host,
                          ship_timeout=args.ship_timeout, lag=args.replica_lag, require=args.require_standby)
    try:
        return Replica(cfg, opts)
    except ValueError as e:
        parser.error(str(e))


def dispatch() -> int:
    """`ps-server [serve flags]`, or the tools `stats`, `health`, `export`, `reshard`."""
    from psserver import admin

    argv = sys.argv[1:]
    if argv[:1] == ["stats"]:
        return admin.stats_main(argv[1:])
    if argv[:1] == ["health"]:
        return admin.health_main(argv[1:])
    if argv[:1] == ["reshard"]:
        from psserver.resharding.reshard_cmd import reshard_main

        return reshard_main(argv[1:])
    if argv[:1] == ["export"]:
        from psserver.export import export_main

        return export_main(argv[1:])
    return main(argv)


def entrypoint() -> None:
    ensure_malloc_tunables("psserver.cli")
    run_cli("ps-server", dispatch)
