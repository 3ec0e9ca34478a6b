"""Sparse tables in elastic jobs as pure decisions (no network, a fake clock): a table's round expects the
members of the membership epoch in effect at its round -- the same boundary as the dense round -- a pending
join holds it like the dense round, a leave closes it without the leaver, and a joiner's lanes and first pull
start at its round.  The cluster test (tests/cluster/test_elastic_tables.py) shows the rows over real processes."""

import pytest
import torch

from psserver.members.epochs import EpochBook
from psserver.partition.shard import Shard
from psserver.protocol.errors import FutureVersion, JobMismatch
from psserver.protocol.rules import Mode
from psserver.sparse.serving import Membership, RowsPush, ServedTable
from psserver.state import modes
from tests.conftest import P, make_spec
from tests.integration.test_sparse_rpc import table
from trainer.membership.session import joined_round

FP = "f" * 16
DIM = 4


def elastic_job(mode="sync", **kw):
    return make_spec(num_trainers=2, max_trainers=3, mode=mode, tables=(table(),), **kw)


def push(rank, base, ids=(1, 2), seq=1):
    ids = torch.tensor(ids, dtype=torch.int64)
    return RowsPush(rank, f"t{rank}", base, 1, seq, ids, torch.ones(len(ids), DIM))


def test_the_max_trainers_job_spec_with_sparse_tables_is_accepted():
    assert elastic_job().max_trainers == 3 and elastic_job().tables


def test_a_sync_table_round_expects_the_members_of_its_rounds_epoch_and_a_pending_join_holds_it():
    job = elastic_job()
    t, book = ServedTable(job.tables[0], job), EpochBook(2, 3)
    live = frozenset({0, 1, 2})  # the joiner is live from its admission on: its lease holds
    members = Membership(live, True, book)
    book.prepare(None, "t2", version=0, now=0.0, patience=5.0)  # proposes round 2, holds rounds from 1
    t.push(push(0, 0), members, 0.0)
    assert t.push(push(1, 0), members, 0.0).outcome == "applied"  # round 0: epoch 0, not held
    t.push(push(0, 1, seq=2), members, 0.0)
    assert t.push(push(1, 1, seq=2), members, 0.0).outcome == "accepted"  # round 1 is held by the join
    assert t.version == 1
    book.commit(2, "t2", 2, version=1)
    assert not t.close_if_due(members, 0.0)  # committed here, held until every shard took it
    book.confirm(2, "t2", 2, version=1)
    assert t.close_if_due(members, 0.0) and t.version == 2  # the confirm lets round 1 close, without rank 2
    t.push(push(0, 2, seq=3), members, 0.0)
    assert t.push(push(1, 2, seq=3), members, 0.0).outcome == "accepted"  # round 2 waits for the joiner
    assert t.push(push(2, 2), members, 0.0).outcome == "applied"
    # the held round closed at the commit (a tick's close: counted as membership, as the dense round's is)
    assert (t.counts["rounds_all_arrived"], t.counts["rounds_membership"], t.version) == (2, 1, 3)


def test_a_leave_announced_from_the_next_round_closes_that_table_round_without_the_leaver():
    job = elastic_job()
    t, book = ServedTable(job.tables[0], job), EpochBook(2, 3)
    members = Membership(frozenset({0, 1}), True, book)  # the leaver's lease still holds
    t.push(push(0, 0), members, 0.0)
    t.push(push(1, 0), members, 0.0)
    book.leave(1, at=1)  # rank 1's last push was round 0's
    assert t.push(push(0, 1, seq=2), members, 0.0).outcome == "applied"
    assert t.version == 2


def test_a_leave_without_an_announcement_closes_the_open_table_round_as_membership():
    job = elastic_job()
    t, book = ServedTable(job.tables[0], job), EpochBook(2, 3)
    t.push(push(0, 0), Membership(frozenset({0, 1}), True, book), 0.0)
    book.leave(1, at=0)
    assert t.close_if_due(Membership(frozenset({0}), True, book), 0.0)
    assert t.counts["rounds_membership"] == 1 and t.version == 1


