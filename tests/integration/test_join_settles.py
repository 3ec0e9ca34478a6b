"""A join settles on every shard or on none (issue 35 item 3), over gRPC on two real shards of a sync job.

Before: admission on both shards, the commit on shard 0 only and no confirm (a stranger who knows the spec, or a
joiner killed between its commits) left shard 0 with "members 0, 1 from round E" for good and shard 1 without --
the trainers then placed every round's batch by a member that never trained.  Now the shard that took the
commit withdraws it at --join-timeout as the other drops the admission: both end with the timeline they began
with, the rounds go on, and both serve the same membership for every round."""

import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.epochs import Epoch
from psserver.protocol.proto import ps_pb2 as pb
from tests.helpers import wait_until
from tests.integration.test_handoff_io import OLD_RANGES, spec

JOB = spec(max_trainers=2)  # 2 shards, a sync job of rank 0, one more rank may join


def _shards(shard_server):
    shards = [shard_server(shard=i, lease_timeout=0, join_timeout=0.5) for i in range(2)]
    for i, (a, b) in enumerate(OLD_RANGES):
        shards[i].register(spec=JOB, expected_shard=i)
        h = shards[i].header(n=b - a, fingerprint=JOB.fingerprint)
        assert shards[i].stub.Init(encode(wire_tensor(torch.zeros(b - a), pb.FLOAT32), h, 1024), timeout=10).accepted
    return shards


def _join(shard, i, rank=0, join_round=0, confirm=False):
    return shard.stub.Register(pb.RegisterRequest(rank=rank, trainer_id="joiner", expected_shard=i, join=True,
                                                  join_round=join_round, join_confirm=confirm, job=JOB.to_proto()),
                               timeout=10)


def _timeline(shard):
    return [(e.number, e.round, sorted(e.members)) for e in
            map(Epoch.from_proto, shard.stats(fingerprint=JOB.fingerprint).epochs)]


def _counters(shard):
    return shard.stats(fingerprint=JOB.fingerprint).counters


def _round(shards, base):
    """Rank 0's push of round ``base`` on both shards: each closes it (the job's one member)."""
    for i, (a, b) in enumerate(OLD_RANGES):
        h = shards[i].header(n=b - a, version=base, sequence=base + 1, fingerprint=JOB.fingerprint)
        assert shards[i].stub.Push(encode(wire_tensor(torch.full((b - a,), 0.1), pb.FLOAT32), h, 1024),
                                   timeout=10).outcome == pb.APPLIED
    assert [s.stats(fingerprint=JOB.fingerprint).version for s in shards] == [base + 1, base + 1]


def test_a_join_committed_on_one_shard_only_is_withdrawn_and_both_shards_keep_one_timeline(shard_server):
    shards = _shards(shard_server)
    _round(shards, 0)
    before = [_timeline(s) for s in shards]
    assert before[0] == before[1]
    asked = [_join(shards[0], 0)]
    asked.append(_join(shards[1], 1, rank=asked[0].rank))
    join_round = max(r.join_round for r in asked)
    committed = _join(shards[0], 0, rank=asked[0].rank, join_round=join_round)  # shard 0 only; no confirm
    assert committed.join_round == join_round
    assert asked[0].rank in _timeline(shards[0])[-1][2]  # in shard 0's timeline until its deadline
    wait_until(lambda: _counters(shards[0])["joins_unconfirmed"] == 1 and _counters(shards[1])["joins_abandoned"] == 1,
               "shard 0 to withdraw the unconfirmed join and shard 1 to drop the admission")
    assert [_timeline(s) for s in shards] == before  # epoch numbers too: nothing else changed
    made = [_counters(s)["membership_epochs"] for s in shards]
    assert made == [1, 0]  # the commit's epoch on shard 0 was counted when made; the withdrawal put it back
    for base in range(1, join_round + 2):  # the rounds go on past the join round with rank 0 alone, on both
        _round(shards, base)
    assert [_timeline(s) for s in shards] == before


def test_a_join_committed_and_confirmed_everywhere_is_kept_by_both_shards(shard_server):
    """The other side of the rule: a joiner that confirmed everywhere is a member on both from its round."""
    shards = _shards(shard_server)
    asked = [_join(shards[0], 0)]
    asked.append(_join(shards[1], 1, rank=asked[0].rank))
    join_round = max(r.join_round for r in asked)
    for i, s in enumerate(shards):
        _join(s, i, rank=asked[0].rank, join_round=join_round)
    for i, s in enumerate(shards):
        _join(s, i, rank=asked[0].rank, join_round=join_round, confirm=True)
    after = [_timeline(s) for s in shards]
    assert after[0] == after[1] and after[0][-1][1:] == (join_round, [0, asked[0].rank])


def test_a_peer_that_asks_to_join_and_never_commits_is_refused_its_next_admission_for_a_while(shard_server):
    """Issue 35 item 7: a join flood (one Register every 0.3 s) held a sync job's rounds again and again.  Now the
    peer's next admission after one expired unsettled is RESOURCE_EXHAUSTED naming it and the wait, counted,
    the state digest unchanged, and the job's rounds go on."""
    import grpc

    from tests.helpers import refused

    shards = _shards(shard_server)
    _join(shards[0], 0)
    wait_until(lambda: _counters(shards[0])["joins_abandoned"] == 1, "the admission to expire uncommitted")

    class Unchanged:
        def digest(self):
            return shards[0].digest(fingerprint=JOB.fingerprint)

    error = refused(lambda: _join(shards[0], 0), grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "peer '127.0.0.1' left 1 join(s)", "its next admission is taken in", unchanged=Unchanged())
    from psserver.protocol.rules import refused_join_backoff

    assert refused_join_backoff(error)  # the reason a joiner waits it out by (trainer.channels.registering)
    assert _counters(shards[0])["joins_refused_backoff"] == 1
    _round(shards, 0)  # rank 0 trains on, no round held
