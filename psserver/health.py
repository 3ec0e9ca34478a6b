"""Health for probes: the standard service on the shard's port, and optionally on a port of its own.

The shard's own port answers ``grpc.health.v1.Health`` on its event loop, between
any two steps of anyone's calls -- a few ms when the shard has slack.  But one
interpreter moves only so many gRPC calls per second: with hundreds of trainers
the loop is saturated and a health check waits its turn behind a round's worth
of replies (ps-loadgen measured 100-200 ms at 256-1,024 trainers).  A liveness
probe that fails then restarts a shard that is merely busy.

``--health-port`` adds a small thread-pool gRPC server that answers Health on a
port of its own, independent of the loop's queue.  So that it still tells a
hung shard from a busy one, it reports SERVING only while the event loop keeps
ticking (``LoopWatch``): a loop that has not run for ``stall_seconds`` reads as
NOT_SERVING.  Point Kubernetes' probes at it; tools keep using the main port.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

TICK_SECONDS = 0.1


class LoopWatch:
    """The time of the event loop's latest tick, read from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, clock=time.monotonic):
        self._loop, self._clock = loop, clock
        self.last_tick = clock()
        self._handle = None
        loop.call_soon_threadsafe(self._tick)

    def _tick(self) -> None:
        self.last_tick = self._clock()
        self._handle = self._loop.call_later(TICK_SECONDS, self._tick)

    def stalled_for(self) -> float:
        return self._clock() - self.last_tick

    def stop(self) -> None:
        if self._handle is not None:
            self._loop.call_soon_threadsafe(self._handle.cancel)


class _WatchedHealth(health.HealthServicer):
    """The standard servicer, except that a stalled event loop reads as NOT_SERVING."""

    def __init__(self, watch: LoopWatch, stall_seconds: float):
        super().__init__()
        self._watch, self._stall = watch, stall_seconds

    def Check(self, request, context):  # noqa: N802 (gRPC's spelling)
        reply = super().Check(request, context)
        stalled = self._watch.stalled_for()
        if reply.status == health_pb2.HealthCheckResponse.SERVING and stalled > self._stall:
            log.warning("health port: the event loop has not run for %.1f s: NOT_SERVING", stalled)
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return reply


class ProbePort:
    """A thread-pool gRPC server answering only Health, on ``host:port``."""

    def __init__(self, host: str, port: int, watch: LoopWatch, stall_seconds: float = 10.0):
        self.servicer = _WatchedHealth(watch, stall_seconds)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health-port"),
                                  options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        address = f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address} (--health-port): {e}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {address} (--health-port): the address is in use or not local")

    def start(self, names: tuple[str, ...]) -> None:
        self.server.start()
        for name in names:
            self.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        self.servicer.enter_graceful_shutdown()
        self.server.stop(0).wait()
