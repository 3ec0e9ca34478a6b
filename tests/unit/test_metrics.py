"""Prometheus exposition of a shard: every sample names its shard (no network: the registry is rendered)."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from psserver.partition.shard import Shard


def test_every_exported_sample_carries_the_shard_label():
    shard = Shard(3)
    shard.metrics.staleness.observe(1)
    shard.metrics.apply_seconds.observe(0.001)
    shard.count("refused_INVALID_ARGUMENT")
    text = generate_latest(shard.metrics.registry).decode()
    samples = [(s.name, s.labels) for family in text_string_to_metric_families(text) for s in family.samples]
    names = {name for name, _ in samples}
    # The families that were once unlabelled are among those checked, and so is a refusal count.
    assert {"psgrpc_push_staleness_count", "psgrpc_apply_seconds_bucket", "psgrpc_refused_total",
            "psgrpc_version", "psgrpc_rounds_closed_total"} <= names
    unlabelled = [(name, labels) for name, labels in samples if labels.get("shard") != "3"]
    assert unlabelled == []


def test_a_primarys_replication_gauges_are_exported_only_where_the_shard_is_one():
    from psserver.partition.host import ShardHost

    def exported(gauges: dict) -> dict:
        host = ShardHost(2, gauges=lambda: dict(gauges))
        text = generate_latest(host.metrics.registry).decode()
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}

    values = exported({"replica_unreplicated": 1.0, "replica_shipments_behind": 0.0})
    assert values["psgrpc_replica_unreplicated"] == 1.0 and values["psgrpc_replica_shipments_behind"] == 0.0
    assert "psgrpc_replica_unreplicated" not in exported({})  # a shard without --etcd: no replica to speak of


def test_the_serving_gauges_and_counters_are_exported_from_the_hosts_snapshot():
    from psserver.partition.host import ShardHost

    gauges = {"loop_stall_seconds": 0.25, "loop_stall_worst_seconds": 1.5, "reply_bytes_held": 4096,
              "connections": 3, "watch_streams": 1}
    host = ShardHost(2, gauges=lambda: dict(gauges))
    host.head.count("reply_streams_cut")
    assert host.snapshot().counters["loop_stall_seconds"] == 0.25  # GetStats shows them with the counters
    text = generate_latest(host.metrics.registry).decode()
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert values["psgrpc_loop_stall_seconds"] == 0.25 and values["psgrpc_loop_stall_worst_seconds"] == 1.5
    assert values["psgrpc_reply_bytes_held"] == 4096 and values["psgrpc_connections"] == 3
    assert values["psgrpc_watch_streams"] == 1 and values["psgrpc_reply_streams_cut_total"] == 1
    assert values["psgrpc_refused_connections_total"] == 0
