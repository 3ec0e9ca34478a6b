"""An async job's live re-shard (stage 8 of docs/design/live-reshard.md, psserver.resharding.handoff.shard_async): the pure decisions,
with a fake clock and no network -- the source's stop, the destination's votes at different stops, the new piece
at the largest stop, the gates' refusals, and the trainer's side (the newest layout whatever the base; a step split
by the stops)."""

import dataclasses
from collections import Counter
from types import SimpleNamespace

import grpc
import pytest
import torch

from psserver.protocol.errors import HandoffPending, JobMismatch, LayoutMoved, NotReady, PsError
from psserver.protocol.job import OptimizerConfig
from psserver.protocol.layouts import LayoutEpoch
from psserver.resharding.handoff import machine as h
from psserver.resharding.handoff import shard_async as async_
from psserver.resharding.handoff.forward_log import Forward, PartCopy, PartReplay, assemble
from psserver.resharding.handoff.dest import DestPiece, DestState
from psserver.resharding.handoff.source import SourceState
from tests.conftest import make_spec
from tests.unit.test_handoff import TIMEOUT, run, tailing
from trainer.stepping.attempt import moved_partly
from trainer.membership.relayout import due

SGD = OptimizerConfig("sgd", lr=1.0)


def spec(optimizer=SGD, **kw):
    return dataclasses.replace(make_spec(**kw), optimizer=optimizer)


# --------------------------------------------------------------------------------------------- the source
def test_an_async_commit_stops_the_source_where_it_is_and_votes_at_once_when_every_forward_is_acknowledged():
    s, actions = run(tailing(v0=10, closed=3), h.Commit(13, stop_now=True))
    assert (s.state, s.round) == (SourceState.BLOCKED, 13)
    assert [type(a) for a in actions] == [h.HoldReplies, h.HoldRounds, h.SendVote]
    assert actions[1].from_version == 13 and actions[2].round == 13  # no push past V is applied


def test_an_async_commit_with_a_forward_unacknowledged_votes_once_it_is():
    s, _ = run(tailing(v0=10, closed=2), h.RoundClosed(12))  # applied, forward not acknowledged yet
    s, actions = run(s, h.Commit(13, stop_now=True))
    assert s.state is SourceState.BLOCKING and not any(isinstance(a, h.SendVote) for a in actions)
    s, actions = run(s, h.ForwardAcked(12))
    assert s.state is SourceState.BLOCKED and [a.round for a in actions if isinstance(a, h.SendVote)] == [13]


def test_an_async_commit_naming_another_version_than_the_sources_is_refused_and_changes_nothing():
    before = tailing(v0=10, closed=3)
    with pytest.raises(JobMismatch, match="commit version is 12 but shard 0 is at version 13"):
        before.on(h.Commit(12, stop_now=True), 0.0)
    assert before.state is SourceState.TAILING


def test_a_push_applied_past_the_stop_is_refused_by_the_machine():
    s, _ = run(tailing(v0=10, closed=3), h.Commit(13, stop_now=True))
    with pytest.raises(PsError, match="holds every round from R=13"):
        s.on(h.RoundClosed(13), 0.0)


# --------------------------------------------------------------------------------------------- the destination
def test_a_new_piece_of_an_async_job_takes_votes_at_different_stops_and_is_ready_at_the_largest():
    d, _ = run(DestPiece(TIMEOUT, "piece", stops_differ=True), h.Prepare(parts=((0, 5), (5, 9))),
               h.PartCopied(0, 2), h.PartCopied(1, 3), h.Forwarded(0, 2), h.Forwarded(0, 3), h.Forwarded(0, 4))
    d, actions = run(d, h.SourceVote(0, 5, "x", "x"), h.SourceVote(1, 3, "y", "y"))
    assert (d.state, d.round) == (DestState.READY, 5)
    assert [a.round for a in actions if isinstance(a, h.SendVote)] == [5]


def test_a_sync_new_piece_still_refuses_votes_at_different_rounds():
    d, _ = run(DestPiece(TIMEOUT, "piece"), h.Prepare(parts=((0, 5), (5, 9))), h.PartCopied(0, 5),
               h.PartCopied(1, 3), h.SourceVote(0, 5, "x", "x"))
    with pytest.raises(PsError, match="a vote names R=3 but another source voted for R=5"):
        d.on(h.SourceVote(1, 3, "y", "y"), 0.0)


def _replay(a, b, version, steps=0):
    r = PartReplay(PartCopy(a, b, version, torch.arange(a, b, dtype=torch.float32), {"state": {}, "param_groups": [
        {"lr": 1.0, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False,
         "foreach": None, "differentiable": False, "fused": None, "params": [0]}]}), SGD)
    for v in range(version, version + steps):
        r.apply(Forward(v, 1.0, torch.ones(b - a)))
    return r


def test_the_new_piece_is_its_parts_laid_end_to_end_at_the_largest_stop():
    piece = assemble([_replay(0, 4, 5), _replay(4, 10, 7, steps=2)], SGD, version=9)
    assert piece.version == 9
    assert torch.equal(piece.params.detach(), torch.cat([torch.arange(0, 4.), torch.arange(4, 10.) - 2]))


def test_a_new_piece_asked_below_a_parts_stop_is_refused():
    with pytest.raises(PsError, match="versions \\[5, 9\\]"):
        assemble([_replay(0, 4, 5), _replay(4, 10, 9)], SGD, version=8)


