"""A joiner started before the job: which failed Register attempts it waits out (trainer.channels.client.register_retry),
and that a ShardClient's registrar (trainer.channels.registering.Registrar.register) counts the waits and names
rank 0 when --connect-timeout runs out -- with a fake stub, no network."""

from collections import Counter

import grpc
import pytest

from psserver.protocol.errors import JOB_ENDED, NO_JOB, REASON_METADATA_KEY
from tests.conftest import make_spec
from trainer.channels.client import CONNECT_RETRY, JOB_OVER, JOIN_WAIT, JobEnded, NoJobToJoin, ShardClient, register_retry


class FakeError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "", reason: str = ""):
        self._code, self._details = code, details
        self._trailers = ((REASON_METADATA_KEY, reason),) if reason else ()

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers


NO_JOB_YET = FakeError(grpc.StatusCode.FAILED_PRECONDITION, "shard 0 runs no job to join", NO_JOB)


def test_an_admission_that_finds_no_job_waits():
    assert register_retry(NO_JOB_YET, join=True, join_round=0) == JOIN_WAIT


ENDED = FakeError(grpc.StatusCode.FAILED_PRECONDITION, "shard 0's job ended", JOB_ENDED)


def test_an_admission_that_finds_the_job_ended_is_not_waited_out():
    assert register_retry(ENDED, join=True, join_round=0) == JOB_OVER


def test_a_plain_register_or_a_commit_does_not_read_the_job_ended_reason():
    assert register_retry(ENDED, join=False, join_round=0) == ""
    assert register_retry(ENDED, join=True, join_round=5) == ""


def test_a_commit_that_finds_no_job_is_raised_the_shard_restarted_since_admitting_it():
    assert register_retry(NO_JOB_YET, join=True, join_round=5) == ""


def test_a_plain_register_never_waits_on_the_no_job_reason():
    assert register_retry(NO_JOB_YET, join=False, join_round=0) == ""


def test_a_failed_precondition_without_the_reason_is_raised():
    assert register_retry(FakeError(grpc.StatusCode.FAILED_PRECONDITION, "max_trainers is 0"), True, 0) == ""


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_shard_not_answering_is_a_connect_retry(code):
    assert register_retry(FakeError(code), join=True, join_round=0) == CONNECT_RETRY


class FakeStub:
    """Refuses ``refusals`` Registers with ``error``, then answers."""

    def __init__(self, error, refusals: int):
        self.error, self.left, self.calls = error, refusals, 0

    def Register(self, req, timeout):  # noqa: N802 -- the gRPC method's name
        self.calls += 1
        if self.left:
            self.left -= 1
            raise self.error
        return "registered"


def client(stub) -> ShardClient:
    c = ShardClient("127.0.0.1:1", 0, 0, "joiner", "fp", Counter())
    c.registrar.stub = stub  # its Register calls answered by the fake
    return c


def test_register_waits_out_no_job_refusals_and_counts_each(monkeypatch):
    monkeypatch.setattr("trainer.channels.registering.CONNECT_RETRY_PAUSE", 0.0)  # the pause only paces; no timing asserted
    c = client(FakeStub(NO_JOB_YET, refusals=3))
    try:
        spec = make_spec(num_trainers=1, max_trainers=3)
        assert c.registrar.register(spec, connect_timeout=600, join=True) == "registered"
    finally:
        c.channel.close()
    assert c.calls.counters["join_waits"] == 3 and c.calls.counters["connect_retries"] == 0


def test_register_gives_up_after_the_connect_timeout_naming_rank_0():
    c = client(FakeStub(NO_JOB_YET, refusals=1))
    try:
        with pytest.raises(NoJobToJoin, match=r"still ran no job to join after 0 s \(--connect-timeout\): "
                                              r"start the job's rank 0"):
            c.registrar.register(make_spec(num_trainers=1, max_trainers=3), connect_timeout=0, join=True)
    finally:
        c.channel.close()


def test_a_plain_register_raises_the_no_job_refusal_at_once():
    stub = FakeStub(NO_JOB_YET, refusals=1)
    c = client(stub)
    try:
        with pytest.raises(FakeError):
            c.registrar.register(make_spec(), connect_timeout=600)
    finally:
        c.channel.close()
    assert stub.calls == 1


def test_register_stops_at_once_with_job_ended_when_the_job_is_over():
    stub = FakeStub(ENDED, refusals=1)
    c = client(stub)
    try:
        with pytest.raises(JobEnded, match="shard 0 at 127.0.0.1:1: shard 0's job ended"):
            c.registrar.register(make_spec(num_trainers=1, max_trainers=3), connect_timeout=600, join=True)
    finally:
        c.channel.close()
    assert stub.calls == 1 and c.calls.counters["job_ended"] == 1 and c.calls.counters["join_waits"] == 0


def test_an_admission_held_back_by_its_hosts_strikes_is_waited_out_and_nothing_else_is():
    """(psserver.members.epochs.PeerStrikes: a host whose earlier joins expired unsettled waits before its next
    admission; a joiner on it waits that out within --connect-timeout instead of failing.)"""
    from psserver.protocol.errors import JOIN_BACKOFF
    from trainer.channels.registering import JOIN_BACKOFF as WAIT

    held = FakeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "peer '127.0.0.1' left 1 join(s) ...", JOIN_BACKOFF)
    assert register_retry(held, join=True, join_round=0) == WAIT
    assert register_retry(held, join=True, join_round=5) == ""  # a commit is not held back: raised
    full = FakeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the job has 4 joins pending")
    assert register_retry(full, join=True, join_round=0) == ""
