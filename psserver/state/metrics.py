"""Prometheus metrics of a shard.

Counts live in one place, the shard's ``counters`` (also served by GetStats);
a custom collector turns a snapshot of them into Prometheus families at scrape
time, so nothing is counted twice -- and a scrape never takes the shard's lock.  Distributions (staleness, apply latency) are
prometheus-client histograms the shard observes directly.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from psserver.state import metrics_http
from psserver.state.stats import StatsSnapshot

ROUND_REASONS = ("all_arrived", "quorum", "timeout", "membership")
# GetStats' memory_<kind>_bytes: the budget's (psserver.partition.host), the process's (psserver.state.heap)
MEMORY_KINDS = ("budget", "reserved", "tables_budget", "tables", "pull_refs", "heap_free", "heap_bound", "rss")
PUSH_OUTCOMES = {"applied": "pushes_applied", "stale_dropped": "stale_dropped", "stale_scaled": "stale_scaled",
                 "duplicate": "duplicates"}


def board_scalars(s: StatsSnapshot) -> dict[str, float]:
    """The shard's TensorBoard scalars (``ps-server --tensorboard``), named as its Prometheus families are."""
    c = s.counters
    out = {"version": s.version, "optimizer_steps": c.get("steps", 0), "live_trainers": len(s.live_ranks)}
    out.update({f"pushes/{outcome}": c.get(key, 0) for outcome, key in PUSH_OUTCOMES.items()})
    out.update({f"rounds_closed/{r}": c.get(f"rounds_{r}", 0) for r in ROUND_REASONS})
    out["refused"] = sum(v for k, v in c.items() if k.startswith("refused_"))
    if s.job is not None:
        out["lr"] = s.job.optimizer.lr
    return out


class ShardMetrics:
    """The registry of one shard: histograms it observes, plus a collector over its counters.

    ``snapshot``: what the collector reads at each scrape (the shard's, or its host's summed over partitions).
    """

    def __init__(self, shard: int, snapshot: Callable[[], StatsSnapshot]) -> None:
        self.registry = CollectorRegistry()
        # Every family carries ``shard``, so metrics of several shards merged by one Prometheus stay apart.
        label = str(shard)
        self.staleness = Histogram(
            "psgrpc_push_staleness", "Versions between a gradient's base and the shard's version when it arrived.",
            labelnames=["shard"], buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32, 64), registry=self.registry,
        ).labels(label)
        self.apply_seconds = Histogram(
            "psgrpc_apply_seconds", "Seconds to apply one optimizer step on the shard's slice.",
            labelnames=["shard"], buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=self.registry,
        ).labels(label)
        self._collector = _CounterCollector(snapshot)
        self.registry.register(self._collector)

    def read_from(self, snapshot: Callable[[], StatsSnapshot]) -> None:
        """Scrape ``snapshot`` from now on: the process's newest layout's host (psserver.serving.server), whose stats GetStats
        serves too, not the first layout's, which a live re-shard leaves as a tombstone."""
        self._collector.snapshot = snapshot

    def serve(self, port: int, host: str, **bounds) -> int:
        """Expose /metrics over HTTP, bounded in connections and in each request's time (psserver.state.metrics_http); the bound port."""
        return metrics_http.serve(self.registry, port, host, **bounds)


class _CounterCollector:
    def __init__(self, snapshot: Callable[[], StatsSnapshot]):
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        c = s.counters
        label = [str(s.shard)]
        rounds = CounterMetricFamily("psgrpc_rounds_closed", "Rounds closed, by reason.", labels=["shard", "reason"])
        for r in ROUND_REASONS:
            rounds.add_metric(label + [r], c.get(f"rounds_{r}", 0))
        yield rounds
        pushes = CounterMetricFamily("psgrpc_pushes", "Gradient pushes handled, by outcome.", labels=["shard", "outcome"])
        for outcome, key in PUSH_OUTCOMES.items():
            pushes.add_metric(label + [outcome], c.get(key, 0))
        yield pushes
        refused = CounterMetricFamily("psgrpc_refused", "Requests refused, by gRPC status.", labels=["shard", "code"])
        for key, value in sorted(c.items()):
            if key.startswith("refused_"):
                refused.add_metric(label + [key.removeprefix("refused_")], value)
        yield refused
        traffic = CounterMetricFamily("psgrpc_bytes", "Tensor bytes received and sent.", labels=["shard", "direction"])
        traffic.add_metric(label + ["in"], c.get("bytes_in", 0))
        traffic.add_metric(label + ["out"], c.get("bytes_out", 0))
        yield traffic
        steps = CounterMetricFamily("psgrpc_optimizer_steps", "Optimizer steps applied.", labels=["shard"])
        steps.add_metric(label, c.get("steps", 0))
        yield steps
        version = GaugeMetricFamily("psgrpc_version", "Shard version (optimizer steps so far).", labels=["shard"])
        version.add_metric(label, s.version)
        yield version
        lr = GaugeMetricFamily("psgrpc_lr", "Learning rate of the next optimizer step (the job's schedule at the "
                               "shard's version).", labels=["shard"])
        lr.add_metric(label, s.lr)
        yield lr
        live = GaugeMetricFamily("psgrpc_live_trainers", "Trainers currently live.", labels=["shard"])
        live.add_metric(label, len(s.live_ranks))
        yield live
        memory = GaugeMetricFamily("psgrpc_memory_bytes", "The memory budget (--max-memory), what the job reserved "
                                   "of it, the tables' share, and the bytes the tables hold now (the shard's own "
                                   "accounting); the allocator's free heap, its bound and the process's RSS "
                                   "(docs/memory.md).", labels=["shard", "kind"])
        for kind in MEMORY_KINDS:
            memory.add_metric(label + [kind], c.get(f"memory_{kind}_bytes", 0))
        yield memory
        yield from _serving_families(s, label)
        yield from _table_families(s)


