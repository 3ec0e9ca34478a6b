"""A sync table moved live beside the dense slice (stage 6 of docs/design/live-reshard.md, docs/design/handoff-io.md#tables): three
real shards over gRPC on loopback, the test as the coordinator and as the one trainer, a sync job of one dense slice
and one Adagrad table moved from two shards to three while dense and row pushes go on during the copy, and drained
from three to two."""

import dataclasses
from collections import Counter

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.errors import REASON_METADATA_KEY
from psserver.protocol.layout import Layout, shard_range
from psserver.protocol.layouts import new_job
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rows.optim import SparseOptimizerConfig
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.rows.table import TableSpec
from psserver.resharding.reshard import recut_table
from tests.conftest import P, make_spec
from tests.helpers import refused, wait_until
from tests.integration.test_handoff_io import Job, Op, _Shard, spec
from tests.integration.test_sparse_rpc import rows_chunks

DIM = 4


def table(optimizer="adagrad", **kw) -> TableSpec:
    return TableSpec("emb", DIM, optimizer=SparseOptimizerConfig(optimizer, lr=0.1), seed=7, **kw)


class TableJob(Job):
    """``Job`` with a sync table: each round pushes the dense slice and rows on both old shards."""

    def __init__(self, shard_server, job):
        super().__init__(shard_server, job)
        self.new_job = new_job(job, 3)
        self.row_seq = {}
        self.used = torch.empty(0, dtype=torch.int64)
        self.held = []  # round R-1's dense pushes, whose replies wait for DECIDE (psserver.serving.reply_holds)

    def push(self, i, base, layout=0, later=False):  # the dense push, with the new layout's fingerprint in layout 1
        if layout:
            self.job, old = self.new_job, self.job
            try:
                return super().push(i, base, layout, later)
            finally:
                self.job = old
        return super().push(i, base, layout, later)

    def push_rows(self, i, base, ids, layout=0):
        key = (i, layout)
        self.row_seq[key] = self.row_seq.get(key, 0) + 1
        fp = (self.new_job if layout else self.job).fingerprint
        chunks = rows_chunks(ids.tolist(), torch.randn(len(ids), DIM, generator=self.gen), seq=self.row_seq[key],
                             base=base, fingerprint=fp)
        chunks[0].header.layout_epoch = layout
        return self.shards[i].stub.PushRows(iter(chunks), timeout=10)

    def fresh_ids(self, i, shards=2, n=24):
        """Ids shard ``i`` owns: some new (their rows are created by the push), some pushed before."""
        ids = torch.unique(torch.randint(0, 2000, (n,), generator=self.gen))
        ids = torch.unique(torch.cat([ids, self.used[:4]]))
        self.used = torch.unique(torch.cat([self.used, ids]))
        return ids[shard_of(ids, shards) == i]

    def table(self, i, layout=0):
        return self.shards[i].server.layouts.host(layout).head.tables.get("emb")

    def rounds(self, upto, held=False):
        """Dense and rows on both old shards until each is at version ``upto``.  ``held``: ``upto`` is R, and round
        R-1's dense replies wait for DECIDE (docs/design/handoff-io.md): their futures, kept in ``self.held`` -- a gRPC
        future garbage-collected cancels its call, and a push cancelled before the shard read it never closes
        round R-1 (the hand-off then waits for it to the end)."""
        if held:
            self.rounds(upto - 1)
            self.held = []
            for i in (0, 1):
                self.held.append(self.push(i, upto - 1, later=True))
                assert self.push_rows(i, upto - 1, self.fresh_ids(i)).outcome == pb.APPLIED
            wait_until(lambda: all(self.shards[i].server.layouts.host(0).head.version == upto for i in (0, 1)),
                       "round R-1's dense pushes taken on both old shards")
            return self.held
        for i in (0, 1):
            while self.table(i).version < upto:
                base = self.table(i).version
                assert self.push(i, base).outcome == pb.APPLIED
                assert self.push_rows(i, base, self.fresh_ids(i)).outcome == pb.APPLIED


