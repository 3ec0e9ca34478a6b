"""`ps-server stats` and `ps-server health`: look at running shards from a shell."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.cli_support import EnvArgumentParser
from psserver.proto import ps_pb2 as _pb
from psserver.proto import ps_pb2_grpc as _grpc
from psserver.security import ClientSecurity, add_client_flags, client_security, parse_addresses

STAT_ROWS = [
    ("version", None), ("optimizer steps", "steps"), ("rounds: all arrived", "rounds_all_arrived"),
    ("rounds: quorum", "rounds_quorum"), ("rounds: timeout", "rounds_timeout"),
    ("pushes applied", "pushes_applied"), ("stale dropped", "stale_dropped"), ("stale scaled", "stale_scaled"),
    ("duplicates", "duplicates"), ("pulls", "pulls"), ("MB in", "bytes_in"), ("MB out", "bytes_out"),
]


def fetch_stat(address: str, timeout: float = 10.0, security: ClientSecurity = ClientSecurity()) -> _pb.StatsReply:
    """One shard's GetStats over a channel of its own (for tools and tests; trainers use their client)."""
    with security.channel(address) as ch:
        return _grpc.ParameterServerStub(ch).GetStats(_pb.StatsRequest(), timeout=timeout)


def fetch_stats(addresses: list[str], timeout: float, security: ClientSecurity = ClientSecurity()) -> list:
    return [fetch_stat(a, timeout, security) for a in addresses]


def format_stats(addresses: list[str], stats: list[_pb.StatsReply]) -> str:
    """A table: one column per shard."""
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
    refused = sorted({k for s in stats for k in s.counters if k.startswith("refused_")})
    for k in refused:
        rows.append([f"refused {k.removeprefix('refused_')}", *[str(int(s.counters.get(k, 0))) for s in stats]])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def stats_main(argv: list[str]) -> int:
    p = EnvArgumentParser(prog="ps-server stats", description="Print running shards' state as a table.")
    p.add_argument("--ps", required=True, help="shard addresses HOST:PORT[,HOST:PORT...]")
    p.add_argument("--timeout", type=float, default=10.0)
    add_client_flags(p)
    args = p.parse_args(argv)
    addresses = parse_addresses(args.ps)
    print(format_stats(addresses, fetch_stats(addresses, args.timeout, client_security(args))))
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