def test_a_stale_timeout_table_recomputes_its_quorum_for_the_epoch_of_its_round():
    job = make_spec(num_trainers=2, max_trainers=3, mode="stale-timeout", sync_timeout=60.0, replicas_to_aggregate=1,
                    tables=(table(),))
    t, book = ServedTable(job.tables[0], job), EpochBook(2, 3)
    book.commit(2, "t2", 2, version=0)  # three members from round 2: K = 1 + 3 - 2 = 2
    book.confirm(2, "t2", 2, version=0)
    members = Membership(frozenset({0, 1, 2}), True, book)
    assert t.push(push(0, 0), members, 0.0).outcome == "applied"  # round 0: two members, K = 1
    assert t.push(push(0, 1, seq=2), members, 0.0).outcome == "applied"
    assert t.push(push(0, 2, seq=3), members, 0.0).outcome == "accepted"  # round 2: K = 2
    assert t.push(push(1, 2, seq=2), members, 0.0).outcome == "applied"
    assert modes.quorum(t.cfg, 3) == 2


def test_an_async_table_applies_every_push_whatever_the_epoch():
    job = elastic_job("async")
    t, book = ServedTable(job.tables[0], job), EpochBook(2, 3)
    book.prepare(None, "t2", version=0, now=0.0, patience=5.0)  # a pending join holds no async push
    members = Membership(frozenset({0, 1, 2}), True, book)
    assert t.push(push(0, 0), members, 0.0).outcome == "applied"
    assert t.push(push(2, 1), members, 0.0).outcome == "applied"


def test_a_joiners_first_pull_may_wait_for_the_round_before_its_own_but_no_further():
    job = elastic_job()
    t = ServedTable(job.tables[0], job)
    t.check_wait(2, 1, joins=True)  # version 0: its round is 1, the shard is one behind
    with pytest.raises(FutureVersion, match="holds no push of rank 2"):
        t.check_wait(2, 1)  # not a joiner: a restored shard lost its push
    with pytest.raises(FutureVersion):
        t.check_wait(2, 2, joins=True)


def test_a_joiners_sync_table_lanes_start_at_its_round_and_other_modes_at_the_shards_version():
    assert joined_round(4, Mode.SYNC, 5) == 5
    assert joined_round(6, Mode.SYNC, 5) == 6  # never behind the shard
    assert joined_round(4, Mode.ASYNC, 5) == 4
    assert joined_round(4, Mode.STALE_TIMEOUT, 5) == 4


def shard_with_table() -> Shard:
    shard = Shard(0, clock=lambda: 100.0, lease_timeout=600.0)
    job = elastic_job()
    for r in range(2):
        shard.register(r, f"t{r}", 0, job)
    shard.init(0, "t0", FP, torch.zeros(P))
    return shard


def test_a_shards_table_round_follows_its_epoch_and_the_confirm_closes_the_round_its_join_held():
    shard, job = shard_with_table(), elastic_job()
    name = job.tables[0].name
    reply = shard.register(0, "t2", 0, job, join=True)  # admitted as rank 2, rounds from 1 held
    assert (reply["rank"], reply["join_round"]) == (2, 2)
    assert not shard.enrolment.joins_at(2, 2)  # admitted, not committed: in no epoch yet
    for base in (0, 1):
        for r in (0, 1):
            shard.push_rows(FP, name, push(r, base, seq=base + 1), True)
    assert shard.tables.get(name).version == 1  # round 1 held by the pending join
    shard.register(2, "t2", 0, job, join=True, join_round=2)
    assert shard.enrolment.joins_at(2, 2) and not shard.enrolment.joins_at(2, 1)
    assert shard.tables.get(name).version == 1  # committed: held until the confirm
    shard.register(2, "t2", 0, job, join=True, join_round=2, join_confirm=True)
    assert shard.tables.get(name).version == 2
    shard.push_rows(FP, name, push(0, 2, seq=3), True)
    assert shard.push_rows(FP, name, push(1, 2, seq=3), True).outcome == "accepted"  # waits for rank 2
    assert shard.push_rows(FP, name, push(2, 2), True).outcome == "applied"


