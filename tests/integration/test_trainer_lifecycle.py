"""Every way into and out of a trainer: a failed connect leaves nothing registered, ``with`` leaves on an
error, and a step that failed on some shards is retried without any shard applying it twice."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
import torch

from tests.helpers import wait_until
from tests.integration.switchproxy import SwitchProxy
from trainer.stepping.api import StartTimeout, StepFailed, connect
from trainer.channels.client import RefusalClock, Registrar, ShardUnreachable, on_loopback
from trainer.tools.procstat import free_port

LR = 0.1


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 1)


def backward(m: torch.nn.Module) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    m(x).pow(2).mean().backward()


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ps-heartbeat"]


def test_a_connect_that_fails_on_one_shard_leaves_the_shard_that_accepted_it(shard_server):
    good = shard_server(0)
    port = free_port()
    with pytest.raises(ShardUnreachable, match=f"shard 1 at 127.0.0.1:{port} did not answer within 2 s"):
        connect(f"{good.server.address},127.0.0.1:{port}", model(), connect_timeout=2)
    stats = good.stats()
    assert stats.counters["registrations"] == 1 and stats.counters["leaves"] == 1
    assert list(stats.live_ranks) == []
    assert heartbeat_threads() == []


def test_a_trainer_whose_peer_never_comes_logs_whom_it_waits_for_then_leaves(shard_server, caplog):
    s = shard_server(0)
    address = s.server.address
    caplog.set_level(logging.INFO, logger="trainer")
    with pytest.raises(StartTimeout) as e:
        connect(address, model(), num_trainers=2, connect_timeout=7)
    assert f"shard 0 at {address}" in str(e.value) and "ranks [1]" in str(e.value)
    waits = [r.getMessage() for r in caplog.records if "waiting to start" in r.getMessage()]
    assert waits and f"shard 0 at {address}" in waits[0] and "still waits for ranks [1] to register" in waits[0]
    assert list(s.stats().live_ranks) == [] and s.stats().counters["leaves"] == 1
    assert heartbeat_threads() == []


def test_a_with_block_leaves_the_job_when_its_body_raises(shard_server):
    s = shard_server(0)
    with pytest.raises(RuntimeError, match="boom"):
        with connect(s.server.address, model()) as ps:
            assert list(s.stats().live_ranks) == [0]
            raise RuntimeError("boom")
    assert list(s.stats().live_ranks) == [] and s.stats().counters["leaves"] == 1
    assert ps._closed and heartbeat_threads() == []


@pytest.fixture
def two_shards_one_behind_a_proxy(shard_server):
    """(shard 0, shard 1, a proxy in front of shard 1, an async trainer connected through it)."""
    s0, s1 = shard_server(0), shard_server(1)
    proxy = SwitchProxy(s1.server.address)
    m = model()
    ps = connect(f"{s0.server.address},{proxy.address}", m, mode="async", optimizer={"name": "sgd", "lr": LR},
                 round_timeout=2, retry_budget=3)
    try:
        yield s0, s1, proxy, ps
    finally:
        ps.close(best_effort=True)
        proxy.close()


def expected_after_one_step(ps) -> torch.Tensor:
    """One SGD step on the trainer's current flat gradient, as one process would take it."""
    ref = ps.flat.flat.detach().clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=LR)
    ref.grad = ps.flat.grad.clone()
    opt.step()
    return ref.detach()


def test_a_step_whose_acknowledgement_was_lost_is_retried_as_a_duplicate_and_applied_once(
        two_shards_one_behind_a_proxy):
    s0, s1, proxy, ps = two_shards_one_behind_a_proxy
    backward(ps.model)
    expected = expected_after_one_step(ps)
    proxy.swallow_replies()  # shard 1 gets the push and applies it; its answer never arrives
    with pytest.raises(StepFailed) as e:
        ps.step(num_samples=4)
    assert e.value.applied == [0] and list(e.value.failed) == [1]
    assert f"shard 1 at {proxy.address}" in str(e.value) and "shards [0] applied the gradient" in str(e.value)
    assert s1.stats().counters["pushes_applied"] == 1  # applied; the trainer just does not know it
    proxy.forward()
    info = ps.step(num_samples=4)
    assert info.outcomes == ["applied", "duplicate"]
    c0, c1 = s0.stats().counters, s1.stats().counters
    assert (c0["pushes_applied"], c1["pushes_applied"]) == (1, 1)
    assert c1["duplicates"] >= 1 and c0.get("duplicates", 0) == 0  # shard 0 was not asked again
    assert (s0.stats().version, s1.stats().version) == (1, 1)
    torch.testing.assert_close(ps.flat.flat, expected, rtol=0, atol=1e-6)
    assert float(ps.flat.grad.abs().sum()) == 0.0  # zeroed once the step completed


