"""A ps-server process with sparse tables: checkpoint, kill -9, --restore -- the same rows, and no push twice."""

from types import SimpleNamespace

import torch

from psserver.protocol.proto import ps_pb2 as pb
from tests.conftest import P, RawShard
from tests.helpers import wait_until
from tests.integration.test_sparse_rpc import job, pull_rows, push_rows, rows_chunks
from trainer.local.procs import start_shard

ONE_CHUNK = 1 << 20


def test_a_killed_shard_restored_from_its_checkpoint_serves_the_same_rows(tmp_path):
    args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    shard = start_shard(0, tmp_path / "shard0.log", extra_args=args)
    procs = [shard]
    try:
        spec = job(optimizer="adam")
        ids = [3, 1, 4, 15, 92]
        with RawShard(SimpleNamespace(address=shard.address)) as raw:
            raw.register(spec=spec)
            raw.init(torch.arange(P, dtype=torch.float32), chunk_bytes=ONE_CHUNK)
            for seq in (1, 2):
                grads = torch.randn(len(ids), 4, generator=torch.Generator().manual_seed(seq))
                assert push_rows(raw, rows_chunks(ids, grads, seq=seq, base=seq - 1)).outcome == pb.APPLIED
            raw.push(torch.ones(P), sequence=1, chunk_bytes=ONE_CHUNK)  # a dense step: checkpoint at version 1
            wait_until(lambda: raw.stub.GetStats(pb.StatsRequest(), timeout=10).counters["checkpoints_written"] >= 1,
                       "the checkpoint of version 1")
            version, rows = pull_rows(raw, ids)
            digest = raw.digest()
        assert version == 2
        shard.kill()
        restarted = start_shard(0, tmp_path / "shard0-restarted.log", port=int(shard.address.rsplit(":", 1)[1]),
                                extra_args=args + ["--restore"])
        procs.append(restarted)
        with RawShard(SimpleNamespace(address=restarted.address)) as raw:
            assert raw.digest() == digest  # rows, optimizer state, versions, acknowledgements
            restored_version, restored_rows = pull_rows(raw, ids)
            assert restored_version == version and torch.equal(restored_rows, rows)
            again = push_rows(raw, rows_chunks(ids, seq=2, base=1))  # a retry of the last push: not applied again
            assert (again.outcome, again.version) == (pb.DUPLICATE, 2)
            assert raw.stats().counters["table.emb.live_rows"] == len(ids)
    finally:
        for p in procs:
            p.kill()


def test_a_checkpoint_taken_as_a_round_closes_holds_the_step_not_the_round(tmp_path):
    """The dense round that a step closes is not also saved as open: --restore would apply it twice."""
    from psserver.state.checkpoint import Checkpointer
    from psserver.partition.shard import Shard
    from tests.conftest import make_spec

    shard = Shard(0, checkpointer=Checkpointer(tmp_path, 0, every=1))
    spec = make_spec()
    shard.register(0, "t0", 0, spec)
    shard.init(0, "t0", spec.fingerprint, torch.zeros(P))
    shard.push(0, "t0", spec.fingerprint, 0, 1, torch.ones(P), 1, True)  # closes round 0: checkpoint of version 1
    shard.final_checkpoint()
    saved, _ = Checkpointer(tmp_path, 0, every=1).load_latest()
    assert saved.version == 1 and saved.open_round is None
