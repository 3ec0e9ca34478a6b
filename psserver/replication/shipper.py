"""The primary's side of a shard's replication: no reply leaves the shard before its standby holds a state that
includes what the reply acknowledges.

Group commit: a reply that acknowledges something (a push applied, a round's weights, a registration -- every
data call but heartbeats and stats) waits at ``barrier`` for the first shipment whose capture begins after the
reply's own change.  A reply that only shows state (a pull) waits for the newest shipment captured if the
shard's read counters (ShardHost.exposed: the job, versions, members and epochs, evictions) have not moved
since that capture -- nothing it shows can be newer -- and as any other reply if they have.  One shipment at a
time: the state of every partition (what a checkpoint holds, open round and push books included), captured on
the state worker -- so it is one consistent moment of the shard -- and sent to the standby, which acknowledges
it.  A standby's first shipment is whole; each after it carries of the tables only the rows touched since the
one before and the dense slice as the steps taken since (psserver.replication.deltas; whole again after an
eviction, or when the standby lacks the one before).  Every reply waiting when it was captured goes out when
it is acknowledged: a sync round's replies share one shipment.

The modes: ``alone`` (no standby: replies go out at once, as without replication), ``catching_up`` (a standby
is taking its first state: replies still go out at once), ``replicated`` (replies wait for the standby), and
``fenced`` (a standby refused a shipment because a newer primary exists, or the lease is lost: the process stops
without a final checkpoint -- it can only come back as a standby).  A standby that stops answering is dropped
in etcd (a new epoch with nobody in sync) before a waiting reply goes out; if etcd cannot be reached to drop
it, the replies wait -- the standby might have been promoted.  With ``require`` (``--require-standby``) replies
never go out unreplicated: alone or catching up, they wait until a standby is in sync.  The ``replica_unreplicated``
gauge (GetStats, metrics) is 1 while the shard answers without a standby in sync.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time

import grpc

from psserver.common.cli_support import FENCED_EXIT
from psserver.protocol.admin_token import METADATA_KEY
from psserver.protocol.proto import replica_pb2 as _rpb
from psserver.protocol.proto import replica_pb2_grpc as _rgrpc
from psserver.replication.standby import MAX_SHIPMENT_BYTES

log = logging.getLogger(__name__)


# Loop turns a shipment waits before its capture: a sync round's replies wake together, and each that reaches the
# barrier after the capture began would need a shipment of its own (measured: 2 a round without, ~1 with).
GATHER_TURNS = 3
SHUN_SECONDS = 5.0  # a standby that failed a shipment is not adopted again this soon (a dead one's offer lingers)

ALONE, CATCHING_UP, REPLICATED, FENCED = "alone", "catching_up", "replicated", "fenced"


def fence_now(shard: int, why: str) -> None:
    """Stop this process at once: a replaced primary must answer nothing more and write no checkpoint."""
    log.critical("shard %d: fenced: %s; this process stops (restart it to rejoin as the standby)", shard, why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(FENCED_EXIT)


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None):
    """(channel, stub) to a standby's replication port: TLS with ``credentials`` (ServerSecurity.peer_credentials)."""
    options = [("grpc.max_send_message_length", MAX_SHIPMENT_BYTES)]
    channel = grpc.aio.insecure_channel(address, options=options) if credentials is None else \
        grpc.aio.secure_channel(address, credentials, options=options)
    return channel, _rgrpc.StandbyStub(channel)


