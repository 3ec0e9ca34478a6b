"""The hot standby's role decisions (psserver.replication.roles) against a store with etcd's transaction and lease
semantics and a fake clock: who may become primary, when a standby may be promoted, and that a replaced primary
can change nothing.  (tests/cluster/test_standby.py runs the same rules against a real etcd.)"""

from __future__ import annotations

import pytest

from psserver.replication.roles import ABSENT, Roles


class FakeEtcd:
    """Keys, leases that expire on a fake clock, and all-or-nothing compare-then-write transactions."""

    def __init__(self):
        self.now = 0.0
        self.keys: dict[str, tuple[str, int | None]] = {}  # key -> (value, lease id)
        self.leases: dict[int, tuple[float, float]] = {}  # id -> (ttl, expires at)
        self.next_lease = 1

    def expire(self) -> None:
        gone = {i for i, (_, at) in self.leases.items() if at <= self.now}
        for i in gone:
            del self.leases[i]
        self.keys = {k: v for k, v in self.keys.items() if v[1] is None or v[1] in self.leases}

    def client(self) -> "FakeClient":
        return FakeClient(self)


class FakeClient:
    """One replica's connection: ``Store`` over FakeEtcd, holding this replica's lease."""

    def __init__(self, etcd: FakeEtcd):
        self.etcd, self.lease = etcd, None

    def read(self, prefix):
        self.etcd.expire()
        return {k: v for k, (v, _) in self.etcd.keys.items() if k.startswith(prefix)}

    def txn(self, compares, puts, deletes=()):
        self.etcd.expire()
        for key, expected in compares:
            found = self.etcd.keys.get(key)
            if (found is not None) if expected is ABSENT else (found is None or found[0] != expected):
                return False
        if any(leased for _, _, leased in puts) and self.lease not in self.etcd.leases:
            raise RuntimeError("lease not found")  # etcd refuses a put on an expired lease
        for key, value, leased in puts:
            self.etcd.keys[key] = (value, self.lease if leased else None)
        for key in deletes:
            self.etcd.keys.pop(key, None)
        return True

    def grant(self, ttl):
        self.lease = self.etcd.next_lease
        self.etcd.next_lease += 1
        self.etcd.leases[self.lease] = (ttl, self.etcd.now + ttl)

    def refresh(self):
        self.etcd.expire()
        if self.lease not in self.etcd.leases:
            return False
        ttl, _ = self.etcd.leases[self.lease]
        self.etcd.leases[self.lease] = (ttl, self.etcd.now + ttl)
        return True

    def revoke(self):
        self.etcd.leases.pop(self.lease, None)
        self.etcd.expire()


@pytest.fixture
def etcd():
    return FakeEtcd()


def replica(etcd: FakeEtcd, name: str, ttl: float = 2.0) -> Roles:
    store = etcd.client()
    store.grant(ttl)
    return Roles(store, "job", 0, name)


def tick(etcd: FakeEtcd, seconds: float, *alive: Roles) -> None:
    """``seconds`` pass; the ``alive`` replicas renew their leases every half second (the others do not)."""
    for _ in range(int(seconds * 2)):
        etcd.now += 0.5
        for r in alive:
            assert r.store.refresh()


def test_only_the_first_replica_of_a_shard_starts_as_primary(etcd):
    a, b = replica(etcd, "a"), replica(etcd, "b")
    assert a.start_fresh()
    assert not b.start_fresh()
    record = b.read()
    assert (record.epoch, record.primary, record.in_sync) == (1, "a", "")


def test_a_standby_is_promoted_only_once_the_primary_is_gone_and_only_if_it_is_in_sync(etcd):
    a, b = replica(etcd, "a"), replica(etcd, "b")
    a.start_fresh()
    b.offer_standby("127.0.0.1:9")
    assert not b.promote(1)  # not in sync: it may not hold what the primary acknowledged
    assert a.set_in_sync(1, "b")
    assert not b.promote(2)  # in sync, but the primary's lease lives
    tick(etcd, 5, a, b)
    assert not b.promote(2)  # renewed: still alive
    tick(etcd, 2.5, b)  # the primary stops renewing (killed, paused, cut off)
    assert b.read().primary is None
    assert not b.promote(1)  # the epoch of an older state than the one etcd names
    assert b.promote(2)
    record = b.read()
    assert (record.epoch, record.primary, record.in_sync, record.standby) == (3, "b", "", None)


def test_a_replaced_primary_can_neither_mark_nor_drop_a_standby(etcd):
    a, b = replica(etcd, "a"), replica(etcd, "b")
    a.start_fresh()
    a.set_in_sync(1, "b")
    tick(etcd, 3, b)
    assert b.promote(2)
    assert not a.set_in_sync(2, "")  # its epoch is gone
    assert not a.set_in_sync(3, "")  # and at the new epoch it is not the primary
    assert b.read().epoch == 3