def pull_rows(shard, ids, layout, version, fingerprint):
    req = pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=fingerprint, table="emb", min_version=version,
                             ids=ids.numpy().tobytes(), layout_epoch=layout)
    chunks = list(shard.stub.PullRows(req, timeout=10))
    rows = torch.frombuffer(bytearray(b"".join(c.rows for c in chunks)), dtype=torch.float32).view(-1, DIM)
    return chunks[0].header.version, rows


def pull_by_owner(job, ids, shards, layout, version, fingerprint):
    """Rows of ``ids`` (sorted) pulled from their owners among the first ``shards`` shards, in ids' order."""
    owner = shard_of(ids, shards)
    out = torch.empty(len(ids), DIM)
    for i in range(shards):
        mine = owner == i
        got_version, rows = pull_rows(job.shards[i], ids[mine], layout, version, fingerprint)
        assert got_version == version
        out[mine] = rows
    return out


def held_replies_name_layout_1(held, R):
    """Round R-1's dense replies, held over the block, went out after DECIDE switch: applied, naming R and layout 1."""
    assert [(f.result(timeout=60).outcome, f.result().version, f.result().layout_epoch) for f in held] == \
        [(pb.APPLIED, R, 1)] * len(held)


def to_tailing(job):
    for i in (2, 0, 1):  # the destinations first
        job.reshard(i, Op.PREPARE)


def commit(job):
    wait_until(lambda: all(p in ("source:tailing", "dest:replaying") for p in job.phases())
               and len(job.phases()) == 7, "every move to tail and every new piece to replay")
    R = max(job.reshard(i, Op.PROPOSE).proposal for i in (0, 1))
    for i in range(3):
        job.reshard(i, Op.COMMIT, round=R)
    return R


def moved(job):
    """Two rounds, PREPARE, three rounds of dense and row pushes during the copy, COMMIT R, DECIDE switch: (R, the
    old shards' table states at R, every id pushed, their rows pulled in layout 0 at R)."""
    job.rounds(2)
    to_tailing(job)
    job.rounds(5)  # dense and row pushes (rows created in them) during the copy: each closed round is forwarded
    R = commit(job)
    job.rounds(R, held=True)
    wait_until(lambda: sorted(set(job.phases())) == ["dest:ready", "source:blocked"], "every piece ready at R")
    saved = [job.table(i).state() for i in (0, 1)]  # the old shards' rows at R (before a pull moves their clocks)
    ids = torch.sort(job.used).values
    at_r = pull_by_owner(job, ids, 2, 0, R, job.job.fingerprint)
    for i in range(3):
        assert job.reshard(i, Op.DECIDE, switch=True).layout_epoch == 1
    held_replies_name_layout_1(job.held, R)
    return R, saved, ids, at_r


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_a_sync_table_moves_two_to_three_with_row_pushes_during_the_copy_and_layout_1_holds_the_rows_at_r(
        shard_server, optimizer):
    job = TableJob(shard_server, spec(tables=(table(optimizer),)))
    R, saved, ids, at_r = moved(job)
    counters = [s.server.layouts.host(0).head.counters for s in job.shards]  # the old layout's (and the empty one's)
    assert [c["handoff_row_copies_sent"] for c in counters] == [3, 3, 0]  # one copy to each new shard, itself included
    assert [c["handoff_row_forwards_sent"] for c in counters[:2]] == [3 * (R - 2)] * 2  # each round after the copy
    assert counters[2]["handoff_row_forwards_replayed"] == 2 * (R - 2)  # from each old shard
    for d in range(3):  # each new shard holds exactly the old shards' rows of the ids that hash to it
        want, got = recut_table(saved, 3, d)["rows"], job.table(d, layout=1).store.state()
        assert job.table(d, layout=1).version == R and got["version"] == want["version"]
        for k in ("ids", "rows", "optimizer_state", "last_tick", "last_version"):
            assert torch.equal(got[k], want[k]), (d, k)
        assert len(got["ids"]) and torch.equal(shard_of(got["ids"], 3), torch.full_like(got["ids"], d))
    owner, looked_up = shard_of(ids, 3), torch.empty(len(ids), DIM)
    for d in range(3):  # what a pull in layout 1 reads: the new owners' rows at R equal layout 0's
        version, looked_up[owner == d] = job.table(d, layout=1).lookup(ids[owner == d])
        assert version == R
    assert torch.equal(looked_up, at_r)
    layouts = job.shards[2].stats(fingerprint=job.new_job.fingerprint).layouts
    assert dict(layouts[-1].table_rounds) == {"emb": R} and layouts[-1].round == R
    for i in range(3):  # layout 1 takes round R of the dense slice
        assert job.push(i, R, layout=1).outcome == pb.APPLIED


