"""`ps-server stats` and `ps-server health`: look at running shards from a shell."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.common.cli_support import EnvArgumentParser
from psserver.common.logsafe import shorten
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.security import ClientSecurity, add_client_flags, client_security, parse_addresses
from psserver.protocol.stubs import STATS_CHANNEL_OPTIONS, stub

DETAILS_SHOWN = 200  # characters of gRPC's details shown for a shard that is down

STAT_ROWS = [
    ("version", None), ("optimizer steps", "steps"), ("rounds: all arrived", "rounds_all_arrived"),
    ("rounds: quorum", "rounds_quorum"), ("rounds: timeout", "rounds_timeout"),
    ("pushes applied", "pushes_applied"), ("stale dropped", "stale_dropped"), ("stale scaled", "stale_scaled"),
    ("duplicates", "duplicates"), ("pulls", "pulls"), ("MB in", "bytes_in"), ("MB out", "bytes_out"),
]


@dataclass(frozen=True)
class Down:
    """A shard that did not answer GetStats: its gRPC status code and what gRPC said."""

    code: str
    details: str


def fetch_stats(addresses: list[str], timeout: float,
                security: ClientSecurity = ClientSecurity()) -> list[_pb.StatsReply | Down]:
    """Every shard's GetStats at once, each under ``timeout``: a reply, or a Down for each that did not answer.

    Concurrent, so one dead or hung shard costs the deadline once, not once per shard after it.
    """
    with ExitStack() as stack:
        calls = []
        for address in addresses:
            channel = stack.enter_context(security.channel(address, options=STATS_CHANNEL_OPTIONS))
            calls.append(stub(channel).GetStats.future(_pb.StatsRequest(), timeout=timeout))
        results = []
        for call in calls:
            try:
                results.append(call.result())
            except grpc.RpcError as e:
                results.append(Down(e.code().name, e.details() or ""))
        return results


def format_stats(addresses: list[str], results: list[_pb.StatsReply | Down]) -> str:
    """A table with one column per shard that answered, then one DOWN line per shard that did not."""
    up = [(a, s) for a, s in zip(addresses, results) if not isinstance(s, Down)]
    lines = _table([a for a, _ in up], [s for _, s in up]) if up else ["no shard answered"]
    for i, (address, s) in enumerate(zip(addresses, results)):
        if isinstance(s, Down):
            details = f": {shorten(s.details, DETAILS_SHOWN)}" if s.details else ""
            lines.append(f"DOWN  shard {i} ({address}): {s.code}{details}")
    return "\n".join(lines)


def _table(addresses: list[str], stats: list[_pb.StatsReply]) -> list[str]:
    header = ["", *[f"shard {s.shard} ({a})" for a, s in zip(addresses, stats)]]
    rows = [["mode", *[s.mode or "(no job)" for s in stats]],
            ["slice", *[f"[{s.start}, {s.end})" for s in stats]],
            ["live ranks", *[",".join(map(str, s.live_ranks)) or "-" for s in stats]],
            ["next step's lr", *[f"{s.lr:.6g}" for s in stats]]]
    for label, key in STAT_ROWS:
        cells = []
        for s in stats:
            value = s.version if key is None else s.counters.get(key, 0)
            cells.append(f"{value / 1e6:.1f}" if key and key.startswith("bytes") else f"{int(value)}")
        rows.append([label, *cells])
    rows.extend(_table_rows(stats))
    refused = sorted({k for s in stats for k in s.counters if k.startswith("refused_")})
    for k in refused:
        rows.append([f"refused {k.removeprefix('refused_')}", *[str(int(s.counters.get(k, 0))) for s in stats]])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


TABLE_ROWS = [("version", "version"), ("live rows", "live_rows"), ("rows created", "rows_created"),
              ("zero reads", "zero_reads"), ("dropped grads", "dropped_grads"), ("evicted lru", "evicted_lru"),
              ("evicted stale", "evicted_stale"), ("pushes applied", "pushes_applied"),
              ("pushes duplicate", "pushes_duplicate"), ("pushes stale", "pushes_stale"),
              ("rows stale", "rows_stale"), ("MB in", "bytes_in"), ("MB out", "bytes_out"),
              ("memory MB", "memory_bytes")]


def _table_rows(stats: list[_pb.StatsReply]) -> list[list[str]]:
    """A block of rows per sparse table (GetStats counters ``table.<name>.<key>``), tables in name order."""
    names = sorted({k.removeprefix("table.").rsplit(".", 1)[0] for s in stats for k in s.counters
                    if k.startswith("table.") and k.count(".") >= 2})
    out = []
    for name in names:
        for label, key in TABLE_ROWS:
            cells = [s.counters.get(f"table.{name}.{key}", 0) for s in stats]
            shown = [f"{v / 1e6:.1f}" if key.startswith(("bytes", "memory")) else f"{int(v)}" for v in cells]
            out.append([f"table {name[:40]}: {label}", *shown])
    return out


STATS_EPILOG = """\
Shards are asked at once, each under --timeout; a shard that does not answer is listed as
DOWN with its address and gRPC status (UNAVAILABLE: nothing listens or it is unreachable;
DEADLINE_EXCEEDED: it did not answer in time). Exit status: 0 if at least one shard answered,
1 if none did, 2 for a mistake on the command line. With --watch the table is refreshed until
Ctrl-C, which exits 0."""


def stats_main(argv: list[str]) -> int:
    p = EnvArgumentParser(prog="ps-server stats", description="Print running shards' state as a table.",
                          epilog=STATS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ps", required=True, help="shard addresses HOST:PORT[,HOST:PORT...] in shard order")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds each shard has to answer")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (2 if not given) until Ctrl-C")
    add_client_flags(p)
    args = p.parse_args(argv)
    if not args.timeout > 0:
        p.error(f"--timeout must be more than 0 seconds (got {args.timeout})")
    if args.watch is not None and not args.watch > 0:
        p.error(f"--watch must be more than 0 seconds (got {args.watch})")
    addresses = parse_addresses(args.ps)
    security = client_security(args)
    if args.watch is None:
        return _print_stats(addresses, args.timeout, security)
    return _watch(addresses, args.timeout, security, args.watch)


def _print_stats(addresses: list[str], timeout: float, security: ClientSecurity, heading: str = "") -> int:
    results = fetch_stats(addresses, timeout, security)
    print(heading + format_stats(addresses, results), flush=True)
    return 0 if any(not isinstance(r, Down) for r in results) else 1


def _watch(addresses: list[str], timeout: float, security: ClientSecurity, every: float) -> int:
    """Refresh until Ctrl-C (exit 0); on a terminal each refresh replaces the last."""
    # A process started in the background inherits SIGINT ignored; watching is for a person to stop.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            heading = f"{clear}ps-server stats at {time.strftime('%H:%M:%S')} (every {every:g} s; Ctrl-C stops)\n"
            _print_stats(addresses, timeout, security, heading)
            time.sleep(every)
            if not clear:
                print(flush=True)
    except KeyboardInterrupt:
        return 0


def health_main(argv: list[str]) -> int:
    """Exit 0 iff the shard's standard health service answers SERVING (for container health checks)."""
    p = EnvArgumentParser(prog="ps-server health", description="Check a shard's gRPC health service.")
    p.add_argument("--ps", required=True, help="HOST:PORT of one shard")
    p.add_argument("--timeout", type=float, default=3.0)
    add_client_flags(p)
    args = p.parse_args(argv)
    with client_security(args).channel(args.ps) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.ps}: {e.code().name}")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.ps}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
