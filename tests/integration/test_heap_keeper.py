"""A shard gives the allocator's free heap back past its bound (psserver.state.heap): the heap freed by a table
job's big calls shows in GetStats (memory_heap_free_bytes, memory_rss_bytes) and is trimmed, changing no state.

The shard runs as ps-server does (trainer.local.procs.start_shard: under the malloc tunables that keep up to 1 GiB of
freed heap for reuse), with --max-memory 512M: a heap bound of 16 MiB."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.table import TableSpec
from psserver.state.heap import heap_bound
from tests.conftest import RawShard, make_spec
from tests.helpers import wait_until
from trainer.local.procs import start_shard

FP = "f" * 16
DIM, IDS = 16, 100_000


def counters(raw) -> dict:
    return raw.stub.GetStats(pb.StatsRequest(), timeout=10).counters


def churn(raw, k: int) -> None:
    """A pull of IDS new rows, then a push of their gradient rows: ~25 MB of buffers made and freed."""
    ids = torch.arange(k * IDS, (k + 1) * IDS, dtype=torch.int64) * 7 + 3
    list(raw.stub.PullRows(pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=FP, table="t",
                                              ids=ids.numpy().tobytes()), timeout=30))
    h = pb.RowsHeader(rank=0, trainer_id="t0", fingerprint=FP, table="t", version=k, num_samples=1, sequence=k + 1,
                      dim=DIM, num_ids=IDS)
    reply = raw.stub.PushRows(iter([pb.RowsChunk(header=h, ids=ids.numpy().tobytes(),
                                                 rows=torch.full((IDS, DIM), 1e-3).numpy().tobytes())]), timeout=30)
    assert reply.outcome == pb.APPLIED


def test_free_heap_past_its_bound_is_given_back_and_the_state_is_unchanged(tmp_path):
    shard = start_shard(0, tmp_path / "shard0.log", extra_args=["--max-memory", "512M"])
    try:
        spec = make_spec(mode="async", tables=(TableSpec("t", DIM, optimizer=SparseOptimizerConfig("adagrad", lr=0.1),
                                                         seed=7, mode="async"),))
        with RawShard(SimpleNamespace(address=shard.address)) as raw:
            raw.register(spec=spec)
            first = counters(raw)
            assert first["memory_heap_bound_bytes"] == heap_bound(512 << 20) == 16 << 20
            assert first["memory_rss_bytes"] > 0 and first["memory_heap_trims"] == 0
            for k in range(8):
                churn(raw, k)
            digest = raw.digest()
            after = wait_until(lambda: (c := counters(raw))["memory_heap_trims"] >= 1 and c,
                               "the shard to trim its free heap")
            assert after["memory_heap_free_bytes"] > after["memory_heap_bound_bytes"]  # (what it read, and trimmed)
            assert after["memory_rss_bytes"] > after["memory_tables_bytes"] > 0
            assert raw.digest() == digest  # a trim changes nothing the shard holds
            churn(raw, 8)  # and it still serves
        assert "Traceback" not in (tmp_path / "shard0.log").read_text()
    finally:
        shard.terminate()
