"""Async steps with a window of pushes in flight (connect(push_window=W)), against real shards on loopback:
every push applied exactly once, flush waits for all of them, a lost reply is a duplicate, refusals name why."""

import grpc
import pytest
import torch

from trainer import connect
from trainer.stepping.attempt import StepFailed
from tests.helpers import wait_until
from tests.integration.switchproxy import SwitchProxy

N = 1000


class Vec(torch.nn.Module):
    def __init__(self, n: int = N):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(n, dtype=torch.float32))  # integers: every update exact


def grad(step: int) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) % 7 - 3 + step


def applied(servers) -> list[int]:
    return [s.stats().counters.get("pushes_applied", 0) for s in servers]


def test_async_window_of_four_applies_every_push_exactly_once_and_flush_waits_for_all(shard_server):
    servers = [shard_server(shard=i) for i in range(2)]
    model = Vec()
    init = model.w.detach().clone()
    total = torch.zeros(N)
    ps = connect(",".join(s.server.address for s in servers), model, mode="async", push_window=4,
                 optimizer={"name": "sgd", "lr": 1.0})
    try:
        for step in range(12):
            model.w.grad = grad(step)
            ps.step(num_samples=2)
            total += grad(step)
            assert ps.windowed.window.in_flight <= 3  # step() returned with at most W-1 unacknowledged
        ps.flush()
        assert ps.windowed.window.in_flight == 0
        assert ps.windowed.window.stats.submitted == 12 and applied(servers) == [12, 12]  # sent == applied
        assert ps.versions == [12, 12] == [s.stats().version for s in servers]  # the newest weights installed
        assert torch.equal(model.w.detach(), init - total)
        assert ps.counters["window_pushes_in_flight"] == 0 and ps.counters["window_pushes_in_flight_max"] >= 1
    finally:
        ps.close()
    assert all(s.stats().counters.get("duplicates", 0) == 0 for s in servers)


def test_a_window_of_one_is_todays_step_its_push_acknowledged_before_step_returns(shard_server):
    server = shard_server()
    model = Vec()
    with connect(server.server.address, model, mode="async", push_window=1,
                 optimizer={"name": "sgd", "lr": 1.0}) as ps:
        assert ps.windowed is None
        model.w.grad = grad(0)
        ps.step()
        assert applied([server]) == [1] and ps.versions == [1]


@pytest.fixture
def windowed_behind_a_proxy(shard_server):
    """(shard 0, shard 1, a proxy in front of shard 1, an async W=4 trainer connected through it)."""
    s0, s1 = shard_server(0), shard_server(1)
    proxy = SwitchProxy(s1.server.address)
    model = Vec()
    ps = connect(f"{s0.server.address},{proxy.address}", model, mode="async", push_window=4,
                 optimizer={"name": "sgd", "lr": 1.0}, round_timeout=2, retry_budget=3)
    try:
        yield s0, s1, proxy, ps, model
    finally:
        ps.close(best_effort=True)
        proxy.close()


def test_a_windowed_push_whose_reply_was_lost_is_retried_under_its_number_and_applied_once(
        windowed_behind_a_proxy):
    s0, s1, proxy, ps, model = windowed_behind_a_proxy
    init = model.w.detach().clone()
    proxy.swallow_replies()  # shard 1 applies the push; its answer never arrives
    model.w.grad = grad(0)
    ps.step()  # returns at once: the push is in flight
    wait_until(lambda: applied([s1]) == [1], "shard 1 to apply the push whose reply is swallowed")
    proxy.forward()  # the connection that lost bytes is reset: the push is sent again, same number
    for step in range(1, 4):
        model.w.grad = grad(step)
        ps.step()
    ps.flush()
    assert applied([s0, s1]) == [4, 4] and s1.stats().counters["duplicates"] >= 1
    assert s0.stats().counters.get("duplicates", 0) == 0
    assert torch.equal(model.w.detach(), init - sum(grad(k) for k in range(4)))


