"""A live re-shard's plan as a shard and the coordinator hold it (no network): the plan id a re-run of
`ps-server reshard` names again, each shard's place in both lists, and the moves it is a source of."""

import dataclasses
from types import SimpleNamespace

import grpc
import pytest

from psserver.protocol.layout import Layout, shard_range
from psserver.protocol.proto import ps_pb2 as pb
from psserver.resharding import reshard_cmd
from psserver.resharding.handoff.plan import Plan
from psserver.resharding.reshard_cmd import plan_id
from tests.conftest import P, make_spec

OLD, NEW = ("a:1", "b:2"), ("a:1", "b:2", "c:3")


def test_plan_id_is_the_same_for_a_rerun_and_differs_for_another_list_or_partitions():
    assert plan_id(list(OLD), list(NEW), 0) == plan_id(list(OLD), list(NEW), 0)
    assert plan_id(list(OLD), list(NEW), 0) != plan_id(list(OLD), list(NEW[:2]) + ["d:4"], 0)
    assert plan_id(list(OLD), list(NEW), 0) != plan_id(list(OLD), list(NEW), 2)


def test_a_shard_finds_its_place_in_both_lists_and_a_new_shard_only_in_the_new_one():
    assert (Plan("p", OLD, NEW, 0, "b:2").old_index, Plan("p", OLD, NEW, 0, "b:2").new_index) == (1, 1)
    assert (Plan("p", OLD, NEW, 0, "c:3").old_index, Plan("p", OLD, NEW, 0, "c:3").new_index) == (None, 2)


def test_the_moves_of_two_to_three_cover_every_element_once_and_each_old_shard_sends_two():
    job = make_spec(num_shards=2)
    job = dataclasses.replace(job, fingerprint=Layout.from_shapes(job.tensors, 2).fingerprint())
    moves = Plan("p", OLD, NEW, 0, "a:1").moves(job)
    assert sorted((m.a, m.b) for m in moves) == [(0, 333), (333, 500), (500, 666), (666, P)]
    assert [m.src for m in moves].count(0) == [m.src for m in moves].count(1) == 2
    for m in moves:
        lo, hi = shard_range(P, 3, m.dst)
        assert lo <= m.a < m.b <= hi