def test_a_dropped_standby_cannot_be_promoted_with_the_state_it_holds(etcd):
    """The primary dropped it (it stopped answering) and answered alone afterwards: its state is older."""
    a, b = replica(etcd, "a"), replica(etcd, "b")
    a.start_fresh()
    a.set_in_sync(1, "b")
    assert a.set_in_sync(2, "")  # dropped: epoch 3, nobody in sync
    tick(etcd, 3, b)
    assert not b.promote(2) and not b.promote(3)
    assert b.read().primary is None


def test_a_replica_restored_from_its_checkpoint_takes_over_only_while_no_standby_is_in_sync(etcd):
    a, b, c = replica(etcd, "a"), replica(etcd, "b"), replica(etcd, "c")
    a.start_fresh()
    a.set_in_sync(1, "b")
    tick(etcd, 3, b, c)
    assert not c.take_over_restored(2)  # b holds the newest state: it must be promoted, not passed over
    assert b.promote(2)
    tick(etcd, 3, c)  # b dies alone
    assert c.take_over_restored(3)
    assert c.read().primary == "c"


def test_a_standby_offer_lapses_with_its_lease(etcd):
    a, b = replica(etcd, "a"), replica(etcd, "b")
    a.start_fresh()
    b.offer_standby("127.0.0.1:9")
    assert a.read().standby == ("b", "127.0.0.1:9")
    tick(etcd, 2.5, a)
    assert a.read().standby is None


def test_a_standby_takes_over_from_a_dead_primary_only_while_that_primary_is_still_the_one_named(etcd):
    """``take_over`` (a primary whose port refuses connections) compares the primary's whole key: it cannot
    displace a primary that changed meanwhile, and it needs the standby in sync at the epoch it names."""
    a = Roles(etcd.client(), "job", 0, "a", address="127.0.0.1:1")
    a.store.grant(2)
    b, c = replica(etcd, "b"), replica(etcd, "c")
    a.start_fresh()
    assert b.read().primary_value == "a 127.0.0.1:1" and b.read().primary_address == "127.0.0.1:1"
    assert not b.take_over(1, "a 127.0.0.1:1")  # not in sync
    a.set_in_sync(1, "b")
    assert not c.take_over(2, "a 127.0.0.1:1")  # in sync is b
    assert not b.take_over(2, "x 127.0.0.1:9")  # another primary than the one found dead
    assert b.take_over(2, "a 127.0.0.1:1")
    record = c.read()
    assert (record.epoch, record.primary, record.in_sync) == (3, "b", "")
    assert not a.set_in_sync(3, "")  # the displaced primary, were it alive, can change nothing


def test_only_the_primary_marks_the_job_done_and_every_replica_reads_it(etcd):
    a, b = replica(etcd, "a"), replica(etcd, "b")
    a.start_fresh()
    b.offer_standby("127.0.0.1:9")
    assert b.read().done is None
    assert not b.mark_done(7)  # a standby cannot say the job is done
    assert b.read().done is None
    assert a.mark_done(9)
    tick(etcd, 2.5, b)  # the primary leaves (its lease lapses or is revoked)
    record = b.read()
    assert (record.done, record.primary) == (9, None)
    assert replica(etcd, "c").read().done == 9  # a replica started later reads it too


def _replica_on(etcd: FakeEtcd, lease_seconds: int = 1):
    import threading
    from types import SimpleNamespace

    from psserver.replication.replica import Replica, ReplicaOptions

    cfg = SimpleNamespace(shard=0, host="127.0.0.1", port=7000)
    r = Replica(cfg, ReplicaOptions(etcd="etcd:2379", replica="b", job="job", lease_seconds=lease_seconds),
                store=etcd.client(), server_factory=lambda *a, **k: None)
    r._first_lease(threading.Event())
    r.standby = SimpleNamespace(port=7100)
    return r


def test_a_standby_whose_lease_lapsed_while_it_started_offers_itself_on_a_new_lease(etcd):
    r = _replica_on(etcd)
    first = r.store.lease
    etcd.now += 1.5  # the machine was loaded: the optimizers' warm-up outlived the 1 s lease
    r._offer_standby()
    assert r.store.lease != first and r.roles.read().standby == ("b", "127.0.0.1:7100")
    etcd.now += 0.5
    assert r.store.refresh()  # the offer is on the lease the replica renews
    etcd.now += 0.5
    assert r.roles.read().standby == ("b", "127.0.0.1:7100")


def test_a_standby_offer_refused_on_a_live_lease_is_not_retried_on_a_new_one(etcd):
    r = _replica_on(etcd)
    first = r.store.lease

    def refused(*_):
        raise RuntimeError("etcd refused the transaction")

    r.store.txn = refused
    with pytest.raises(RuntimeError, match="refused"):
        r._offer_standby()
    assert r.store.lease == first
