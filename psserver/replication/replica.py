"""One replica of a shard (``ps-server --etcd HOST:PORT --replica ID``): primary or standby, as etcd decides.

A replica takes a lease in etcd and keeps it renewed.  If the shard has never had a primary it becomes the
primary; otherwise it becomes a standby: it opens its replication port, offers itself in etcd, takes the
primary's shipments (psserver.replication.standby) and watches the primary's key.  When that key is gone (the
primary's lease expired: killed, paused, cut off from etcd) and etcd still names this standby in sync at the
epoch of the state it holds, it promotes itself in one transaction, refuses older shipments from then on, and
serves the shard from that state on the shard's own port -- the version, the open round, the members and the
push books its primary acknowledged, so trainers resend their unanswered calls and nothing is rolled back.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import socket
import threading
import time
from dataclasses import dataclass

from psserver.protocol.security import split_host_port
from psserver.replication.deltas import decoded
from psserver.replication.roles import EtcdStore, Roles
from psserver.replication.shipper import REPLICATED, Replicator, fence_now, open_channel
from psserver.replication.standby import StandbyServer, StandbyService
from psserver.serving.ports import host_port

log = logging.getLogger(__name__)
ETCD_START_SECONDS = 30.0  # how long a replica waits at its start for etcd to answer


@dataclass(frozen=True)
class ReplicaOptions:
    etcd: str  # HOST:PORT of etcd's client URL
    replica: str  # this replica's id, unique among the shard's replicas
    job: str = "default"  # the etcd prefix: one per job
    lease_seconds: int = 2  # the primary's lease: how long after its death a standby may take over
    replica_port: int = 0  # the standby's replication port (0: pick one; etcd publishes it)
    ship_timeout: float = 2.0  # seconds a shipment may take before the standby is dropped
    lag: int = 0  # replies go out while the standby is at most this many shipments behind (0: they wait for it)
    require: bool = False  # replies wait while no standby is in sync (--require-standby), never go out alone
    advertise_host: str = ""  # the host other replicas reach this one at ("": advertised_host's default)


def advertised_host(host: str, advertise: str = "") -> str:
    """The host this replica's addresses are published with in etcd: ``advertise`` if given, else ``host`` --
    unless that is a wildcard (0.0.0.0, ::), which no other machine can connect to: then this machine's address
    for its host name (a container's or a pod's own IP, from its /etc/hosts)."""
    if advertise:
        return advertise
    if host.strip("[]") not in ("0.0.0.0", "::"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return host  # (no address for the host name: the lease alone fails it over, as before)


def refuses_connections(address: str, timeout: float = 0.2) -> bool:
    """Whether ``address`` refuses a TCP connection now (nothing listens: the process is gone).  A timeout is
    not a refusal: a paused or cut-off primary is left to its lease."""
    try:
        host, port = split_host_port(address)
    except ValueError:
        return False
    if host.strip("[]") in ("0.0.0.0", "::"):  # (not where it can be reached)
        return False
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class Replica:
    """Runs a shard's replica until it is primary (``start`` returns its ShardServer) or ``stop`` is set."""

    def __init__(self, cfg, opts: ReplicaOptions, store=None, server_factory=None):
        from psserver.serving.server import ShardServer

        self.cfg, self.opts = cfg, opts
        self.store = store or EtcdStore(opts.etcd)
        self.advertised = advertised_host(cfg.host, opts.advertise_host)
        self.roles = Roles(self.store, opts.job, cfg.shard, opts.replica, address=host_port(self.advertised, cfg.port))
        self.server_factory = server_factory or ShardServer
        self.replicator: Replicator | None = None
        self.standby: StandbyServer | None = None
        self._renewed = time.monotonic()
        self._primary = False
        self._lease_lock = threading.Lock()  # one lease at a time: the lease thread and ``start`` both take one

    # ------------------------------------------------------------------ the lease
    def _keep_lease(self, stop: threading.Event) -> None:
        """Renew the lease every third of its time.  Lost while primary -- etcd says it expired, or, while no
        standby acknowledges this primary's answers, etcd could not be reached for a whole lease time -- another
        replica may have been promoted: this one stops.  (A replicated primary whose etcd is unreachable goes on:
        its standby's acknowledgements show no other replica was promoted.)"""
        period = self.opts.lease_seconds / 3
        while not stop.wait(period):
            try:
                alive = self.store.refresh()
            except Exception as e:  # noqa: BLE001 -- etcd unreachable: tried again; past the lease, stop
                log.warning("shard %d: renewing the etcd lease failed: %s", self.cfg.shard, e)
                alive = True
            else:
                if alive:
                    self._renewed = time.monotonic()
            lapsed = time.monotonic() - self._renewed > self.opts.lease_seconds and not (
                self.replicator is not None and self.replicator.mode == REPLICATED)
            if self._primary and (not alive or lapsed):
                fence_now(self.cfg.shard, "its etcd lease expired: a standby may have been promoted")
            if not alive and not self._primary:
                try:
                    with self._lease_lock:
                        self._new_lease()
                        if self.standby is not None:  # a standby's offer lapsed with its lease: offered again
                            self.roles.offer_standby(self._standby_address())
                except Exception as e:  # noqa: BLE001 -- etcd unreachable: the next period tries again
                    log.warning("shard %d: taking a new etcd lease failed: %s", self.cfg.shard, e)

    def _new_lease(self) -> None:
        self.store.grant(self.opts.lease_seconds)
        self._renewed = time.monotonic()

    def _standby_address(self) -> str:
        """The replication port as etcd publishes it (the host the other replicas reach this one at)."""
        return host_port(self.advertised, self.standby.port)

    def _offer_standby(self) -> None:
        """Offer this standby in etcd on a live lease.  A replica that started slowly (a loaded machine: its
        optimizers' warm-up, its standby port) may find the lease it took at its start already lapsed, and etcd
        refuses a key on a lapsed lease: it takes a new lease and offers again, once."""
        address = self._standby_address()
        with self._lease_lock:
            try:
                self.roles.offer_standby(address)
                return
            except Exception as e:  # noqa: BLE001 -- etcd3gw's errors have no common base
                if self.store.refresh():
                    raise  # the lease lives: etcd refused for another reason
                log.warning("shard %d: the etcd lease lapsed before this standby was offered (%s: %s); offering "
                            "it on a new lease", self.cfg.shard, type(e).__name__, e)
                self._new_lease()
                self.roles.offer_standby(address)

    # ------------------------------------------------------------------ roles
    def _first_lease(self, stop: threading.Event) -> None:
        """The replica's etcd lease, once etcd answers: a replica started beside its etcd (compose, a pod) may
        come up first.  RuntimeError (a one-line error) if it does not answer within ETCD_START_SECONDS."""
        deadline, said = time.monotonic() + ETCD_START_SECONDS, False
        while True:
            try:
                self._new_lease()
                return
            except Exception as e:  # noqa: BLE001 -- etcd3gw's errors have no common base; any is "not yet"
                if time.monotonic() > deadline or stop.is_set():
                    raise RuntimeError(f"etcd at {self.opts.etcd} (--etcd) did not answer within "
                                       f"{ETCD_START_SECONDS:.0f} s ({type(e).__name__}): start etcd first, or fix "
                                       "the address") from None
                if not said:
                    log.warning("shard %d: etcd at %s does not answer yet (%s); waiting up to %.0f s",
                                self.cfg.shard, self.opts.etcd, type(e).__name__, ETCD_START_SECONDS)
                    said = True
                stop.wait(0.5)

    def start(self, stop: threading.Event, on_standby=lambda address: None):
        """Primary now, or standby until promoted: the running ShardServer, or None if ``stop`` came first.
        ``on_standby(address)``: called once this replica waits as a standby (its shard address)."""
        self._first_lease(stop)
        threading.Thread(target=self._keep_lease, args=(stop,), name=f"shard{self.cfg.shard}-lease",
                         daemon=True).start()
        record = self.roles.read()
        if record.done is not None:
            log.info("shard %d: the job is done (its primary left at version %d): nothing to serve or stand by for",
                     self.cfg.shard, record.done)
            return None
        if record.epoch is None and self.roles.start_fresh():
            log.info("shard %d: replica %s is the primary (epoch 1; no standby yet)", self.cfg.shard, self.opts.replica)
            return self._serve(None, 1)
        if self.cfg.restore and record.primary is None and not record.in_sync and \
                self.roles.take_over_restored(record.epoch):
            log.warning("shard %d: replica %s is the primary from its checkpoint (epoch %d): no standby held the "
                        "newest state", self.cfg.shard, self.opts.replica, record.epoch + 1)
            return self._serve(None, record.epoch + 1)
        from psserver.protocol.optim import warm_up

        warm_up()  # the optimizers' first-use cost (about a second) paid now, not at the promotion
        service = StandbyService(self.opts.job, self.cfg.shard, self.cfg.security.admin_token)
        self.standby = StandbyServer(service, self.cfg.host, self.opts.replica_port,
                                     self.cfg.security.interceptors(), self.cfg.security.credentials()).start()
        self._offer_standby()
        log.info("shard %d: replica %s is a standby (replication port %s); the shard's port opens if it is "
                 "promoted", self.cfg.shard, self.opts.replica, self.standby.address)
        on_standby(host_port(self.cfg.host, self.cfg.port))
        said, refusals = None, 0
        while not stop.wait(self.opts.lease_seconds / 8):
            try:
                record = self.roles.read()
            except Exception as e:  # noqa: BLE001 -- etcd unreachable: no promotion without it
                log.warning("shard %d: reading etcd failed: %s", self.cfg.shard, e)
                continue
            if record.done is not None and record.primary is None:
                log.info("shard %d: the job is done (its primary left at version %d): the standby leaves too",
                         self.cfg.shard, record.done)
                self.standby.stop()
                return None
            held = service.epoch_held()
            eligible = held is not None and record.in_sync == self.opts.replica and record.epoch == held
            if record.primary is not None:
                # a primary whose port refuses connections twice running is a dead process: no need to wait
                # for its lease (a paused or cut-off one is waited for)
                refusals = refusals + 1 if eligible and refuses_connections(record.primary_address) else 0
                if refusals < 2 or not self._try(self.roles.take_over, record.epoch, record.primary_value):
                    continue
                how = f"its primary {record.primary}'s port refused connections"
            elif not eligible:
                why = (f"the primary is gone but this standby does not hold its newest state (etcd: epoch "
                       f"{record.epoch}, in sync {record.in_sync or 'nobody'}; held: epoch {held}); restart a "
                       f"replica with --restore to resume from its checkpoint")
                if why != said:
                    log.warning("shard %d: %s", self.cfg.shard, why)
                    said = why
                continue
            elif not self._try(self.roles.promote, record.epoch):
                continue
            else:
                how = "its primary's lease expired"
            t0 = time.monotonic()
            _, states = service.fence(record.epoch + 1)  # what was acknowledged before this is in ``states``
            self.standby.stop()
            log.warning("shard %d: replica %s promoted to primary at epoch %d: %s (%d shipments taken)",
                        self.cfg.shard, self.opts.replica, record.epoch + 1, how, service.shipments)
            server = self._serve(states, record.epoch + 1)
            server.shard.wide.count("replica_promotions")
            log.info("shard %d: serving %.3f s after the promotion", self.cfg.shard, time.monotonic() - t0)
            return server
        if self.standby is not None:
            self.standby.stop()
        return None

    def _try(self, transaction, *args) -> bool:
        """A promotion's transaction; etcd unreachable (or this replica's lease lapsed meanwhile) is a no."""
        try:
            return transaction(*args)
        except Exception as e:  # noqa: BLE001 -- logged; the standby's loop tries again
            log.warning("shard %d: %s failed: %s", self.cfg.shard, transaction.__name__, e)
            return False

    def _serve(self, states: list | None, epoch: int):
        """Serve the shard as its primary (from ``states``, the ShardStates held, when promoted) and start
        replicating."""
        initial = [decoded(s) for s in states] if states else None
        cfg = dataclasses.replace(self.cfg, restore=False) if initial else self.cfg  # the shipped state, not disk's
        self._primary = True
        server = self.server_factory(cfg, initial_states=initial).start()
        self.replicator = Replicator(shard=self.cfg.shard, job=self.opts.job, me=self.opts.replica, epoch=epoch,
                                     roles=self.roles, runtime=server.runtime, loop=server.loop,
                                     capture=server.capture_since, exposed=server.exposed,
                                     count=server.shard.wide.count,
                                     timeout=self.opts.ship_timeout, poll=self.opts.lease_seconds / 8,
                                     token=self.cfg.security.token, admin=self.cfg.security.admin_token,
                                     lag=self.opts.lag, require=self.opts.require,
                                     connect=functools.partial(open_channel,
                                                               credentials=self.cfg.security.peer_credentials()))
        server.service.replication = self.replicator
        self.replicator.start()
        return server

    def mark_done(self, version: int) -> None:
        """The primary leaves because the job is done: said in etcd, so its standby (and a replica started
        later) leaves too instead of waiting for a primary that will not come back."""
        try:
            if not self.roles.mark_done(version):
                log.warning("shard %d: the job is done but this replica is no longer the primary in etcd",
                            self.cfg.shard)
        except Exception as e:  # noqa: BLE001 -- etcd gone: the standby waits, as before
            log.warning("shard %d: marking the job done in etcd failed: %s", self.cfg.shard, e)

    def stop(self) -> None:
        if self.replicator is not None:
            self.replicator.stop()
        try:
            self.store.revoke()  # a clean stop hands over at once, not after the lease
        except Exception as e:  # noqa: BLE001 -- etcd gone: the lease lapses on its own
            log.warning("shard %d: revoking the etcd lease failed: %s", self.cfg.shard, e)
