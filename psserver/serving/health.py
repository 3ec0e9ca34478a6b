"""Health for probes: the standard service on the shard's port, and optionally on a port of its own.

The shard's own port answers ``grpc.health.v1.Health`` on its event loop, between
any two steps of anyone's calls -- a few ms when the shard has slack.  But one
interpreter moves only so many gRPC calls per second: with hundreds of trainers
its event loop is saturated and a health check waits its turn behind a round's
worth of replies (ps-loadgen measured 100-250 ms p99 at 256-1,024 trainers on 2
cores), and a thread of the same process fares little better, as it waits for
the same interpreter lock.  A liveness probe that fails then restarts a shard
that is merely busy.

``--health-port`` therefore answers Health from a small *process* of its own
(``ProbePort``), which shares two numbers with the shard through shared memory:
the serving status and the time of the event loop's latest tick
(``LoopWatch``).  It reports SERVING only while the shard says so and its loop
keeps ticking, so it still tells a hung shard (loop stalled for
``stall_seconds``, 10 s: ``PROBE_STALL_SECONDS``) from a busy one.

The same ticks are the event loop's watchdog: ``LoopWatch`` records how late each
one ran, and the longest lateness over the last ``STALL_WINDOW`` seconds is the
``loop_stall_seconds`` gauge (GetStats, ``psgrpc_loop_stall_seconds``): the
health port turns NOT_SERVING when it would pass ``PROBE_STALL_SECONDS``.  The main
port's ``Watch`` streams are capped (``CappedHealth``).  It exits with the shard, also when the shard
is killed (it watches a pipe from the shard).  Point Kubernetes' probes at it;
tools keep using the main port.

This module must not import torch: the probe process starts by importing it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from psserver.common.logsafe import RateLimitedLog
from psserver.protocol.errors import TooBusy
from psserver.serving.ports import host_port
from psserver.serving.replies import Connections

log = logging.getLogger(__name__)

TICK_SECONDS = 0.05  # the watchdog's period: a stall shorter than this is not seen
STALL_WINDOW = 10.0  # seconds over which loop_stall_seconds is the longest stall (one to two windows back)
PROBE_STALL_SECONDS = 10.0  # the health port answers NOT_SERVING once the loop has not ticked for this long
SERVING, NOT_SERVING = 1, 2
START_TIMEOUT = 30.0


class StallWindow:
    """The longest stall seen over the last one to two windows, and ever (pure: the clock is the caller's)."""

    def __init__(self, window: float = STALL_WINDOW):
        self.window = window
        self.worst = 0.0
        self._start: float | None = None
        self._current = self._previous = 0.0

    def observe(self, stall: float, now: float) -> None:
        self._roll(now)
        self._current = max(self._current, stall)
        self.worst = max(self.worst, stall)

    def longest(self, now: float) -> float:
        """Read-only (a scrape's thread reads it while the loop observes)."""
        age = 0.0 if self._start is None else now - self._start
        if age >= 2 * self.window:
            return 0.0
        return self._current if age >= self.window else max(self._current, self._previous)

    def _roll(self, now: float) -> None:
        if self._start is None:
            self._start = now
        if now - self._start >= 2 * self.window:  # two windows without a tick (or a read): nothing is recent
            self._previous = self._current = 0.0
            self._start = now
        elif now - self._start >= self.window:
            self._previous, self._current = self._current, 0.0
            self._start += self.window


class LoopWatch:
    """The event loop's watchdog: a tick every TICK_SECONDS on the loop, which records how late it ran (the
    loop's stall: a callback that held it) and publishes its time (CLOCK_MONOTONIC, the same in every process)
    for the health port, if any."""

    def __init__(self, loop: asyncio.AbstractEventLoop, publish: Callable[[float], None] = lambda t: None,
                 clock: Callable[[], float] = time.monotonic):
        self._loop, self._publish, self._clock = loop, publish, clock
        self.stalls = StallWindow()
        self._handle = None
        self._due = clock()
        publish(self._due)
        loop.call_soon_threadsafe(self._tick)

    def _tick(self) -> None:
        now = self._clock()
        self.stalls.observe(max(0.0, now - self._due), now)
        self._publish(now)
        self._due = now + TICK_SECONDS
        self._handle = self._loop.call_later(TICK_SECONDS, self._tick)

    def gauges(self) -> dict[str, float]:
        """``loop_stall_seconds``: the longest stall of the last STALL_WINDOW s (to 2x that); ``_worst``: ever."""
        now = self._clock()
        pending = max(0.0, now - self._due)  # a stall still going on counts before its tick runs
        return {"loop_stall_seconds": max(self.stalls.longest(now), pending),
                "loop_stall_worst_seconds": max(self.stalls.worst, pending)}

    def stop(self) -> None:
        if self._handle is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._handle.cancel)


