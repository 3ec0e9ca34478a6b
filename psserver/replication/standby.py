"""The standby's side of a shard's replication: it holds the newest state its primary shipped, and refuses any
shipment of an epoch older than one it has seen.

Why it serves nothing else: a standby listens only on its replication port; the shard's own port stays closed
until it is promoted, so a trainer's channel (``--ps PRIMARY|STANDBY``, gRPC's pick-first over both addresses)
can only ever connect to the replica that is primary now.  Each shipment is acknowledged once taken, and applied
to the state held on a thread of its own (psserver.replication.live); a promotion waits for that thread.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc

from psserver.protocol import admin_token
from psserver.protocol.proto import replica_pb2 as _rpb
from psserver.protocol.proto import replica_pb2_grpc as _rgrpc
from psserver.replication.live import Holdings
from psserver.serving.ports import host_port

log = logging.getLogger(__name__)

MAX_SHIPMENT_BYTES = (2 << 30) - 1  # gRPC's own limit on one message: a shard's state past it cannot be shipped


class StandbyService(_rgrpc.StandbyServicer):
    """Holds the newest shipment of job ``job``'s shard ``shard``; ``fence`` closes it to older epochs."""

    def __init__(self, job: str, shard: int, admin_token: str):
        """``admin_token``: the operator's (``--admin-token-file``, ``$PS_ADMIN_TOKEN``): only a replica holding it
        may replace this standby's state."""
        self.job, self.shard, self._admin_token = job, shard, admin_token
        self._lock = threading.Lock()
        self.epoch_seen = 0  # the newest epoch of a shipment taken or of a promotion
        self.held_epoch: int | None = None  # the epoch of the state held (None: nothing shipped yet)
        self.holdings = Holdings()
        self.shipments = 0  # taken, for the log and the tests
        self.refused = 0

    def Ship(self, request, context):
        given = admin_token.presented(context)
        if not admin_token.matches(given, self._admin_token):
            self.refused += 1
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{admin_token.METADATA_KEY} is {'wrong' if given else 'missing'}: a shipment needs the "
                          f"operator's admin token (the replicas' --admin-token-file or ${admin_token.ADMIN_TOKEN_ENV})")
        if request.job != self.job or request.shard != self.shard:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"shipment names job {request.job!r} shard {request.shard}, but this standby is of job "
                          f"{self.job!r} shard {self.shard}")
        with self._lock:
            if request.epoch < self.epoch_seen:
                self.refused += 1
                log.warning("shard %d standby: refused a shipment of epoch %d from %s: it has seen epoch %d "
                            "(that primary was replaced)", self.shard, request.epoch, request.primary,
                            self.epoch_seen)
                context.set_trailing_metadata((("ps-reason", "fenced"),))
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"fenced: shipment of epoch {request.epoch}, but this replica has seen epoch "
                              f"{self.epoch_seen}: a newer primary holds shard {self.shard}")
            if self.held_epoch is None:
                log.info("shard %d standby: first state from primary %s (epoch %d, %d bytes)", self.shard,
                         request.primary, request.epoch, sum(len(s) for s in request.states))
            if not request.base:
                self.holdings.take_whole(request.states, request.shipment)
            elif not self.holdings.take_since(request.states, request.shipment, request.base):
                self.refused += 1
                context.set_trailing_metadata((("ps-reason", "base-missing"),))
                context.abort(grpc.StatusCode.OUT_OF_RANGE,
                              f"shipment {request.shipment} builds on shipment {request.base}, but this standby holds "
                              f"shipment {self.holdings.shipment}: ship the whole state")
            self.epoch_seen = max(self.epoch_seen, request.epoch)
            self.held_epoch = request.epoch
            self.shipments += 1
            return _rpb.ShipReply(epoch=self.epoch_seen, shipment=request.shipment)

    def epoch_held(self) -> int | None:
        """The epoch of the state held (None: nothing shipped yet)."""
        with self._lock:
            return self.held_epoch

    def held(self) -> tuple[int | None, list]:
        """The epoch and the whole states held (the shipments since the last whole one folded in)."""
        with self._lock:
            return self.held_epoch, self.holdings.states()

    def fence(self, epoch: int) -> tuple[int | None, list]:
        """From now on refuse shipments older than ``epoch``; returns the state held at that moment (a shipment
        acknowledged before it is in it), made whole."""
        with self._lock:
            self.epoch_seen = max(self.epoch_seen, epoch)
            return self.held_epoch, self.holdings.states()


class StandbyServer:
    """The standby's replication port (a thread-pool gRPC server: one shipment at a time is all it takes)."""

    def __init__(self, service: StandbyService, host: str, port: int, interceptors=(), credentials=None):
        """``credentials``: the shard's TLS (its certificate, clients' certificates checked against its client CA:
        psserver.protocol.security.ServerSecurity.credentials); None: plaintext."""
        self.service = service
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="standby"),
                                  interceptors=list(interceptors),
                                  options=[("grpc.max_receive_message_length", MAX_SHIPMENT_BYTES),
                                           ("grpc.so_reuseport", 0)])
        _rgrpc.add_StandbyServicer_to_server(service, self.server)
        address = host_port(host, port)
        self.port = self.server.add_insecure_port(address) if credentials is None else \
            self.server.add_secure_port(address, credentials)
        if self.port == 0:
            raise OSError(f"cannot listen on {address} (--replica-port): the address is in use or not "
                          f"local")
        self.host = host

    def start(self) -> "StandbyServer":
        self.server.start()
        return self

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)

    def stop(self) -> None:
        self.server.stop(0).wait()
        self.service.holdings.close()  # (no shipment arrives now to apply)
