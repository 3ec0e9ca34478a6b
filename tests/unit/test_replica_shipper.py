"""The primary's barrier and shipments (psserver.replication.shipper) against a fake standby and fake etcd: no
reply passes the barrier before a shipment captured after it was acknowledged; replies woken together share
one shipment; a standby that stops answering is dropped in etcd before the waiting replies go on; a refused
shipment fences the primary."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from psserver.replication.shipper import ALONE, CATCHING_UP, FENCED, REPLICATED, Replicator


class FakeRoles:
    def __init__(self):
        self.calls, self.answer = [], True

    def set_in_sync(self, epoch, standby):
        self.calls.append((epoch, standby))
        return self.answer

    def read(self):  # (the watcher thread is not started in these tests)
        raise AssertionError


class FakeRuntime:
    async def offload(self, fn, *args):
        return fn(*args)


class FakeStandby:
    """Ship answers as ``self.next`` says: "ack", "refuse", "down"; or waits on ``gate`` first."""

    def __init__(self):
        self.shipped, self.next, self.gate = [], "ack", None

    async def close(self):
        pass

    async def Ship(self, request, timeout=None, metadata=None):
        if self.gate is not None:
            await self.gate.wait()
        if self.next == "refuse":
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, None, None, "fenced: epoch")
        if self.next == "down":
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "connection refused")
        self.shipped.append((request.epoch, request.shipment, list(request.states)))


def read_counters(state: dict) -> int:
    if state.get("capture_fails"):
        raise RuntimeError("a bug in the capture")
    return state.get("read_counters", 0)


def make(state: dict):
    loop = asyncio.get_running_loop()
    standby, roles, fenced, counts = FakeStandby(), FakeRoles(), [], {}

    def count(name, n=1):
        counts[name] = counts.get(name, 0) + n

    r = Replicator(shard=0, job="j", me="a", epoch=1, roles=roles, runtime=FakeRuntime(), loop=loop,
                   capture=lambda since: ([str(state["v"]).encode()], [], False), count=count, poll=0.01,
                   fence=lambda shard, why: fenced.append(why), connect=lambda address: (standby, standby),
                   exposed=lambda: read_counters(state))
    r._task = loop.create_task(r._ship_loop())
    return r, standby, roles, fenced, counts


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    """Poll ``predicate`` on the loop (an etcd transaction runs on a thread: loop turns alone do not wait for it)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"not {what} within {timeout} s")
        await asyncio.sleep(0.005)


async def replicated(r, standby):
    r._adopt(("b", "127.0.0.1:9"))
    assert r.mode == CATCHING_UP
    await until(lambda: r.mode == REPLICATED and standby.shipped and standby.shipped[-1][0] == r.epoch,
                "replicated (a shipment of the new epoch acknowledged)")


def run(coro):
    asyncio.run(coro)


def test_alone_the_barrier_lets_replies_go_at_once():
    async def go():
        r, *_ = make({"v": 0})
        assert r.mode == ALONE
        await asyncio.wait_for(r.barrier(), 1)
    run(go())


def test_catch_up_marks_the_standby_in_sync_and_ships_again_under_the_new_epoch():
    async def go():
        state = {"v": 5}
        r, standby, roles, _, counts = make(state)
        await replicated(r, standby)
        assert roles.calls == [(1, "b")]
        assert [(e, n) for e, n, _ in standby.shipped] == [(1, 1), (2, 2)]
        assert counts["replica_catch_ups"] == 1
    run(go())


def test_a_reply_waits_for_a_shipment_that_holds_its_change():
    async def go():
        state = {"v": 1}
        r, standby, *_ = make(state)
        await replicated(r, standby)
        standby.gate = asyncio.Event()
        state["v"] = 2  # the call's change, then its reply reaches the barrier
        waiting = asyncio.ensure_future(r.barrier())
        for _ in range(10):
            await asyncio.sleep(0)
        assert not waiting.done()  # the standby has not acknowledged
        standby.gate.set()
        await asyncio.wait_for(waiting, 1)
        assert standby.shipped[-1][2] == [b"2"]
    run(go())


def test_replies_that_reach_the_barrier_together_share_one_shipment():
    async def go():
        state = {"v": 1}
        r, standby, *_ = make(state)
        await replicated(r, standby)
        before = len(standby.shipped)
        state["v"] = 2
        await asyncio.wait_for(asyncio.gather(*(r.barrier() for _ in range(8))), 1)
        assert len(standby.shipped) == before + 1
    run(go())


def test_a_standby_that_stops_answering_is_dropped_in_etcd_before_the_waiting_replies_go():
    async def go():
        r, standby, roles, fenced, counts = make({"v": 1})
        await replicated(r, standby)
        standby.next = "down"
        await asyncio.wait_for(r.barrier(), 1)
        assert roles.calls == [(1, "b"), (2, "")]  # dropped under the epoch it was in sync at
        assert (r.mode, r.epoch, r.standby, fenced) == (ALONE, 3, None, [])
        assert counts["replica_standby_lost"] == 1
    run(go())


@pytest.mark.parametrize("how", ["refuse", "etcd"])
def test_a_primary_that_was_replaced_is_fenced_and_its_reply_never_goes(how):
    """Refused by the standby (a newer epoch), or its drop refused by etcd (no longer primary)."""
    async def go():
        r, standby, roles, fenced, _ = make({"v": 1})
        await replicated(r, standby)
        if how == "refuse":
            standby.next = "refuse"
        else:
            standby.next, roles.answer = "down", False
        waiting = asyncio.ensure_future(r.barrier())
        await until(lambda: r.mode == FENCED, "fenced")
        assert len(fenced) == 1
        assert not waiting.done()  # (the real fence ends the process here)
        waiting.cancel()
    run(go())