def test_a_step_that_found_a_shard_down_is_retried_on_that_shard_only(two_shards_one_behind_a_proxy):
    s0, s1, proxy, ps = two_shards_one_behind_a_proxy
    backward(ps.model)
    expected = expected_after_one_step(ps)
    proxy.refuse()
    with pytest.raises(StepFailed) as e:
        ps.step(num_samples=4)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.applied == [0]
    assert float(ps.flat.grad.abs().sum()) > 0  # the gradient is kept for the retry
    assert s1.stats().counters.get("pushes_applied", 0) == 0
    proxy.forward()
    info = ps.step(num_samples=4)
    assert info.outcomes == ["applied", "applied"]
    assert (s0.stats().counters["pushes_applied"], s1.stats().counters["pushes_applied"]) == (1, 1)
    torch.testing.assert_close(ps.flat.flat, expected, rtol=0, atol=1e-6)
    assert ps.counters["steps_failed"] == 1


def test_a_pending_failed_step_refuses_a_new_gradient_until_retried_or_abandoned(two_shards_one_behind_a_proxy):
    s0, s1, proxy, ps = two_shards_one_behind_a_proxy
    backward(ps.model)
    proxy.refuse()
    with pytest.raises(StepFailed):
        ps.step(num_samples=4)
    for call in (ps.zero_grad, lambda: ps.prepare_step(4)):
        with pytest.raises(RuntimeError, match="while a failed step waits: call step\\(\\) to retry it"):
            call()
    ps.abandon_step()  # shard 1 never got it; shard 0 keeps what it applied
    assert float(ps.flat.grad.abs().sum()) == 0.0 and ps.counters["steps_abandoned"] == 1
    proxy.forward()
    backward(ps.model)
    assert ps.step(num_samples=4).outcomes == ["applied", "applied"]  # a new step, new sequence numbers
    assert (s0.stats().counters["pushes_applied"], s1.stats().counters["pushes_applied"]) == (2, 1)


