"""Exactly once through the one-call step (issue 21): nothing applied twice, nothing acknowledged lost, when every
steady step is one Step/StepOnce call a shard carrying the dense slice AND a table's rows with the next batch's ids.

Two trainers (threads on the Python API, ``ps.prefetching`` looking one batch ahead) train a dense parameter and a
ShardedEmbeddingBag -- rows from zero, SGD with lr 1, integer-valued gradients, so every update is exact in fp32 --
through fault-injecting proxies (cut streams, lost replies, delays) to two real ps-server processes.  Each answer a
trainer takes in is recorded where it takes it in, whichever way it came (the Step call or the two-call path it
falls back to): the dense part at ``DenseCalls.acknowledged``, a table part at ``ShardedRows.part_answered``.  At
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
from psserver.state.checkpoint import list_checkpoints, load_newest
from tests.cluster.helpers import closed_rounds, exact_sgd, pull_params, restart_on_its_port, trainers_through_faults
from tests.helpers import wait_until
from trainer import connect
from trainer.channels.client import ShardedClient
from trainer.tables.embedding import ShardedEmbeddingBag
from trainer.tables.sparse_client import ShardedRows

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


@dataclass(frozen=True, eq=False)  # (compared by identity: it holds tensors)
class Answer:
    """One part's answer as the trainer took it in: which shard, the version it was pushed on, the outcome, and
    what it carried (the dense slice's gradient; a table part's ids and gradient rows)."""

    kind: str  # "dense" or "rows"
    rank: int
    shard: int
    base: int
    outcome: str
    grad: torch.Tensor
    ids: torch.Tensor | None = None
    rejoins: int = 0  # how many times this trainer had registered again with the shard when it took this in


def batches(rank: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(300 + rank)
    return [(torch.randint(0, ROW_IDS, (BAGS * 3,), generator=gen), torch.arange(0, BAGS * 3, 3),
             torch.randint(-4, 5, (BAGS, DIM), generator=gen).float(),
             torch.randint(-8, 9, (P,), generator=gen).float()) for _ in range(STEPS)]


def record_answers(ps, rank: int, answers: list, current: dict) -> dict:
    """Wrap where ``ps`` takes each part's answer in, and its re-registration with a restarted shard (per
    instance: production code unchanged), to append an Answer; ``current["grad"]``: the dense gradient of the step
    under way (only one step is in flight).  Returns the re-registrations by shard, as they grow."""
    pushes, rejoining = ps.rows.pushes, ps.session.rejoins
    part_answered, register_again = pushes.part_answered, rejoining.register_again
    rejoins = defaultdict(int)

    def rows_answered(s, part, reply, pulled, attempts):
        outcome = part_answered(s, part, reply, pulled, attempts)
        answers.append(Answer("rows", rank, s.index, part.header.version, outcome, part.grads.clone(),
                              part.ids.clone(), rejoins[s.index]))
        return outcome

    def counted(s, cause):
        rejoins[s.index] += 1
        register_again(s, cause)

    pushes.part_answered, rejoining.register_again = rows_answered, counted
    for s in ps.client.shards:
        def dense_answered(outcome, version, staleness, base, nbytes, dense_bytes, s=s, take=s.dense.acknowledged):
            out = take(outcome, version, staleness, base, nbytes, dense_bytes)
            start, end = ps.ranges[s.slot]
            answers.append(Answer("dense", rank, s.index, base, out.outcome, current["grad"][start:end].clone(),
                                  rejoins=rejoins[s.index]))
            return out

        s.dense.acknowledged = dense_answered
    return rejoins


def run_trainer(rank, addresses, mode, embedding_mode, crash, records, errors):
    """Train ``Clicks`` with prefetch on; records: every Answer, then ("end", counters, job, ranges, rejoins).
    ``crash(step)``: run by rank 0 before each step (the restore test kills and restarts a shard there)."""
    try:
        model = Clicks()
        ps = connect(addresses, model, mode=mode, embedding_mode=embedding_mode, rank=rank, num_trainers=TRAINERS,
                     trainer_id=f"step-{rank}", optimizer={"name": "sgd", "lr": 1.0}, connect_timeout=60)
        current = {}
        rejoins = record_answers(ps, rank, records, current)
        for k, (ids, offsets, weights, c) in enumerate(ps.prefetching(batches(rank), ids_of=lambda b: {"emb": b[0]})):
            if crash is not None and rank == 0:
                crash(k)
            model(ids, offsets, weights, c).backward()
            current["grad"] = model.w.grad.clone()
            ps.step(num_samples=1)
            ps.zero_grad()
        records.append(("end", dict(ps.counters), ps.job, list(ps.ranges), dict(rejoins)))
        ps.close(leave=rank != 0)  # rank 0 stays registered: the test reads the final weights and rows as it
    except BaseException as e:  # noqa: BLE001 -- reported by the test thread
        errors.append(e)


def acknowledged(records: list, kind: str, shard: int) -> list[Answer]:
    """Every answer of ``kind`` from ``shard`` that acknowledged its push (applied, accepted or duplicate)."""
    return [a for rr in records for a in rr[:-1] if a.kind == kind and a.shard == shard and a.outcome in ACKED]


def by_base(answers: list[Answer], rows: bool, sync: bool = True) -> dict:
    """The answers' gradients (a table part's as a dense ROW_IDS x DIM matrix) by the version they were pushed on,
    for exact_sgd; ``sync``: also asserts that no rank is twice in a round (exactly once)."""
    out = defaultdict(list)
    for a in answers:
        out[a.base].append(torch.zeros(ROW_IDS, DIM).index_add_(0, a.ids, a.grad) if rows else a.grad)
    for base, gs in out.items():
        assert not sync or len({a.rank for a in answers if a.base == base}) == len(gs), base
    return out


def final_rows(shards, job) -> torch.Tensor:
    """Every row of the table as rank 0 (still registered) reads it from the shards, past the proxies."""
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
    args = (mode, embedding_mode, None)
    with trainers_through_faults(tmp_path, run_trainer, args, TRAINERS, **faults) as (shards, records):
        counters = [rr[-1][1] for rr in records]
        job, ranges = records[0][-1][2], records[0][-1][3]
        # the one-call path was the one taken, and the faults made it retry
        assert all(c.get("step_calls", 0) >= STEPS for c in counters), counters
        assert sum(c.get("retries", 0) + c.get("rows_retries", 0) for c in counters) > 0
        # replies were lost: parts retried under their numbers and answered DUPLICATE, counted as such
        for kind, counter in (("dense", "duplicate_pushes"), ("rows", "rows_duplicate_pushes")):
            duplicates = sum(a.outcome == "duplicate" for rr in records for a in rr[:-1] if a.kind == kind)
            assert duplicates > 0 and sum(c.get(counter, 0) for c in counters) == duplicates, (kind, duplicates)
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
            expected = exact_sgd(by_base(dense, rows=False, sync=mode != "async"), mode, st.version)
            assert got.numel() == ranges[shard][1] - ranges[shard][0]
            assert torch.equal(got, expected), (shard, (got - expected).abs().max())
            assert len(dense) == STEPS * TRAINERS  # every step's dense part acknowledged
            assert st.counters["pushes_applied"] == len(dense)
            assert st.version == (len(dense) if mode == "async" else closed_rounds([a.base for a in dense], st.version))
            # the rows: exact SGD of the acknowledged gradient rows, each push applied once
            mine = owner == shard
            table_version = int(st.counters["table.emb.version"])
            want = exact_sgd(by_base(table, rows=True, sync=rows_mode != "async"), rows_mode, table_version)
            assert torch.equal(final[mine], want[mine]), (shard, (final[mine] - want[mine]).abs().max())
            assert len(table) == STEPS * TRAINERS
            assert st.counters["table.emb.pushes_applied"] == len(table)
            assert table_version == (
                len(table) if rows_mode == "async" else closed_rounds([a.base for a in table], table_version))


# -- kill -9 of a shard mid-job and --restore, under one-call steps ---------------------------------------------------

EVERY, KILL_AT = 5, 13  # shard 1 dies at version 13 (rank 0 has made 13 steps); its newest checkpoint is 10


class Crash:
    """Rank 0's hook: before its step ``KILL_AT``, once shard 1 has written its version-10 checkpoint, kill -9
    shard 1 and start it again with ``--restore`` on its port (the proxy in front of it dials the new process);
    keeps the checkpoint the new process restores, to account for what it held."""

    def __init__(self, tmp_path, shard_args: list[str], shards: list):
        self.tmp_path, self.shard_args, self.shards = tmp_path, shard_args, shards
        self.restored = None

    def __call__(self, step: int) -> None:
        if step != KILL_AT:
            return
        ckpt = self.tmp_path / "ckpt"
        wait_until(lambda: bool(list_checkpoints(ckpt, 1)) and load_newest(ckpt, 1)[0].version == KILL_AT - 3,
                   "shard 1's checkpoint of version 10")
        old = self.shards[1]
        assert stats(old.address).counters["step_calls"] >= KILL_AT  # the steps so far: one call a shard
        old.kill()
        self.restored = load_newest(ckpt, 1)[0]  # what the restarted process restores (no newer one: it is dead)
        self.shards[1] = restart_on_its_port(old, 1, self.tmp_path / "shard1-restarted.log", self.shard_args)


def survivors(records: list, kind: str, shard: int, restored_version: int, held: set, final: list[dict]) -> list:
    """The acknowledged answers of ``kind`` whose pushes are in ``shard``'s state after a restore at
    ``restored_version``: those on an earlier version (the checkpoint holds them); those in the restored open
    round (ranks ``held``: the trainer's own new push there is answered DUPLICATE and dropped as "lost"); and those
    taken in after the trainer registered again with the restarted process (``final``: each rank's
    re-registrations by shard).  The rest -- acknowledged by the killed process on a version the checkpoint rolled
    back -- are the steps lost, at most --checkpoint-every."""
    return [a for a in acknowledged(records, kind, shard)
            if a.base < restored_version or (a.base == restored_version and a.rank in held)
            or a.rejoins == final[a.rank].get(shard, 0)]


def test_a_shard_killed_and_restored_under_one_call_steps_keeps_every_acknowledged_part_once(tmp_path):
    """Sync dense and sync rows: after kill -9 and --restore of shard 1, it holds exactly the SGD of what it
    acknowledged before its checkpoint, what its restored round held and what the restarted process
    acknowledged -- each once; the trainers lost only the rounds the checkpoint rolled back."""
    shard_args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", str(EVERY)]
    shards: list = []
    crash = Crash(tmp_path, shard_args, shards)
    faults = dict(seeds=[5, 17], mean_bytes_between_faults=40_000, max_faults=10, max_delay=0.001)
    with trainers_through_faults(tmp_path, run_trainer, ("sync", "", crash), TRAINERS, shard_args=shard_args,
                                 shards=shards, **faults) as (shards, records):
        counters = [rr[-1][1] for rr in records]
        final = [rr[-1][4] for rr in records]
        job = records[0][-1][2]
        state = crash.restored
        assert state is not None and state.version == KILL_AT - 3
        assert sum(c.get("reconnects", 0) for c in counters) >= 1  # the trainers registered again ...
        assert 0 < sum(c.get("steps_lost", 0) for c in counters)  # ... and lost the rolled-back rounds
        table = state.tables["emb"]
        held_rows = set((table["round"] or {}).get("contributors", ()))
        held_dense = set((state.open_round or {}).get("contributors", ()))
        final_table = final_rows(shards, job)
        owner = shard_of(torch.arange(ROW_IDS), 2)
        kept = {}
        for shard in range(2):
            restored = (state.version, table["version"]) if shard == 1 else (0, 0)
            dense = survivors(records, "dense", shard, restored[0], held_dense if shard == 1 else set(), final)
            rows = survivors(records, "rows", shard, restored[1], held_rows if shard == 1 else set(), final)
            if shard == 1:
                kept = {"dense": dense, "rows": rows}
            else:  # the shard that stayed up kept everything it acknowledged
                assert len(dense) == len(acknowledged(records, "dense", 0)) == STEPS * TRAINERS
                assert len(rows) == len(acknowledged(records, "rows", 0)) == STEPS * TRAINERS
            st = stats(shards[shard].address)
            assert st.counters["step_calls"] > 0  # (the restarted process too: back to one call a shard)
            got = pull_params(shards[shard].address, "step-0", job.fingerprint)
            dense_rounds = by_base(dense, rows=False)
            expected = exact_sgd(dense_rounds, "sync")
            assert torch.equal(got, expected), (shard, (got - expected).abs().max())
            assert st.version == len(dense_rounds)
            assert st.counters["pushes_applied"] == len(dense)
            row_rounds = by_base(rows, rows=True)
            want = exact_sgd(row_rounds, "sync")
            mine = owner == shard
            assert torch.equal(final_table[mine], want[mine]), (shard, (final_table[mine] - want[mine]).abs().max())
            assert st.counters["table.emb.version"] == len(row_rounds)
            assert st.counters["table.emb.pushes_applied"] == len(rows)
        # lost: only what the killed process acknowledged on the rounds its checkpoint rolled back -- as many dense
        # steps as each trainer counted lost, no more table pushes than the table versions it counted lost
        for rank in range(TRAINERS):
            gone = {kind: [a for a in acknowledged(records, kind, 1) if a.rank == rank and a not in kept[kind]]
                    for kind in kept}
            assert len(gone["dense"]) == counters[rank]["steps_lost"] <= KILL_AT - state.version, gone["dense"]
            assert all(a.base >= state.version for a in gone["dense"])
            assert len(gone["rows"]) <= counters[rank]["rows_versions_lost"] <= KILL_AT - table["version"]
            assert all(a.base >= table["version"] for a in gone["rows"])
        # what the checkpoint held is what was acknowledged before it: nothing acknowledged lost there
        early = by_base([a for a in acknowledged(records, "dense", 1) if a.base < state.version], rows=False)
        assert torch.equal(state.params, exact_sgd(early, "sync"))
        early = by_base([a for a in acknowledged(records, "rows", 1) if a.base < table["version"]], rows=True)
        saved = torch.zeros(ROW_IDS, DIM)
        saved[table["rows"]["ids"]] = table["rows"]["rows"]
        assert torch.equal(saved, exact_sgd(early, "sync"))