def test_row_pulls_in_layout_1_read_the_rows_at_r_and_row_pushes_of_base_r_apply_on_the_new_owners(shard_server):
    job = TableJob(shard_server, spec(tables=(table(),)))
    R, _, ids, at_r = moved(job)
    assert torch.equal(pull_by_owner(job, ids, 3, 1, R, job.new_job.fingerprint), at_r)
    for i in range(3):
        reply = job.push_rows(i, R, job.fresh_ids(i, shards=3), layout=1)
        assert (reply.outcome, reply.version) == (pb.APPLIED, R + 1)  # the new owners take round R


def test_rows_whose_destination_falls_behind_are_copied_again_and_still_equal_the_old_rows_at_r(shard_server):
    job = TableJob(shard_server, spec(tables=(table(),)))
    for s in job.shards:  # the rows' log bound below the dense one's (which throttles the rounds at its bound)
        s.server.handoffs.rows.max_lag = 2
    for i in (0, 1):  # the new shard has no plan yet: its rows' forwards cannot be acknowledged
        job.reshard(i, Op.PREPARE)
    job.rounds(4)  # four rounds past the copy at version 0: over the rows' lag of 2
    assert all(job.shards[i].server.layouts.host(0).head.counters["handoff_row_recopies"] >= 1 for i in (0, 1))
    job.reshard(2, Op.PREPARE)
    R = commit(job)
    job.rounds(R, held=True)
    wait_until(lambda: sorted(set(job.phases())) == ["dest:ready", "source:blocked"], "every piece ready at R")
    saved = [job.table(i).state() for i in (0, 1)]
    for i in range(3):
        job.reshard(i, Op.DECIDE, switch=True)
    held_replies_name_layout_1(job.held, R)
    for d in range(3):
        want, got = recut_table(saved, 3, d)["rows"], job.table(d, layout=1).store.state()
        for k in ("ids", "rows", "optimizer_state"):
            assert torch.equal(got[k], want[k]), (d, k)


def test_rows_evicted_during_the_copy_are_deleted_on_the_new_shards(shard_server):
    job = TableJob(shard_server, spec(tables=(table(evict_after=2),)))
    job.rounds(2)
    to_tailing(job)
    job.rounds(6)
    R = commit(job)
    job.rounds(R, held=True)
    wait_until(lambda: sorted(set(job.phases())) == ["dest:ready", "source:blocked"], "every piece ready at R")
    assert sum(job.table(i).store.counts.evicted_stale for i in (0, 1)) > 0
    saved = [job.table(i).state() for i in (0, 1)]
    for i in range(3):
        job.reshard(i, Op.DECIDE, switch=True)
    held_replies_name_layout_1(job.held, R)
    for d in range(3):
        assert torch.equal(job.table(d, layout=1).store.state()["ids"], recut_table(saved, 3, d)["rows"]["ids"])