def test_an_interrupt_right_after_a_shard_answered_does_not_make_the_retry_apply_it_twice(
        two_shards_one_behind_a_proxy, monkeypatch):
    s0, s1, proxy, ps = two_shards_one_behind_a_proxy
    backward(ps.model)
    expected = expected_after_one_step(ps)
    shard0 = ps.client.shards[0]
    answered = shard0.dense.acknowledged

    def answered_then_interrupted(*args):
        answered(*args)
        raise KeyboardInterrupt  # Ctrl-C between the shard's answer and step() recording it

    monkeypatch.setattr(shard0.dense, "acknowledged", answered_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        ps.step(num_samples=4)
    monkeypatch.undo()
    assert ps.step(num_samples=4).outcomes == ["applied", "applied"]
    assert (s0.stats().counters["pushes_applied"], s1.stats().counters["pushes_applied"]) == (1, 1)
    assert s0.stats().counters.get("duplicates", 0) == 0  # not even pushed again
    torch.testing.assert_close(ps.flat.flat, expected, rtol=0, atol=1e-6)


class Interrupt(BaseException):
    """Stands in for ps-trainer's Interrupted (a signal on the connecting thread)."""


def register_then_interrupt(on_shard: int, before_raising=lambda: None):
    """A Registrar.register (a ShardClient's registering) that registers with shard ``on_shard`` for real, then
    is interrupted before the answer is handed back -- as a SIGTERM that lands while the reply is on its way."""
    real = Registrar.register

    def register(self, *args, **kwargs):
        reply = real(self, *args, **kwargs)
        if self.caller.index == on_shard:
            before_raising()
            raise Interrupt
        return reply
    return register


def test_an_interrupt_while_the_registers_answer_is_on_its_way_still_leaves_that_shard(shard_server, monkeypatch):
    s = shard_server(0)
    monkeypatch.setattr(Registrar, "register", register_then_interrupt(0))
    with pytest.raises(Interrupt) as e:
        connect(s.server.address, model(), num_trainers=2)
    assert list(s.stats().live_ranks) == [] and s.stats().counters["leaves"] == 1
    assert e.value.left and e.value.leave_outcome == "left the job (shard 0 answered its Leave)"


def test_an_interrupt_abandons_the_other_shards_attempts_and_names_only_the_shard_it_left(shard_server, monkeypatch):
    s = shard_server(0)
    monkeypatch.setattr(Registrar, "register", register_then_interrupt(0))
    with pytest.raises(Interrupt) as e:
        connect(f"{s.server.address},127.0.0.1:{free_port()}", model(), connect_timeout=600)
    assert list(s.stats().live_ranks) == [] and s.stats().counters["leaves"] == 1
    assert e.value.left and e.value.leave_outcome == "left the job (shard 0 answered its Leave)"


def test_an_interrupt_whose_leave_fails_says_it_could_not_leave_and_why(shard_server, monkeypatch):
    s = shard_server(0)
    address = s.server.address
    monkeypatch.setattr(Registrar, "register", register_then_interrupt(0, lambda: s.server.stop(grace=0)))
    with pytest.raises(Interrupt) as e:
        connect(address, model(), num_trainers=2)
    assert not e.value.left
    assert e.value.leave_outcome.startswith(f"could not leave shard 0 at {address} (UNAVAILABLE: ")


def test_connect_gives_up_on_a_refused_loopback_port_in_seconds_with_the_usual_error(shard_server):
    good, port = shard_server(0), free_port()
    t0 = time.monotonic()
    with pytest.raises(ShardUnreachable, match=f"shard 1 at 127.0.0.1:{port} did not answer within 2 s "
                                               r"\(every address is on loopback and it refuses connections"):
        connect(f"{good.server.address},127.0.0.1:{port}", model(), connect_timeout=600, refused_timeout=2)
    assert time.monotonic() - t0 < 300  # a generous bound: well before the 600 s connect timeout
    assert list(good.stats().live_ranks) == []


def test_refusals_give_up_only_in_a_row_and_only_with_a_limit():
    clock = RefusalClock(5.0)
    refused = "UNAVAILABLE: connection refused"
    assert not clock.exhausted(refused, 100.0) and not clock.exhausted(refused, 104.0)
    assert not clock.exhausted("no reply within 3 s", 104.5)  # it is there but slow: start again
    assert not clock.exhausted(refused, 105.0) and clock.exhausted(refused, 110.0)
    assert not RefusalClock(None).exhausted(refused, 1e9)


def test_only_an_all_loopback_job_is_given_up_on_early():
    assert on_loopback(["127.0.0.1:7000", "localhost:7001", "[::1]:7002"])
    assert not on_loopback(["127.0.0.1:7000", "10.0.0.2:7000"])


def test_a_trainer_waiting_for_a_peer_whose_register_was_refused_is_told_why(shard_server, caplog):
    s = shard_server(0)
    address = s.server.address
    caplog.set_level(logging.INFO, logger="trainer")
    out = {}

    def first():
        try:
            connect(address, model(), num_trainers=2, connect_timeout=8)
        except StartTimeout as e:
            out["error"] = e

    waiting = threading.Thread(target=first)
    waiting.start()
    try:
        wait_until(lambda: s.stats().counters.get("registrations", 0) == 1, "rank 0 to register")
        with pytest.raises(Exception, match="num_trainers is 3 but the job has 2"):  # its peer, with other flags
            connect(address, model(), rank=1, num_trainers=3, connect_timeout=3)
    finally:
        waiting.join(60)
    assert not waiting.is_alive()
    told = "still waits for ranks [1] to register; a Register as rank 1 was refused: "
    assert told in str(out["error"]) and "num_trainers is 3 but the job has 2" in str(out["error"])
    assert "after" not in str(out["error"]).split("still waits", 1)[1]  # no poll's seconds beside the 8 s it waited