def test_a_windowed_push_that_failed_for_good_is_raised_kept_and_retried_by_the_next_step(
        windowed_behind_a_proxy):
    s0, s1, proxy, ps, model = windowed_behind_a_proxy
    init = model.w.detach().clone()
    proxy.refuse()
    model.w.grad = grad(0)
    ps.step()
    with pytest.raises(StepFailed) as e:
        ps.flush()  # the retry budget ran out: the push stays in the window
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and ps.windowed.pending() and e.value.applied == [0]
    assert applied([s0, s1]) == [1, 0]
    with pytest.raises(RuntimeError, match="while a failed step waits"):
        ps.zero_grad()
    proxy.forward()
    model.w.grad = grad(1)
    ps.step()  # retries the failed push under its number first
    ps.flush()
    assert applied([s0, s1]) == [2, 2] and s0.stats().counters.get("duplicates", 0) == 0  # shard 0 not asked again
    assert torch.equal(model.w.detach(), init - grad(0) - grad(1))


@pytest.mark.parametrize("kw,message", [
    (dict(mode="sync"), r"push_window 4 needs mode async \(or async tables\), not sync"),
    (dict(mode="stale-timeout", sync_timeout=1.0),
     r"push_window 4 needs mode async \(or async tables\), not stale-timeout"),
    (dict(mode="async", max_staleness=2), "push_window is 4 but max_staleness is 2: .* at most max_staleness "
                                          r"\+ 1 = 3"),
    (dict(mode="async", overlap=True), "push_window 4 does not go with overlap"),
    (dict(mode="async", compress="topk:0.1"), "push_window 4 does not go with compress"),
])
def test_a_window_that_cannot_hold_is_refused_before_connecting(kw, message):
    with pytest.raises(ValueError, match=message):
        connect("127.0.0.1:1", Vec(3), push_window=4, **kw)


def test_a_window_beyond_the_shards_limit_is_refused_naming_both():
    with pytest.raises(ValueError, match="push_window is 65 but must be 1 to 64"):
        connect("127.0.0.1:1", Vec(3), mode="async", push_window=65)


def test_a_shard_killed_and_restored_under_a_window_of_pushes_applies_none_twice(tmp_path):
    """kill -9 with pushes about to be in flight, --restore on the same port: every push the shard holds was
    applied once (its version counts them, the weights are the sum of exactly those), none lost unlogged."""
    from trainer.local.procs import start_shard

    args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    shard = start_shard(0, tmp_path / "shard0.log", extra_args=args)
    procs = [shard]
    model = Vec()
    init = model.w.detach().clone()
    ps = connect(shard.address, model, mode="async", push_window=4, optimizer={"name": "sgd", "lr": 1.0},
                 retry_budget=60)
    try:
        for step in range(3):
            model.w.grad = grad(step)
            ps.step()
        ps.flush()
        wait_until(lambda: (tmp_path / "ckpt" / f"shard0-v{3:012d}.ckpt").exists(), "the checkpoint of version 3")
        shard.kill()
        for step in range(3, 6):  # the shard is down: these wait in the window, retried under their numbers
            model.w.grad = grad(step)
            ps.step()
        procs.append(start_shard(0, tmp_path / "shard0-restarted.log", port=int(shard.address.rsplit(":", 1)[1]),
                                 extra_args=args + ["--restore"]))
        ps.flush()
        stats = ps.shard_stats()[0]
        lost = ps.counters.get("steps_lost", 0)
        assert stats.version == 6 - lost and ps.versions == [stats.version]
        assert stats.counters.get("duplicates", 0) == 0
        applied_grads = [grad(k) for k in range(6)]
        if lost == 0:  # the restored shard still knew the trainer: every push applied exactly once
            assert torch.equal(model.w.detach(), init - sum(applied_grads))
    finally:
        ps.close(best_effort=True)
        for p in procs:
            p.kill()