# --------------------------------------------------------------------------------------------- the gates
def _part(version, held_from):
    counters = Counter()
    return SimpleNamespace(version=version, enrolment=SimpleNamespace(handoff_held_from=held_from),
                           count=lambda k, n=1: counters.update({k: n}), counters=counters)


def test_the_held_gate_lets_a_push_below_the_hold_through_and_refuses_one_at_it_unavailable_counted():
    gate = async_.held_gate("shard 0 move 1")
    assert gate(_part(4, None), 3) is None and gate(_part(4, 5), 3) is None
    part = _part(5, 5)
    refusal = gate(part, 4)
    assert isinstance(refusal, HandoffPending) and refusal.code == grpc.StatusCode.UNAVAILABLE
    assert "version is 5" in str(refusal) and "stopped applying pushes at version 5" in str(refusal)
    assert part.counters["handoff_async_pushes_held"] == 1


def test_after_the_switch_the_old_piece_refuses_a_new_push_layout_moved_naming_the_new_layout_and_its_shards():
    part = _part(7, 7)
    refusal = async_.moved_gate(LayoutEpoch(1, 9, 3, 1, ("a:1", "b:2", "c:3")))(part, 6)
    assert isinstance(refusal, LayoutMoved) and refusal.newest == 1
    for fragment in ("layout_epoch is 0", "moved to layout 1 (from version 9)", "stopped at version 7", "a:1, b:2"):
        assert fragment in str(refusal)
    assert part.counters["refused_layout_moved"] == 1


def test_decide_naming_a_round_below_a_stop_here_is_refused_naming_both():
    io = SimpleNamespace(sources=[SimpleNamespace(machine=SimpleNamespace(round=7))],
                         dests={0: SimpleNamespace(replays={0: SimpleNamespace(version=9)})})
    assert async_.new_round(io, 9) == 9 and async_.new_round(io, 12) == 12
    with pytest.raises(NotReady, match="round is 8 but this shard's async stops reach version 9"):
        async_.new_round(io, 8)


@pytest.mark.parametrize("kw, fragments", [
    (dict(mode="async", optimizer=OptimizerConfig("adam", lr=0.01)), ("optimizer is adam", "optimizer sgd")),
], ids=["async-adam"])
def test_prepare_refuses_a_job_this_stage_cannot_move_naming_the_field_and_both_values(kw, fragments):
    with pytest.raises(JobMismatch) as e:
        async_.check_job(spec(**kw))
    assert all(f in str(e.value) for f in fragments)


def test_prepare_refuses_an_async_job_whose_data_cursor_granted_batches():
    with pytest.raises(JobMismatch, match="data cursor claims is 3 but .* takes claims 0"):
        async_.check_job(spec(mode="async"), cursor_claims=3)
    async_.check_job(spec(mode="async"))  # sgd, no claims: taken
    async_.check_job(make_spec(mode="sync"))
    async_.check_job(make_spec(mode="stale-timeout", sync_timeout=1.0))  # rounds: moves as sync does


def test_the_stale_gate_drops_a_stale_push_at_r_instead_of_scaling_it_into_round_r_counted():
    gate = async_.stale_gate(7, "shard 0 move 1")
    stale = SimpleNamespace(stale=lambda base, n: ("stale", base, n))
    assert gate(_part(6, 6), 5) is None  # round 6 closes in the old layout: scaled in and forwarded
    assert gate(_part(7, 7), 7) is None  # fresh (base >= R is the layout's routing: handoff, then layout-moved)
    part = _part(7, 7)
    part.hooks = stale
    assert gate(part, 5) == ("stale", 5, 2)
    assert (part.counters["stale_dropped_handoff"], part.counters["stale_dropped"]) == (1, 1)


# --------------------------------------------------------------------------------------------- the trainer
TIMELINE = [LayoutEpoch(0, 0, 2, 1), LayoutEpoch(1, 9, 3, 1)]


def test_an_async_trainer_follows_the_newest_layout_whatever_its_base_a_sync_one_by_its_base():
    assert due(TIMELINE, 0, 5) is None  # sync: base 5 is layout 0's
    assert due(TIMELINE, 0, 5, any_base=True).number == 1  # async: no common round, the newest
    assert due(TIMELINE, 1, 5, any_base=True) is None  # already there


class _Moved(grpc.RpcError):
    def __init__(self, code=grpc.StatusCode.FAILED_PRECONDITION, newest="1"):
        self._code, self._newest = code, newest

    def code(self):
        return self._code

    def details(self):
        return "layout-moved"

    def trailing_metadata(self):
        from psserver.protocol.errors import LAYOUT_METADATA_KEY, REASON_METADATA_KEY
        return ((REASON_METADATA_KEY, "layout-moved"), (LAYOUT_METADATA_KEY, self._newest))


def test_a_step_some_slots_applied_and_the_rest_refused_layout_moved_is_split_by_the_stops():
    assert moved_partly({1: _Moved()}, applied=[0]) == 1
    assert moved_partly({1: _Moved()}, applied=[]) is None  # refused everywhere: re-sent whole instead
    assert moved_partly({1: _Moved(), 2: RuntimeError("x")}, applied=[0]) is None  # a real failure stays one