def test_a_row_push_at_r_in_the_old_layout_before_decide_is_unavailable_handoff_changing_nothing(shard_server):
    job = TableJob(shard_server, spec(tables=(table(),)))
    to_tailing(job)
    R = commit(job)
    job.rounds(R, held=True)
    ids = job.fresh_ids(0)
    error = refused(lambda: job.push_rows(0, R, ids), grpc.StatusCode.UNAVAILABLE, f"base version is {R}",
                    "table 'emb'", f"hands over at round {R}", unchanged=_Shard(job, 0))
    assert dict(error.trailing_metadata())[REASON_METADATA_KEY] == "handoff"
    assert pull_rows(job.shards[0], ids, 0, R, job.job.fingerprint)[0] == R  # still serves
    wait_until(lambda: sorted(set(job.phases())) == ["dest:ready", "source:blocked"], "every piece ready at R")
    for i in range(3):
        job.reshard(i, Op.DECIDE, switch=True)
    held_replies_name_layout_1(job.held, R)
    refused(lambda: job.push_rows(0, R, ids), grpc.StatusCode.FAILED_PRECONDITION, "layout_epoch is 0")


def test_commit_with_a_table_already_at_r_is_failed_precondition_naming_the_table_and_changing_nothing(
        shard_server):
    job = TableJob(shard_server, spec(tables=(table(),)))
    for base in range(3):  # the table runs ahead of the dense slice on shard 0 (rows pushed, no dense push)
        assert job.push_rows(0, base, job.fresh_ids(0)).outcome == pb.APPLIED
    to_tailing(job)
    wait_until(lambda: all(p in ("source:tailing", "dest:replaying") for p in job.phases())
               and len(job.phases()) == 7, "every move to tail")
    R = max(job.reshard(i, Op.PROPOSE).proposal for i in (0, 1))
    assert R <= 3
    refused(lambda: job.reshard(0, Op.COMMIT, round=R), grpc.StatusCode.FAILED_PRECONDITION,
            f"commit round is {R}", "table 'emb' is at version 3", unchanged=_Shard(job, 0))
    assert job.reshard(0, Op.STATUS).round == 0
    mine = job.used[shard_of(job.used, 2) == 0]
    assert pull_rows(job.shards[0], mine, 0, 3, job.job.fingerprint)[0] == 3  # still serves


class Drain:
    """A sync job of one dense slice and one table on three shards, rank 0 pushed by the test; drained to two."""

    def __init__(self, shard_server):
        s = make_spec(num_shards=3, tables=(table(),))
        self.job = dataclasses.replace(s, fingerprint=Layout.from_shapes(s.tensors, 3).fingerprint())
        self.shards = [shard_server(shard=i, lease_timeout=0) for i in range(3)]
        for s in self.shards:  # a held reply waits for DECIDE, however slow the machine, not for the timeout
            s.server.handoffs.timeout = 60.0
        self.old, self.new = [s.server.address for s in self.shards], [s.server.address for s in self.shards[:2]]
        self.gen, self.seq = torch.Generator().manual_seed(0), Counter()
        self.held = []  # round R-1's dense pushes (TableJob.rounds says why they are kept)
        for i, (a, b) in enumerate(shard_range(P, 3, i) for i in range(3)):
            self.shards[i].register(spec=self.job, expected_shard=i)
            h = self.shards[i].header(n=b - a, fingerprint=self.job.fingerprint)
            assert self.shards[i].stub.Init(encode(wire_tensor(torch.randn(b - a, generator=self.gen), pb.FLOAT32),
                                                   h, 1024), timeout=10).accepted

    def table(self, i, layout=0):
        return self.shards[i].server.layouts.host(layout).head.tables.get("emb")

    def rounds(self, upto, held=False):
        """Dense and rows on the three shards up to ``upto``; ``held``: round upto-1's dense replies wait for DECIDE
        (their futures, kept in ``self.held``)."""
        for i, (a, b) in enumerate(shard_range(P, 3, i) for i in range(3)):
            while (v := self.table(i).version) < upto:
                self.seq[i, "dense"] += 1
                h = self.shards[i].header(n=b - a, version=v, sequence=self.seq[i, "dense"],
                                          fingerprint=self.job.fingerprint)
                grad = torch.randn(b - a, generator=self.gen)
                push = encode(wire_tensor(grad, pb.FLOAT32), h, 1024)
                if held and v == upto - 1:
                    self.held.append(self.shards[i].stub.Push.future(push, timeout=60))
                else:
                    assert self.shards[i].stub.Push(push, timeout=10).outcome == pb.APPLIED
                ids = torch.unique(torch.randint(0, 2000, (30,), generator=self.gen))
                ids = ids[shard_of(ids, 3) == i]
                self.seq[i, "rows"] += 1
                chunks = rows_chunks(ids.tolist(), torch.randn(len(ids), DIM, generator=self.gen),
                                     seq=self.seq[i, "rows"], base=v, fingerprint=self.job.fingerprint)
                assert self.shards[i].stub.PushRows(iter(chunks), timeout=10).outcome == pb.APPLIED
        return self.held

    def reshard(self, i, op, **kw):
        return self.shards[i].stub.Reshard(pb.ReshardRequest(op=op, plan="d1", old_addresses=self.old,
                                                             new_addresses=self.new, you=self.old[i], **kw), timeout=10)

    def phases(self):
        return [r.phase for i in range(3) for r in self.reshard(i, Op.STATUS).handoffs]


