"""What a partitioned shard (psserver.partition.host) reports: counts summed over its partitions, states per partition."""

import torch

from psserver.partition.host import ShardHost
from tests.conftest import make_spec

SPEC = make_spec(partitions=2)  # one trainer, sync: every push is a round


def trained_host(directory, pushes: list[int]) -> ShardHost:
    """A host whose partition k took ``pushes[k]`` optimizer steps, then wrote its final checkpoints."""
    host = ShardHost(0, checkpoint_dir=str(directory), checkpoint_every=1000)
    for k, n in enumerate(pushes):
        part = host.part_for_register(k, 0, 0, SPEC)
        part.register(0, "t0", 0, SPEC)
        part.init(0, "t0", SPEC.fingerprint, torch.zeros(part.slice_length()))
        for v in range(n):
            part.push(0, "t0", SPEC.fingerprint, v, 1, torch.ones(part.slice_length()), sequence=v + 1)
    host.final_checkpoint()
    host.stop()
    return host


def test_each_restored_partition_reports_its_own_restored_version_and_every_partitions_steps_summed(tmp_path):
    trained_host(tmp_path, [3, 1])
    restored = ShardHost(0, checkpoint_dir=str(tmp_path), checkpoint_every=1000)
    try:
        assert restored.restore() == 3 and len(restored.parts) == 2
        snaps = [restored.snapshot(k) for k in range(2)]
        assert [s.version for s in snaps] == [3, 1]
        assert [s.counters["restored_version"] for s in snaps] == [3, 1]  # not 4, the sum
        assert snaps[0].counters["steps"] == snaps[1].counters["steps"] == 4  # counts: the shard's work, summed
    finally:
        restored.stop()