# The serving process's own numbers (psserver.serving.server.build_shard_process's gauges, the counters of
# psserver.serving.replies): psgrpc_<name>{shard}.
SERVING_GAUGES = {
    "loop_stall_seconds": "Longest stall of the event loop over the last 10 to 20 s (the watchdog: a tick every "
                          "50 ms, how late it ran); the health port turns NOT_SERVING past 10 s.",
    "loop_stall_worst_seconds": "Longest stall of the event loop since the shard started.",
    "reply_bytes_held": "Bytes held by reply streams not yet read (capped by --max-reply-bytes).",
    "request_bytes_held": "Bytes held by requests being received: Step parts, row pushes (capped by "
                          "--max-request-bytes).",
    "connections": "Connections with calls in flight (capped by --max-connections).",
    "watch_streams": "Health Watch streams open on the main port (capped by --max-watch-streams).",
}
# A hot standby's primary only (psserver.replication.shipper): exported where the shard is one.
REPLICA_GAUGES = {
    "replica_unreplicated": "1 while this primary answers without a standby in sync (none yet, or one lost and the "
                            "next catching up; --require-standby holds the replies instead), else 0.",
    "replica_shipments_behind": "Shipments begun that the standby has not acknowledged yet.",
}
SERVING_COUNTERS = {
    "reply_streams_cut": "Reply streams cut because their reader did not take them within --max-call-seconds.",
    "refused_connections": "Calls refused because --max-connections connections had calls in flight.",
    "refused_watch_streams": "Health Watch streams refused past --max-watch-streams.",
    "memory_heap_trims": "Times the allocator's free heap passed its bound and was given back.",
}


def _serving_families(s: StatsSnapshot, label: list[str]):
    c = s.counters
    for key, doc in SERVING_GAUGES.items():
        family = GaugeMetricFamily(f"psgrpc_{key}", doc, labels=["shard"])
        family.add_metric(label, c.get(key, 0))
        yield family
    for key, doc in REPLICA_GAUGES.items():
        if key in c:
            family = GaugeMetricFamily(f"psgrpc_{key}", doc, labels=["shard"])
            family.add_metric(label, c[key])
            yield family
    for key, doc in SERVING_COUNTERS.items():
        family = CounterMetricFamily(f"psgrpc_{key}", doc, labels=["shard"])
        family.add_metric(label, c.get(key, 0))
        yield family


# psgrpc_table_<name>{shard, table}: the per-table numbers of psserver.sparse.serving (GetStats names them
# table.<table>.<key>); counters only grow, gauges are the state now.
TABLE_COUNTERS = {
    "rows_created": ("rows_created", "Rows created (first use, or back after an eviction)."),
    "zero_reads": ("zero_reads", "Ids read as zeros because they were not admitted yet."),
    "dropped_grads": ("dropped_grads", "Gradient rows of ids not admitted yet, or new past the table's row "
                      "limit at a round's close: counted, not stored."),
    "rows_pulled": ("rows_pulled", "Rows sent by PullRows."),
    "rows_pushed": ("rows_pushed", "Gradient rows applied or added to a round."),
    "rows_stale": ("rows_stale", "Gradient rows dropped as too stale (async tables with max_staleness)."),
    "rounds": ("rounds", "Table rounds closed (sync and stale-timeout tables)."),
}
TABLE_GAUGES = {
    "live_rows": ("live_rows", "Rows stored now."),
    "version": ("version", "The table's version (its optimizer steps)."),
    "memory_bytes": ("memory_bytes", "Bytes the table holds (RowStore.memory total)."),
    "row_limit": ("row_limit", "Rows the table may hold: its max_rows, or its share of --max-memory (0: none)."),
}


def _table_families(s: StatsSnapshot):
    tables = s.tables or {}
    shard = str(s.shard)
    for metric, (key, doc) in TABLE_COUNTERS.items():
        family = CounterMetricFamily(f"psgrpc_table_{metric}", doc, labels=["shard", "table"])
        for name, stats in tables.items():
            family.add_metric([shard, name], stats.get(key, 0))
        yield family
    for metric, (key, doc) in TABLE_GAUGES.items():
        family = GaugeMetricFamily(f"psgrpc_table_{metric}", doc, labels=["shard", "table"])
        for name, stats in tables.items():
            family.add_metric([shard, name], stats.get(key, 0))
        yield family
    evictions = CounterMetricFamily("psgrpc_table_evictions", "Rows evicted, by reason.",
                                    labels=["shard", "table", "reason"])
    pushes = CounterMetricFamily("psgrpc_table_pushes", "Row pushes handled, by outcome.",
                                 labels=["shard", "table", "outcome"])
    traffic = CounterMetricFamily("psgrpc_table_bytes", "Id and row bytes received and sent.",
                                  labels=["shard", "table", "direction"])
    for name, stats in tables.items():
        for reason in ("lru", "stale"):
            evictions.add_metric([shard, name, reason], stats.get(f"evicted_{reason}", 0))
        for outcome in ("applied", "duplicate", "stale", "skipped"):
            pushes.add_metric([shard, name, outcome], stats.get(f"pushes_{outcome}", 0))
        traffic.add_metric([shard, name, "in"], stats.get("bytes_in", 0))
        traffic.add_metric([shard, name, "out"], stats.get("bytes_out", 0))
    yield evictions
    yield pushes
    yield traffic