class _WatchedHealth(health_pb2_grpc.HealthServicer):
    """Check answers from the shared status and the loop's liveness (Watch is not offered here)."""

    def __init__(self, serving: Callable[[], bool], stalled_for: Callable[[], float], stall_seconds: float):
        self._serving, self._stalled_for, self._stall = serving, stalled_for, stall_seconds

    def Check(self, request, context):  # noqa: N802 (gRPC's spelling)
        ok = self._serving() and self._stalled_for() <= self._stall
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)


class CappedHealth(health.aio.HealthServicer):
    """The main port's standard health service, its Watch streams capped (``Connections.watch``: the
    connection's calls, --max-calls-per-peer and --max-connections, and --max-watch-streams); a Watch past a
    cap is refused RESOURCE_EXHAUSTED naming it, counted by ``Connections`` and logged at a bounded rate."""

    def __init__(self, connections: Connections):
        super().__init__()
        self._connections = connections
        self._log = RateLimitedLog(log)

    async def Watch(self, request, context):  # noqa: N802 (gRPC's spelling)
        try:
            with self._connections.watch(context.peer() or "?"):
                return await super().Watch(request, context)
        except TooBusy as e:  # from entering the slot: the stream itself raises none
            self._log.warning("watch", "health Watch refused with RESOURCE_EXHAUSTED: %s", e)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))


def _probe_main(host: str, port: int, status, last_tick, stall_seconds: float, conn) -> None:
    """The probe process: serve Check until the shard says stop or its end of the pipe closes (it died)."""
    servicer = _WatchedHealth(lambda: status.value == SERVING, lambda: time.monotonic() - last_tick.value,
                              stall_seconds)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(host_port(host, port))
    except RuntimeError:
        bound = 0
    if bound:
        server.start()
    conn.send(bound)
    try:
        conn.recv()  # "stop", or EOFError when the shard is gone
    except (EOFError, OSError):
        pass
    server.stop(0)


class ProbePort:
    """Health on ``host:port`` from a process of its own; ``.port`` once started."""

    def __init__(self, host: str, port: int, stall_seconds: float = PROBE_STALL_SECONDS):
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or gRPC state inherited
        self.status = ctx.Value("i", NOT_SERVING, lock=False)
        self.last_tick = ctx.Value("d", time.monotonic(), lock=False)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_probe_main, name="ps-health-port", daemon=True,
                                 args=(host, port, self.status, self.last_tick, stall_seconds, child))
        self._proc.start()
        child.close()
        bound = self._conn.recv() if self._conn.poll(START_TIMEOUT) else 0
        if not bound:
            self.stop()
            raise OSError(f"cannot listen on {host_port(host, port)} (--health-port): in use, not local, or too slow to start")
        self.port = bound

    def publish_tick(self, t: float) -> None:
        self.last_tick.value = t

    def set_serving(self, serving: bool) -> None:
        self.status.value = SERVING if serving else NOT_SERVING

    def stop(self) -> None:
        self.status.value = NOT_SERVING
        try:
            self._conn.send("stop")
        except (OSError, ValueError):
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