class _NoAnswer(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "Stream removed (Socket closed)" if self._code == grpc.StatusCode.UNAVAILABLE else "refused"


def test_the_coordinator_sends_an_op_again_after_no_answer_said_and_counted_but_never_after_a_refusal(monkeypatch):
    answers = [_NoAnswer(grpc.StatusCode.UNAVAILABLE), _NoAnswer(grpc.StatusCode.DEADLINE_EXCEEDED),
               pb.ReshardReply(round=7), _NoAnswer(grpc.StatusCode.FAILED_PRECONDITION)]
    sent = []

    def reshard(request, timeout, metadata=None):
        sent.append(request.op)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(reshard_cmd.stubs, "stub", lambda channel: SimpleNamespace(Reshard=reshard))
    monkeypatch.setattr(reshard_cmd.time, "sleep", lambda s: None)  # the backoff (no clock in a unit test)
    lines = []
    coordinator = reshard_cmd.Coordinator(["127.0.0.1:1"], ["127.0.0.1:1", "127.0.0.1:2"], say=lines.append)
    try:
        assert coordinator.call("127.0.0.1:1", pb.ReshardRequest.STATUS).round == 7
        assert sent == [pb.ReshardRequest.STATUS] * 3 and coordinator.retries == 2
        assert lines[0].startswith("STATUS to 127.0.0.1:1: no answer (UNAVAILABLE: Stream removed")
        with pytest.raises(reshard_cmd.CoordinatorError, match="127.0.0.1:1 answered COMMIT with "
                                                               "FAILED_PRECONDITION: refused") as refusal:
            coordinator.call("127.0.0.1:1", pb.ReshardRequest.COMMIT, round=7)
        assert coordinator.retries == 2  # a refusal is the shard's answer: not sent again
        assert refusal.value.refused and "refused again" in reshard_cmd.error_hint(refusal.value)
    finally:
        coordinator.close()


def test_the_hint_after_no_answer_says_a_rerun_resumes_and_after_a_refusal_that_it_is_refused_again(monkeypatch):
    clock = iter([0.0] + [reshard_cmd.CALL_RETRY_SECONDS] * 10)  # a fake clock: the retry window spent at once
    monkeypatch.setattr(reshard_cmd.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(reshard_cmd.time, "sleep", lambda s: None)
    monkeypatch.setattr(reshard_cmd.stubs, "stub", lambda channel: SimpleNamespace(
        Reshard=lambda request, timeout, metadata=None: (_ for _ in ()).throw(_NoAnswer(grpc.StatusCode.UNAVAILABLE))))
    coordinator = reshard_cmd.Coordinator(["127.0.0.1:1"], ["127.0.0.1:1", "127.0.0.1:2"], say=lambda line: None)
    try:
        with pytest.raises(reshard_cmd.CoordinatorError, match="answered PREPARE with UNAVAILABLE") as lost:
            coordinator.call("127.0.0.1:1", pb.ReshardRequest.PREPARE)
        assert not lost.value.refused
        assert reshard_cmd.error_hint(lost.value).startswith("run the same command again to resume")
        assert not reshard_cmd.error_hint(reshard_cmd.CoordinatorError("x", refused=True)).startswith("run the same")
    finally:
        coordinator.close()


def test_retire_waits_for_round_r_in_the_new_layout_and_after_its_wait_retires_anyway_saying_so(monkeypatch):
    version = {"127.0.0.1:1": 5, "127.0.0.1:2": 5}  # R = 5: round R not closed in the new layout yet
    status = []

    def reshard(request, timeout, metadata=None):
        status.append(request.op)
        return pb.ReshardReply(round=5, version=version[request.you], plan=request.plan, handoffs=[
            pb.HandoffState(phase="source:handed")], followed=version[request.you] > 5)  # a sync shard's rule

    monkeypatch.setattr(reshard_cmd.stubs, "stub", lambda channel: SimpleNamespace(Reshard=reshard))
    monkeypatch.setattr(reshard_cmd.time, "sleep", lambda s: version.update({a: 6 for a in version}))  # a round
    lines = []
    coordinator = reshard_cmd.Coordinator(["127.0.0.1:1"], ["127.0.0.1:1", "127.0.0.1:2"], say=lines.append,
                                          retire_wait=60)
    try:
        replies = coordinator.call_all(pb.ReshardRequest.STATUS)
        assert not coordinator.closed_in_new_layout(replies)
        coordinator.before_retire(replies)  # polls until both new shards are past R (one poll here)
        assert coordinator.closed_in_new_layout(coordinator.call_all(pb.ReshardRequest.STATUS)) and lines == []
        version.update({a: 5 for a in version})
        monkeypatch.setattr(reshard_cmd.time, "sleep", lambda s: None)  # round R never closes: a job ended at R
        coordinator.retire_wait = 1e-9
        coordinator.before_retire(replies)
        assert lines[-1].startswith("retiring anyway: waited 1e-09 s for round 5 to close in the new layout")
    finally:
        coordinator.close()


def test_shards_are_prepared_after_the_shards_they_stream_to():
    """A prepared shard's sources stream at once; one that reached a shard not prepared yet was refused
    PERMISSION_DENIED ("holds plan None") and sent again -- a refusal and warnings in every normal grow."""
    grow = reshard_cmd.Coordinator(["a:1", "b:1"], ["a:1", "b:1", "c:1"], say=lambda line: None)
    drain = reshard_cmd.Coordinator(["a:1", "b:1", "c:1"], ["a:1", "b:1"], say=lambda line: None)
    try:
        assert grow.prepare_order() == ["c:1", "b:1", "a:1"]  # old shard i sends to new shard i + 1
        assert drain.prepare_order() == ["a:1", "b:1", "c:1"]  # ... to new shard i - 1
    finally:
        grow.close()
        drain.close()