def test_a_sync_push_waits_only_one_round_ahead_and_only_from_a_rank_the_open_round_holds():
    """The prefetch race's decision: waiting is for the close of the open round, never a refusal of a healthy
    trainer -- and nothing a stranger or a restarted shard's trainer can park a call on."""
    job = elastic_job()
    t, members = ServedTable(job.tables[0], job), Membership(frozenset({0, 1}), True, EpochBook(2, 3))
    t.push(push(0, 0), members, 0.0)
    assert t.push_waits(0, 1)  # rank 0 is in round 0
    assert not t.push_waits(0, 2)  # two ahead: a restart
    assert not t.push_waits(1, 1)  # not in the round
    assert t.push_waits(2, 1, joins=True)  # a joiner whose first round is 1
    async_job = elastic_job("async")
    a = ServedTable(async_job.tables[0], async_job)
    a.push(push(0, 0), members, 0.0)
    assert not a.push_waits(0, 2)


def test_a_shards_table_push_from_outside_its_rounds_epoch_is_refused_and_changes_nothing():
    shard, job = shard_with_table(), elastic_job()
    name = job.tables[0].name
    shard.register(0, "t2", 0, job, join=True)  # admitted, not committed
    before = shard.state_digest()
    with pytest.raises(JobMismatch, match="rank 2 is in no membership epoch"):
        shard.push_rows(FP, name, push(2, 0), True)
    assert shard.state_digest() == before
    shard.register(2, "t2", 0, job, join=True, join_round=2)
    before = shard.state_digest()
    with pytest.raises(JobMismatch, match="base version is 0 but rank 2 is a member of this job from round 2"):
        shard.push_rows(FP, name, push(2, 0), True)
    assert shard.state_digest() == before


def test_a_join_never_committed_holds_a_table_round_only_until_its_join_timeout():
    """An attacker asks to join and never commits: the held table round closes at the join's deadline (the tick
    drops the join), as the dense round does -- not at a lease's, and not never."""
    now = [100.0]
    shard, job = Shard(0, clock=lambda: now[0], lease_timeout=600.0, join_timeout=3.0), elastic_job()
    name = job.tables[0].name
    for r in range(2):
        shard.register(r, f"t{r}", 0, job)
    shard.init(0, "t0", FP, torch.zeros(P))
    shard.register(0, "t2", 0, job, join=True)  # holds rounds from 1
    for base in (0, 1):
        for r in (0, 1):
            shard.push_rows(FP, name, push(r, base, seq=base + 1), True)
    assert shard.tables.get(name).version == 1 and shard.tick() == 103.0
    now[0] = 102.9
    shard.tick()
    assert shard.tables.get(name).version == 1
    now[0] = 103.0
    shard.tick()
    assert shard.tables.get(name).version == 2 and shard.counters["joins_abandoned"] == 1


def test_a_plain_re_registered_leavers_sync_table_lanes_start_at_its_registration_round_on_each_shard():
    """A rank that left and registered again without --join: each shard answers the round it is a member from
    (RegisterReply.join_round); a sync table one round behind then must not get its first push (not its round)."""
    from types import SimpleNamespace

    from psserver.protocol.proto import ps_pb2 as pb
    from trainer.membership.rejoins import Rejoins
    from trainer.membership.session import plain_member_from

    parts = [SimpleNamespace(index=i, partition=p, slot=2 * i + p) for i in range(2) for p in range(2)]
    replies = [pb.RegisterReply(join_round=7), pb.RegisterReply(join_round=7), OSError("down"),
               pb.RegisterReply(join_round=0)]
    assert plain_member_from(parts, replies) == {0: 7}
    shards = [SimpleNamespace(index=i, stats=lambda: SimpleNamespace(counters={"table.emb.version": 6,
                                                                               "table.asy.version": 6}))
              for i in range(2)]
    # only what track_rows reads: the shards' stats and member_from
    slots = SimpleNamespace(client=SimpleNamespace(shards=shards, parts=[]))
    rejoins = Rejoins(slots, SimpleNamespace(member_from={0: 7}), before_rejoin=lambda slot: None)
    started = {}
    rows = SimpleNamespace(tables=("emb", "asy"), modes={"emb": Mode.SYNC, "asy": Mode.ASYNC},
                           start_at=lambda shard, versions: started.setdefault(shard, versions))
    rejoins.track_rows(rows, joined_at=0)
    assert started == {0: {"emb": 7, "asy": 6}, 1: {"emb": 6, "asy": 6}}
