"""Who is primary for a shard: records in etcd, changed only by transactions that compare before they write.

Why etcd and compare-and-write: two replicas of a shard must never both believe they may acknowledge pushes.
etcd's consensus decides; this module only names the keys and the transactions.  Under the prefix
``/psgrpc/<job>/shard/<i>/``:

* ``epoch``   -- the replication epoch.  Every change of roles bumps it, in the same transaction as the change.
* ``primary`` -- "<id> <address>" of the primary (its shard port), attached to its lease: it vanishes when the
  primary stops renewing.
* ``in_sync`` -- the standby whose acknowledgement the primary waits for before it answers ("" for none).
* ``standby`` -- "<id> <address>" of a standby offering itself, attached to the standby's lease.
* ``done``    -- the version at which the primary left because the job was done (``ps-server --exit-when-done``):
  a standby, or a replica started after it, has nothing left to stand by for and leaves too.

The rules (docs/standby.md):

* A shard's first replica takes the primary role only while no ``epoch`` exists (``start_fresh``).
* A standby is promoted only while ``primary`` is gone, ``in_sync`` names it and ``epoch`` is the epoch of the
  last state it acknowledged (``promote``): the primary answered nothing it did not hold.  It may also take over
  from a primary whose port refuses connections (a dead process: ``take_over``), before its lease runs out --
  safe for the same reason: were that primary alive, its next shipment would be refused under the new epoch.
* A primary marks a standby in sync, or drops it, only while ``primary`` is still its own and ``epoch`` unchanged
  (``set_in_sync``); a failed transaction means it was replaced -- it is *fenced* and stops.
* A replica started with ``--restore`` takes over from its checkpoint only while no replica is in sync
  (``take_over_restored``): a standby that holds more would otherwise be passed over.

No clock decides anything here: a paused primary whose lease expired finds its standby promoted under a newer
epoch, and the standby refuses its shipments (psserver.replication.standby), so it can never complete an
acknowledgement.  ``Store`` is what the rules need of etcd; ``EtcdStore`` speaks to a real one and the unit tests
use a fake with a fake clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from psserver.protocol.security import split_host_port

log = logging.getLogger(__name__)

ABSENT = object()  # a compare that the key does not exist


@dataclass(frozen=True)
class Record:
    """One read of a shard's keys."""

    epoch: int | None  # None: no replica of this shard ever started
    primary: str | None  # the primary's replica id; None while no lease holds the key
    primary_address: str  # its shard port's HOST:PORT ("" if none)
    primary_value: str  # the key's whole value (what ``take_over`` compares)
    in_sync: str  # the standby the primary waits for ("" none)
    standby: tuple[str, str] | None  # (replica id, replication address) of a standby offering itself
    done: int | None = None  # the version the primary left at, the job done (None: not done)


class Store(Protocol):
    """What the rules need of etcd: a read of a prefix, a compare-then-write transaction, leases."""

    def read(self, prefix: str) -> dict[str, str]: ...

    def txn(self, compares: list[tuple[str, object]], puts: list[tuple[str, str, bool]],
            deletes: list[str] = ()) -> bool:
        """All ``compares`` (key, expected value or ABSENT) hold -> every put (key, value, on this replica's
        lease) and delete happens, atomically; returns whether they held."""

    def grant(self, ttl: int) -> None:
        """Take this replica's lease (``ttl`` seconds)."""

    def refresh(self) -> bool:
        """Renew the lease; False when etcd no longer has it (it expired)."""

    def revoke(self) -> None: ...


