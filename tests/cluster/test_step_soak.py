"""Exactly once through the one-call step (issue 21): nothing applied twice, nothing acknowledged lost, when every
steady step is one Step/StepOnce call a shard carrying the dense slice AND a table's rows with the next batch's ids.

Two trainers (threads on the Python API, ``ps.prefetching`` looking one batch ahead) train a dense parameter and a
ShardedEmbeddingBag -- rows from zero, SGD with lr 1, integer-valued gradients, so every update is exact in fp32 --
through fault-injecting proxies (cut streams, lost replies, delays) to two real ps-server processes.  Each answer a
trainer takes in is recorded where it takes it in, whichever way it came (the Step call or the two-call path it
falls back to): the dense part at ``ShardClient._acknowledged``, a table part at ``ShardedRows.part_answered``.  At
the end each shard must hold exactly the SGD of what it acknowledged, and its applied counters must count each
acknowledged push once (test_accounting_soak does the same for dense-only and table-only models without Step).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch

from psserver.protocol.rows.init import Initializer
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.stubs import fetch_stat as stats
from tests.cluster.helpers import exact_sgd, pull_params, trainers_through_faults
from trainer import connect
from trainer.client import ShardedClient
from trainer.embedding import ShardedEmbeddingBag
from trainer.sparse_client import ShardedRows

P, ROW_IDS, DIM, BAGS, STEPS, TRAINERS = 4_000, 300, 8, 16, 30, 2
ACKED = {"applied", "accepted", "duplicate"}


class Clicks(torch.nn.Module):
    """A dense parameter beside a table, as the click model has: ``sum(emb(bags) * weights) + sum(w * c)``, so
    backward leaves the integers ``c`` in w's gradient and sums of the integer ``weights`` in the rows'."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(P))
        self.emb = ShardedEmbeddingBag("emb", DIM, mode="sum", initializer=Initializer(scale=0.0),
                                       optimizer=SparseOptimizerConfig("sgd", lr=1.0))

    def forward(self, ids, offsets, weights, c):
        return (self.emb(ids, offsets) * weights).sum() + (self.w * c).sum()


@dataclass(frozen=True)
class Answer:
    """One part's answer as the trainer took it in: which shard, the version it was pushed on, the outcome, and
    what it carried (the dense slice's gradient; a table part's ids and gradient rows)."""

    kind: str  # "dense" or "rows"
    shard: int
    base: int
    outcome: str
    grad: torch.Tensor
    ids: torch.Tensor | None = None