def test_a_sync_table_drained_three_to_two_leaves_the_remaining_shards_the_old_rows_at_r(shard_server):
    job = Drain(shard_server)
    job.rounds(2)
    for i in range(3):
        job.reshard(i, Op.PREPARE)
    job.rounds(5)
    wait_until(lambda: set(job.phases()) == {"source:tailing", "dest:replaying"}, "every move to tail")
    R = max(job.reshard(i, Op.PROPOSE).proposal for i in range(3))
    for i in range(3):
        job.reshard(i, Op.COMMIT, round=R)
    job.rounds(R, held=True)
    wait_until(lambda: sorted(set(job.phases())) == ["dest:ready", "source:blocked"], "every piece ready at R")
    saved = [job.table(i).state() for i in range(3)]
    for i in range(3):
        job.reshard(i, Op.DECIDE, switch=True)
    held_replies_name_layout_1(job.held, R)
    for d in range(2):
        want, got = recut_table(saved, 2, d)["rows"], job.table(d, layout=1).store.state()
        assert job.table(d, layout=1).version == R
        for k in ("ids", "rows", "optimizer_state", "last_tick", "last_version"):
            assert torch.equal(got[k], want[k]), (d, k)


def test_row_replies_name_the_newest_layout_so_a_trainer_learns_a_switch_from_a_table_call(shard_server):
    """A row reply's ``layout_epoch`` (PullRows' RowsHeader, PushRows' PushRowsReply) names the newest layout, as a
    dense reply's does: 0 before the switch, 1 after it, on the tombstone's pulls up to R too."""
    job = TableJob(shard_server, spec(tables=(table(),)))
    job.rounds(1)
    ids = job.fresh_ids(0)
    assert job.push_rows(0, 1, ids).layout_epoch == 0
    before = pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=job.job.fingerprint, table="emb",
                                min_version=1, ids=ids.numpy().tobytes())
    assert next(iter(job.shards[0].stub.PullRows(before, timeout=10))).header.layout_epoch == 0
    job.push_rows(1, 1, job.fresh_ids(1))
    job.push(0, 1), job.push(1, 1)
    R, _, ids, _ = moved(job)
    old = pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=job.job.fingerprint, table="emb", min_version=R,
                             ids=ids[shard_of(ids, 2) == 0].numpy().tobytes(), layout_epoch=0)
    first = next(iter(job.shards[0].stub.PullRows(old, timeout=10)))  # the tombstone answers pulls up to R
    assert (first.header.version, first.header.layout_epoch) == (R, 1)
    for i in range(3):
        reply = job.push_rows(i, R, job.fresh_ids(i, shards=3), layout=1)
        assert (reply.outcome, reply.layout_epoch) == (pb.APPLIED, 1)
