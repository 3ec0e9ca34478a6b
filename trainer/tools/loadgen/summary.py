"""From records to a row: windows, percentiles, outcomes, CPU and memory."""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import grpc
import grpc.aio

from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.stubs import method
from trainer.tools.loadgen.records import Probe, Step


def cpu_rate(before: list, after: list) -> float | None:
    pairs = [(a, b) for a, b in zip(before, after) if a and b]
    if not pairs:
        return None
    span = max(b["time"] - a["time"] for a, b in pairs)
    return sum(b["cpu"] - a["cpu"] for a, b in pairs) / span if span > 0 else None

def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) or None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 3)


def latency_stats(seconds: list[float]) -> dict:
    return dict(count=len(seconds), p50_ms=ms(percentile(seconds, 0.5)), p99_ms=ms(percentile(seconds, 0.99)),
                max_ms=ms(max(seconds) if seconds else None))


def health_stats(probes: list[Probe], t0: float = -math.inf, t1: float = math.inf) -> dict:
    """Latency of every probe sent in [t0, t1] (failures included: a refusal is an answer too) and failures by code."""
    inside = [p for p in probes if t0 <= p.sent_at <= t1]
    out = latency_stats([p.seconds for p in inside])
    out["failures"] = dict(Counter(p.code for p in inside if p.code != "OK"))
    return out


def slowest_probes(probes: list[Probe], marks: dict, k: int = 5) -> list[dict]:
    """The slowest probes, each placed in the phase it was sent in (did setup or the window cause it?)."""
    begins = {"go": "setup", "setup": "warm-up", "start": "measure", "stop": "drain", "end": "teardown"}
    order = sorted((t, begins[name]) for name, t in marks.items() if name in begins)
    out = []
    for t, seconds, code in sorted(probes, key=lambda p: -p.seconds)[:k]:
        phase = next((name for mt, name in reversed(order) if mt <= t), "setup")
        out.append(dict(ms=ms(seconds), code=code, phase=phase, at_s=round(t - order[0][0], 3) if order else None))
    return out


class Merged(NamedTuple):
    """Every client process's results, together."""

    records: list[Step]
    errors: list
    examples: dict  # status code -> the first message seen
    leave_errors: dict  # status code -> Leaves that failed with it
    crashes: list  # client processes' tracebacks and trainers that died of a bug


def merge_results(results: list[dict]) -> Merged:
    records = [r for res in results for r in res["records"]]
    errors = [e for res in results for e in res["errors"]]
    examples = {k: v for res in results for k, v in res["examples"].items()}
    leave = sum((Counter(res["leave_errors"]) for res in results), Counter())
    crashes = [c for res in results for c in res["crashes"]]
    return Merged(records, errors, examples, dict(leave), crashes)


def window_summary(records: list[Step], t0: float, t1: float) -> dict:
    """Steps that completed in [t0, t1]: count, distinct round versions reached, step latency."""
    inside = [r for r in records if t0 <= r.t1 <= t1]
    versions = [r.version for r in records if r.t1 <= t1]
    before = [r.version for r in records if r.t1 < t0]
    rounds = (max(versions) if versions else 0) - (max(before) if before else 0)
    span = t1 - t0
    return dict(seconds=round(span, 3), pushes=len(inside), rounds=rounds,
                pushes_per_s=round(len(inside) / span, 2) if span > 0 else None,
                rounds_per_s=round(rounds / span, 2) if span > 0 else None,
                step=latency_stats([r.t1 - r.t0 for r in inside]), outcomes=outcomes_of(inside))


def sync_window(records: list[Step], v_start: int, stop_at: int) -> dict:
    """The exact window of a sync run: pushes on base versions [v_start, stop_at), from round v_start opening
    (its first reply) to the last reply of round stop_at."""
    inside = [r for r in records if v_start <= r.base < stop_at]
    opened = [r.t1 for r in records if r.version >= v_start]
    t0 = min(opened) if opened else 0.0
    t1 = max((r.t1 for r in inside), default=t0)
    rounds, span = stop_at - v_start, t1 - t0
    return dict(seconds=round(span, 3), pushes=len(inside), rounds=rounds, t0=t0, t1=t1,
                pushes_per_s=round(len(inside) / span, 2) if span > 0 else None,
                rounds_per_s=round(rounds / span, 2) if span > 0 else None,
                step=latency_stats([r.t1 - r.t0 for r in inside]), outcomes=outcomes_of(inside))


def outcomes_of(records: list[Step]) -> dict:
    """What became of the pushes (the reply header's outcome): applied, accepted, stale, duplicate..."""
    return {_pb.PushOutcome.Name(k).lower(): v for k, v in sorted(Counter(r.outcome for r in records).items())}


def shard_stats(address: str, token: str) -> dict:
    """The shard's version and counters, or why not (a starved shard may refuse even this)."""
    md = (("authorization", f"Bearer {token}"),) if token else None
    try:
        with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            get = ch.unary_unary(method("GetStats"), _pb.StatsRequest.SerializeToString, _pb.StatsReply.FromString)
            s = get(_pb.StatsRequest(), timeout=10, metadata=md)
    except grpc.RpcError as e:
        return dict(error=f"{e.code().name}: {e.details()}")
    return dict(version=s.version, live=len(s.live_ranks), counters={k: round(v, 4) for k, v in s.counters.items()})