def batches(rank: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(300 + rank)
    return [(torch.randint(0, ROW_IDS, (BAGS * 3,), generator=gen), torch.arange(0, BAGS * 3, 3),
             torch.randint(-4, 5, (BAGS, DIM), generator=gen).float(),
             torch.randint(-8, 9, (P,), generator=gen).float()) for _ in range(STEPS)]


def record_answers(ps, answers: list, current: dict) -> None:
    """Wrap where ``ps`` takes each part's answer in (per instance: production code unchanged) to append an
    Answer; ``current["grad"]``: the dense gradient of the step under way (only one step is in flight)."""
    rows, part_answered = ps.rows, ps.rows.part_answered

    def rows_answered(s, part, reply, pulled, attempts):
        outcome = part_answered(s, part, reply, pulled, attempts)
        answers.append(Answer("rows", s.index, part.header.version, outcome, part.grads.clone(), part.ids.clone()))
        return outcome

    rows.part_answered = rows_answered
    for s in ps.client.shards:
        def dense_answered(outcome, version, staleness, base, nbytes, dense_bytes, s=s, take=s._acknowledged):
            out = take(outcome, version, staleness, base, nbytes, dense_bytes)
            start, end = ps.ranges[s.slot]
            answers.append(Answer("dense", s.index, base, out.outcome, current["grad"][start:end].clone()))
            return out

        s._acknowledged = dense_answered


def run_trainer(rank, addresses, mode, embedding_mode, records, errors):
    """Train ``Clicks`` with prefetch on; records: every Answer, then ("end", counters, job, ranges)."""
    try:
        model = Clicks()
        ps = connect(addresses, model, mode=mode, embedding_mode=embedding_mode, rank=rank, num_trainers=TRAINERS,
                     trainer_id=f"step-{rank}", optimizer={"name": "sgd", "lr": 1.0}, connect_timeout=60)
        current = {}
        record_answers(ps, records, current)
        for ids, offsets, weights, c in ps.prefetching(batches(rank), ids_of=lambda b: {"emb": b[0]}):
            model(ids, offsets, weights, c).backward()
            current["grad"] = model.w.grad.clone()
            ps.step(num_samples=1)
            ps.zero_grad()
        records.append(("end", dict(ps.counters), ps.job, list(ps.ranges)))
        ps.close(leave=rank != 0)  # rank 0 stays registered: the test reads the final weights and rows as it
    except BaseException as e:  # noqa: BLE001 -- reported by the test thread
        errors.append(e)


def acknowledged(records: list, kind: str, shard: int) -> list[Answer]:
    return [a for rr in records for a in rr[:-1] if a.kind == kind and a.shard == shard and a.outcome in ACKED]


def expected_dense(records: list, shard: int, mode: str) -> torch.Tensor:
    by_base = defaultdict(list)
    for a in acknowledged(records, "dense", shard):
        by_base[a.base].append(a.grad)
    return exact_sgd(by_base, mode)


def expected_rows(records: list, shard: int, mode: str) -> torch.Tensor:
    by_base = defaultdict(list)
    for a in acknowledged(records, "rows", shard):
        by_base[a.base].append(torch.zeros(ROW_IDS, DIM).index_add_(0, a.ids, a.grad))
    return exact_sgd(by_base, mode)


def final_rows(shards, job) -> torch.Tensor:
    reader = ShardedClient([s.address for s in shards], job, 0, "step-0")
    try:
        return ShardedRows(reader, job).pull("emb", torch.arange(ROW_IDS))
    finally:
        reader.close()


MODES = [("sync", ""), ("async", ""), ("sync", "async")]


@pytest.mark.parametrize("mode,embedding_mode", MODES, ids=["sync", "async", "sync-dense-async-rows"])
def test_one_call_steps_through_faults_apply_each_acknowledged_part_exactly_once(tmp_path, mode, embedding_mode):
    faults = dict(seeds=[3 + len(mode + embedding_mode), 13 + len(mode + embedding_mode)],
                  mean_bytes_between_faults=40_000, max_faults=15, max_delay=0.001)
    args = (mode, embedding_mode)
    with trainers_through_faults(tmp_path, run_trainer, args, TRAINERS, **faults) as (shards, records):
        counters = [rr[-1][1] for rr in records]
        job, ranges = records[0][-1][2], records[0][-1][3]
        # the one-call path was the one taken, and the faults made it retry
        assert all(c.get("step_calls", 0) >= STEPS for c in counters), counters
        assert sum(c.get("retries", 0) + c.get("rows_retries", 0) for c in counters) > 0
        rows_mode = embedding_mode or mode
        final = final_rows(shards, job)
        owner = shard_of(torch.arange(ROW_IDS), 2)
        for shard in range(2):
            dense = acknowledged(records, "dense", shard)
            table = acknowledged(records, "rows", shard)
            st = stats(shards[shard].address)
            assert st.counters["step_calls"] > 0
            # the dense slice: exact SGD of the acknowledged gradients, each applied once
            got = pull_params(shards[shard].address, "step-0", job.fingerprint)
            expected = expected_dense(records, shard, mode)
            assert got.numel() == ranges[shard][1] - ranges[shard][0]
            assert torch.equal(got, expected), (shard, (got - expected).abs().max())
            assert len(dense) == STEPS * TRAINERS  # every step's dense part acknowledged
            assert st.counters["pushes_applied"] == len(dense)
            assert st.version == (len(dense) if mode == "async" else len({a.base for a in dense}))
            # the rows: exact SGD of the acknowledged gradient rows, each push applied once
            mine = owner == shard
            want = expected_rows(records, shard, rows_mode)
            assert torch.equal(final[mine], want[mine]), (shard, (final[mine] - want[mine]).abs().max())
            assert len(table) == STEPS * TRAINERS
            assert st.counters["table.emb.pushes_applied"] == len(table)
            assert st.counters["table.emb.version"] == (
                len(table) if rows_mode == "async" else len({a.base for a in table}))