def test_with_a_lag_replies_go_at_once_while_the_standby_is_close_behind_and_wait_past_it():
    """``--replica-lag 1``: a reply does not wait for the shipment of its own change, only for the one before."""
    async def go():
        state = {"v": 1}
        r, standby, *_ = make(state)
        r.lag = 1
        await replicated(r, standby)
        standby.gate = asyncio.Event()  # the standby stops acknowledging for a while
        state["v"] = 2
        await asyncio.wait_for(r.barrier(), 1)  # one behind: goes at once (a shipment is started for it)
        for _ in range(10):
            await asyncio.sleep(0)
        state["v"] = 3
        waiting = asyncio.ensure_future(r.barrier())  # two behind: waits
        for _ in range(10):
            await asyncio.sleep(0)
        assert not waiting.done()
        standby.gate.set()
        await asyncio.wait_for(waiting, 1)
    run(go())


def test_with_require_standby_no_reply_goes_before_a_standby_in_sync_holds_its_change():
    """``--require-standby``: alone and while catching up a reply waits; once in sync it goes with the first
    shipment that holds its change; a standby lost puts the waiting replies back to waiting for the next one."""
    async def go():
        state = {"v": 1}
        r, standby, roles, _, _ = make(state)
        r.require = True
        assert r.gauges() == {"replica_unreplicated": 1.0, "replica_shipments_behind": 0.0}
        waiting = asyncio.ensure_future(r.barrier())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done() and standby.shipped == []  # alone: nobody holds the change
        await replicated(r, standby)
        await asyncio.wait_for(waiting, 1)
        assert r.gauges()["replica_unreplicated"] == 0.0
        standby.next = "down"
        state["v"] = 2
        waiting = asyncio.ensure_future(r.barrier())
        await until(lambda: r.mode == ALONE, "the standby dropped")
        assert r.mode == ALONE and roles.calls[-1] == (2, "") and not waiting.done()  # dropped: waits on
        assert r.gauges()["replica_unreplicated"] == 1.0
        standby.next = "ack"
        await replicated(r, standby)  # (the same fake comes back as the next standby: caught up again)
        await asyncio.wait_for(waiting, 1)
        assert standby.shipped[-1][2] == [b"2"]
    run(go())


def test_without_require_standby_an_unreplicated_shard_answers_and_says_so_in_its_gauge():
    async def go():
        r, standby, *_ = make({"v": 1})
        await asyncio.wait_for(r.barrier(), 1)
        assert r.gauges()["replica_unreplicated"] == 1.0
        await replicated(r, standby)
        assert r.gauges()["replica_unreplicated"] == 0.0
    run(go())


def test_a_read_whose_counters_have_not_moved_since_the_last_shipment_goes_at_once():
    async def go():
        state = {"v": 1}
        r, standby, _, _, counts = make(state)
        await replicated(r, standby)
        shipped = len(standby.shipped)
        await asyncio.wait_for(r.barrier(read=True), 1)
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(standby.shipped) == shipped  # no shipment for it
        assert counts["replica_reads_on_shipped"] == 1
    run(go())


def test_a_read_after_a_change_waits_for_a_shipment_that_holds_it():
    async def go():
        state = {"v": 1}
        r, standby, _, _, counts = make(state)
        await replicated(r, standby)
        standby.gate = asyncio.Event()
        state["v"], state["read_counters"] = 2, 1  # a push applied: what a read shows moved
        waiting = asyncio.ensure_future(r.barrier(read=True))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not waiting.done()
        standby.gate.set()
        await asyncio.wait_for(waiting, 1)
        assert standby.shipped[-1][2] == [b"2"]
        assert "replica_reads_on_shipped" not in counts
    run(go())


def test_a_read_whose_counters_match_a_shipment_under_way_waits_for_that_one_and_no_newer():
    async def go():
        state = {"v": 1}
        r, standby, _, _, counts = make(state)
        await replicated(r, standby)
        standby.gate = asyncio.Event()
        state["v"], state["read_counters"] = 2, 1
        push = asyncio.ensure_future(r.barrier())  # the push's reply: a shipment captured after its change
        await until(lambda: r.captured > r.acked, "the push's shipment captured")
        shipped = len(standby.shipped)
        read = asyncio.ensure_future(r.barrier(read=True))  # shows only what that capture holds
        for _ in range(10):
            await asyncio.sleep(0)
        assert not read.done() and not push.done()
        standby.gate.set()
        await asyncio.wait_for(asyncio.gather(push, read), 1)
        assert len(standby.shipped) == shipped + 1 and standby.shipped[-1][2] == [b"2"]
        assert counts["replica_reads_on_shipped"] == 1
    run(go())


def test_a_capture_that_fails_drops_the_standby_and_the_waiting_replies_go_on_unreplicated():
    async def go():
        state = {"v": 1}
        r, standby, roles, fenced, counts = make(state)
        await replicated(r, standby)
        state["capture_fails"] = True  # (the shipping task must not die with the replies waiting)
        await asyncio.wait_for(r.barrier(), 1)
        assert (r.mode, r.standby, fenced) == (ALONE, None, []) and roles.calls[-1] == (2, "")
        assert counts["replica_standby_lost"] == 1
    run(go())