class Replicator:
    """The primary of shard ``shard`` at ``epoch``: ships ``capture(since)`` (on the state worker: the states with
the table rows touched since the marks ``since``, or whole states for None; the marks now; whether any table is
partial) to its standby.

    ``runtime``: the shard's (``offload`` runs on its state worker); ``loop``: its event loop; ``roles``: this
    replica's etcd transactions (psserver.replication.roles); ``count``: the shard's counters."""

    def __init__(self, *, shard: int, job: str, me: str, epoch: int, roles, runtime, loop, capture, count,
                 timeout: float = 2.0, poll: float = 0.25, fence=fence_now, token: str = "", admin: str = "",
                 connect=None, lag: int = 0, require: bool = False, exposed=None):
        """``lag``: replies go out without waiting while the standby is at most this many shipments behind
        (``--replica-lag``: a failover may then roll back up to that many rounds, counted as steps lost);
        ``require``: replies wait while no standby is in sync (``--require-standby``); ``exposed``: the shard's read
        counters now (ShardHost.exposed; None: reads wait as any other reply)."""
        self.shard, self.job, self.me, self.epoch, self.roles = shard, job, me, epoch, roles
        self.runtime, self.loop, self._capture_states, self.count = runtime, loop, capture, count
        self.timeout, self.poll, self._fence = timeout, poll, fence
        # the job's --auth-token, and the operator's admin token a standby takes shipments with
        self._metadata = ((("authorization", f"Bearer {token}"),) if token else ()) + ((METADATA_KEY, admin),)
        self._connect = connect or open_channel  # address -> (channel, stub); the unit tests pass a fake
        self.mode, self.lag, self.require = ALONE, lag, require
        self.standby: tuple[str, str] | None = None  # (replica id, replication address)
        self.channel = self.stub = None
        self.started = self.captured = self.acked = 0
        self._base: tuple[int, list] | None = None  # (shipment, its marks): what the standby holds to build on
        self._exposed = exposed
        self._captured_exposed: tuple = (0, 0, None)  # (shipment, epoch, the read counters before its capture)
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._in_sync = asyncio.Event()  # set while replicated: what a reply waits for with ``require``
        self._kick = asyncio.Event()
        self._stop = threading.Event()
        self._task: asyncio.Task | None = None
        self._shunned: dict[tuple[str, str], float] = {}  # a standby that failed: not adopted again until then

    # ------------------------------------------------------------------ replies
    async def barrier(self, read: bool = False) -> None:
        """Return once the standby holds a state with everything changed before this call (at once unless
        replicated -- or, with ``require``, not before a standby is in sync and holds it).  ``read``: the reply
        only shows state: the newest shipment captured will do if no read counter moved since its capture."""
        while self.require and self.mode != REPLICATED:
            await self._in_sync.wait()
        if self.mode != REPLICATED:
            return
        # a shipment started but not yet captured includes the caller's change; one captured may not
        want = self.started if self.started > self.captured else self.started + 1
        if read and self._exposed is not None:
            shipment, epoch, exposed = self._captured_exposed
            if shipment and epoch == self.epoch and exposed == self._exposed():
                want = shipment  # (counters are monotone: what the read showed is no newer than that capture)
                self.count("replica_reads_on_shipped")
        # (a shipment begun already needs no kick: one after it, with nobody waiting for it, would cost a round trip)
        if self.acked >= want - self.lag:  # (with a lag, a shipment is still due: the standby stays close behind)
            if self.acked < want and want > self.started:
                self._kick.set()
            return
        fut = self.loop.create_future()
        self._waiters.append((want - self.lag, fut))  # released once the standby is within the lag of it
        if want > self.started:
            self._kick.set()
        await fut
        if self.require and self.mode != REPLICATED:  # released because the standby was lost: wait for the next
            await self.barrier()

    def _release(self, upto: int | None) -> None:
        """The waiters a shipment ``upto`` covers go on (None: all of them: the standby was dropped)."""
        keep = []
        for want, fut in self._waiters:
            if upto is None or want <= upto:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((want, fut))
        self._waiters = keep

    def gauges(self) -> dict[str, float]:
        """GetStats' replication gauges: whether the shard answers without a standby in sync now, and how many
        shipments the standby's acknowledgement is behind the newest begun."""
        return {"replica_unreplicated": float(self.mode != REPLICATED), "replica_shipments_behind":
                float(self.started - self.acked) if self.mode == REPLICATED else 0.0}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """On the shard's loop: the shipping task; on a thread: looking for a standby to adopt."""
        def begin():
            self._task = self.loop.create_task(self._ship_loop())
        self.loop.call_soon_threadsafe(begin)
        threading.Thread(target=self._watch, name=f"shard{self.shard}-standby-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        """Every ``poll`` seconds while alone: a standby offering itself in etcd is adopted (its catch-up begins)."""
        while not self._stop.wait(self.poll):
            if self.mode != ALONE:
                continue
            try:
                record = self.roles.read()
            except Exception as e:  # noqa: BLE001 -- etcd unreachable: alone stays alone, tried again
                log.debug("shard %d: reading etcd failed: %s", self.shard, e)
                continue
            if record.primary not in (None, self.me):
                self.loop.call_soon_threadsafe(self._fenced,
                                               f"etcd names {record.primary} primary (epoch {record.epoch})")
                return
            if record.standby is not None and record.standby[0] != self.me and \
                    self._shunned.get(record.standby, 0) <= time.monotonic():
                self.loop.call_soon_threadsafe(self._adopt, record.standby)

    def _adopt(self, standby: tuple[str, str]) -> None:
        if self.mode != ALONE:
            return
        self.standby, self.mode, self._base = standby, CATCHING_UP, None
        self.channel, self.stub = self._connect(standby[1])
        log.info("shard %d: standby %s at %s found: shipping its first state", self.shard, *standby)
        self._kick.set()

    def _fenced(self, why: str) -> None:
        """A newer primary exists: no reply of this one may go out (the fence ends the process)."""
        self.mode = FENCED
        self._fence(self.shard, why)

    # ------------------------------------------------------------------ shipping
    def _capture(self, n: int) -> tuple[list[bytes], list, int]:
        """On the state worker: shipment ``n``'s states (one moment of every partition), the marks the next one
        builds on, and the shipment this one builds on (0: whole states)."""
        self.captured = n
        base = self._base
        # (before the states: a change between the two is shipped and never vouched for)
        exposed = self._exposed() if self._exposed is not None else None
        states, marks, partial = self._capture_states(base[1] if base else None)
        self._captured_exposed = (n, self.epoch, exposed)
        return states, marks, base[0] if base and partial else 0

    async def _ship_loop(self) -> None:
        while True:
            await self._kick.wait()
            for _ in range(GATHER_TURNS):  # the replies woken with this one (a sync round's) reach the barrier
                await asyncio.sleep(0)
            self._kick.clear()
            if self.standby is None:
                continue
            self.started += 1
            n, epoch = self.started, self.epoch
            began = time.perf_counter()
            try:
                states, marks, base = await self.runtime.offload(self._capture, n)
            except Exception as e:  # noqa: BLE001 -- a bug: the standby is dropped (nothing waits on it), and it says why
                log.exception("shard %d: capturing shipment %d failed", self.shard, n)
                self.count("replica_capture_failures")
                self._base = None
                await self._lose_standby(f"capturing shipment {n} failed: {e!r}")
                continue
            captured = time.perf_counter()
            try:
                await self.stub.Ship(_rpb.ShipRequest(job=self.job, shard=self.shard, epoch=epoch, shipment=n,
                                                      primary=self.me, states=states, base=base),
                                     timeout=self.timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                self._base = None
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._fenced(f"the standby refused shipment {n}: {e.details()}")
                    return
                if e.code() == grpc.StatusCode.OUT_OF_RANGE and base:  # it lacks the one this built on
                    self.count("replica_whole_resends")
                    log.warning("shard %d: the standby lacks shipment %d (%s): shipping the whole state", self.shard,
                                base, e.details())
                    self._kick.set()
                    continue
                await self._lose_standby(f"{e.code().name}: {e.details()}")
                continue
            self.acked, self._base = n, (n, marks) if marks else None
            # where a shipment's time goes: its capture on the state worker (the step's own thread), and its
            # round trip to the standby (sent, taken, acknowledged)
            self.count("replica_capture_seconds", captured - began)
            self.count("replica_ship_seconds", time.perf_counter() - captured)
            self.count("replica_shipments")
            self.count("replica_shipments_since" if base else "replica_shipments_whole")
            self.count("replica_bytes", sum(len(s) for s in states))
            if self.mode == CATCHING_UP:
                await self._mark_in_sync()
                continue
            self._release(n)
            if self._waiters:
                self._kick.set()

    async def _mark_in_sync(self) -> None:
        """The standby holds a whole state: from the next epoch on, replies wait for it."""
        ok = await self._etcd(self.roles.set_in_sync, self.epoch, self.standby[0])
        if not ok:
            self._fenced(f"etcd refused marking standby {self.standby[0]} in sync at epoch {self.epoch}")
            return
        self.epoch += 1
        self.mode = REPLICATED
        self._in_sync.set()  # (``require``: each waiting reply now waits for a shipment that holds its change)
        self.count("replica_catch_ups")
        log.info("shard %d: standby %s caught up: replicated from epoch %d (replies wait for its acknowledgement)",
                 self.shard, self.standby[0], self.epoch)
        self._kick.set()  # a state of the new epoch: only one of it makes the standby eligible for promotion

    async def _lose_standby(self, why: str) -> None:
        """The standby did not acknowledge: drop it in etcd (a new epoch, nobody in sync), then answer alone."""
        was = self.standby
        self._shunned[was] = time.monotonic() + SHUN_SECONDS  # its offer may outlive it by a lease
        self.count("replica_standby_lost")
        if self.mode == REPLICATED:
            ok = await self._etcd(self.roles.set_in_sync, self.epoch, "")
            if not ok:
                self._fenced("etcd refused dropping the standby: a newer primary exists")
                return
            self.epoch += 1
        self.mode, self.standby = ALONE, None
        self._in_sync.clear()
        if self.channel is not None:
            await self.channel.close()
        self.channel = self.stub = None
        log.warning("shard %d: standby %s did not answer (%s): %s from epoch %d until a standby catches up",
                    self.shard, was[0] if was else "?", why,
                    "replies wait (--require-standby)" if self.require else "running unreplicated", self.epoch)
        self._release(None)

    async def _etcd(self, fn, *args) -> bool:
        """An etcd transaction off the loop, tried until etcd answers (the replies wait meanwhile)."""
        while True:
            try:
                return await asyncio.to_thread(fn, *args)
            except Exception as e:  # noqa: BLE001 -- etcd unreachable: counted, logged, tried again
                self.count("replica_etcd_retries")
                log.warning("shard %d: etcd did not answer (%s); trying again", self.shard, e)
                await asyncio.sleep(self.poll)