class Roles:
    """The transactions of one replica (``me``) of shard ``shard`` in job ``job``."""

    def __init__(self, store: Store, job: str, shard: int, me: str, address: str = ""):
        """``address``: this replica's shard port, published while it is primary."""
        self.store, self.me = store, me
        self.value = f"{me} {address}".strip()  # the primary key's value while this replica holds it
        self.prefix = f"/psgrpc/{job}/shard/{shard}/"

    def _key(self, name: str) -> str:
        return self.prefix + name

    def read(self) -> Record:
        kv = self.store.read(self.prefix)
        epoch = kv.get(self._key("epoch"))
        standby = kv.get(self._key("standby"))
        sid, _, address = (standby or "").partition(" ")
        primary = kv.get(self._key("primary"))
        pid, _, paddress = (primary or "").partition(" ")
        done = kv.get(self._key("done"))
        return Record(epoch=int(epoch) if epoch is not None else None, primary=pid if primary else None,
                      primary_address=paddress, primary_value=primary or "", in_sync=kv.get(self._key("in_sync"), ""),
                      standby=(sid, address) if standby else None, done=int(done) if done is not None else None)

    def start_fresh(self) -> bool:
        """The shard's first replica: primary at epoch 1, while no epoch exists."""
        return self.store.txn([(self._key("epoch"), ABSENT)],
                              [(self._key("epoch"), "1", False), (self._key("primary"), self.value, True),
                               (self._key("in_sync"), "", False)])

    def promote(self, epoch: int) -> bool:
        """This standby becomes primary at ``epoch + 1``: the primary is gone and this standby held every state
        it acknowledged in ``epoch``."""
        return self.store.txn([(self._key("epoch"), str(epoch)), (self._key("primary"), ABSENT),
                               (self._key("in_sync"), self.me)],
                              [(self._key("epoch"), str(epoch + 1), False), (self._key("primary"), self.value, True),
                               (self._key("in_sync"), "", False)], [self._key("standby")])

    def take_over(self, epoch: int, dead_primary: str) -> bool:
        """As ``promote``, from a primary still named (``dead_primary``: its key's value) whose process is gone."""
        return self.store.txn([(self._key("epoch"), str(epoch)), (self._key("primary"), dead_primary),
                               (self._key("in_sync"), self.me)],
                              [(self._key("epoch"), str(epoch + 1), False), (self._key("primary"), self.value, True),
                               (self._key("in_sync"), "", False)], [self._key("standby")])

    def take_over_restored(self, epoch: int) -> bool:
        """A replica restored from its checkpoint becomes primary: the primary is gone and no standby is in sync."""
        return self.store.txn([(self._key("epoch"), str(epoch)), (self._key("primary"), ABSENT),
                               (self._key("in_sync"), "")],
                              [(self._key("epoch"), str(epoch + 1), False), (self._key("primary"), self.value, True)])

    def set_in_sync(self, epoch: int, standby: str) -> bool:
        """The primary waits for ``standby`` from ``epoch + 1`` on ("" : for nobody); False: it was replaced."""
        return self.store.txn([(self._key("epoch"), str(epoch)), (self._key("primary"), self.value)],
                              [(self._key("epoch"), str(epoch + 1), False), (self._key("in_sync"), standby, False)])

    def mark_done(self, version: int) -> bool:
        """The job is done: the primary leaves at ``version`` (only while it is the primary)."""
        return self.store.txn([(self._key("primary"), self.value)], [(self._key("done"), str(version), False)])

    def offer_standby(self, address: str) -> None:
        """This replica is ready to be a standby, at ``address`` (its replication port), while its lease lives."""
        self.store.txn([], [(self._key("standby"), f"{self.me} {address}", True)])


class EtcdStore:
    """``Store`` over etcd's v3 API (the etcd3gw client: its JSON gateway, so no generated etcd stubs here)."""

    def __init__(self, endpoint: str, timeout: float = 2.0):
        import etcd3gw  # a job without standbys never imports it

        try:
            host, port = split_host_port(endpoint)
        except ValueError:
            raise ValueError(f"--etcd is {endpoint!r}: give HOST:PORT (e.g. 127.0.0.1:2379)") from None
        self.client = etcd3gw.client(host=host.strip("[]"), port=port, timeout=timeout)
        self.lease = None

    def read(self, prefix: str) -> dict[str, str]:
        return {meta["key"].decode(): value.decode() for value, meta in self.client.get_prefix(prefix)}

    def txn(self, compares, puts, deletes=()) -> bool:
        from etcd3gw.utils import _encode

        compare = []
        for key, expected in compares:
            if expected is ABSENT:
                compare.append({"key": _encode(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0})
            else:
                compare.append({"key": _encode(key), "result": "EQUAL", "target": "VALUE",
                                "value": _encode(expected)})
        success = []
        for key, value, leased in puts:
            put = {"key": _encode(key), "value": _encode(value)}
            if leased:
                put["lease"] = self.lease.id
            success.append({"request_put": put})
        success += [{"request_delete_range": {"key": _encode(key)}} for key in deletes]
        result = self.client.transaction({"compare": compare, "success": success, "failure": []})
        return bool(result.get("succeeded", False))

    def grant(self, ttl: int) -> None:
        self.lease = self.client.lease(ttl)

    def refresh(self) -> bool:
        return self.lease.refresh() > 0

    def revoke(self) -> None:
        if self.lease is not None:
            self.lease.revoke()
