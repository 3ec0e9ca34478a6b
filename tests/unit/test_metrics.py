"""Prometheus exposition of a shard: every sample names its shard (no network: the registry is rendered)."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from psserver.shard import Shard


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
