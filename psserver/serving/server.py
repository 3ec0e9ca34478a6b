"""Start and stop a shard's gRPC server (grpc.aio, with the standard health service).

The server runs an asyncio event loop on a thread of its own, so callers (the
CLI, tests) keep a plain synchronous ``ShardServer(cfg).start()`` / ``.stop()``.
There is no pool of request threads to exhaust: waiting calls are futures, and
limits are per connection, per rank and per stream (psserver.serving.service).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.partition.host import ShardHost
from psserver.protocol.codec import DEFAULT_CHUNK_BYTES
from psserver.protocol.limits import MAX_JOIN_TIMEOUT
from psserver.protocol.optim import warm_up
from psserver.protocol.rows import kernel
from psserver.protocol.security import ClientSecurity, ServerSecurity
from psserver.protocol.stubs import SERVICE_NAME
from psserver.resharding import layout_restore
from psserver.resharding.handoff.machine import DEFAULT_HANDOFF_TIMEOUT, handoff_timeout_error
from psserver.resharding.handoff.shard_ops import HandoffIO
from psserver.resharding.layout_host import LayoutHost
from psserver.serving.health import CappedHealth, LoopWatch, ProbePort
from psserver.serving.ports import check_bindable, host_port
from psserver.serving.replies import Connections, ReplyLedger, RequestLedger
from psserver.serving.runtime import Runtime, Wakeups
from psserver.serving.service import ParameterServerService, ServiceLimits, add_service
from psserver.state.budget import MemoryBudget
from psserver.state.heap import CHECK_SECONDS, HeapKeeper, heap_bound

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0


@dataclass(frozen=True)
class ServerConfig:
    shard: int
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 0  # 0: pick a free port
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_message_bytes: int = 16 << 20  # per gRPC message; larger ones get RESOURCE_EXHAUSTED from gRPC
    max_push_bytes: int = 4 << 30  # whole Init/Push stream
    lease_timeout: float = 5.0  # seconds of silence after which a trainer leaves the live set
    join_timeout: float = 0.0  # seconds a pending join is held for its commit; 0: 3 s or the lease if shorter
    handoff_timeout: float = DEFAULT_HANDOFF_TIMEOUT  # a live re-shard's hold (psserver.resharding.handoff.machine)
    checkpoint_dir: str = ""  # where checkpoints go ("" : none)
    checkpoint_every: int = 100  # versions between checkpoints
    restore: bool = False  # resume from the newest valid checkpoint in checkpoint_dir
    # Re-shard on restore (psserver.resharding.reshard): the old job's checkpoint folders, and the new shard count and
    # partitions per shard (None: as before).
    restore_from: tuple[str, ...] = ()
    num_shards: int | None = None
    partitions: int | None = None
    partition_bytes: int | None = None
    shutdown_grace: float = 5.0  # seconds in-flight calls get to finish on stop
    security: ServerSecurity = ServerSecurity()
    nonfinite: str = "refuse"  # NaN/Inf in a gradient: "refuse" (INVALID_ARGUMENT) or "skip" (counted, not applied)
    limits: ServiceLimits = field(default_factory=ServiceLimits)  # per connection, rank and stream
    # Intra-op threads for the shard's tensor work (0: torch's default).  One by default: all of it runs on the
    # state worker, and a second OpenMP team spinning beside the event loop and the trainers cost up to half
    # of a 2-trainer CNN run's throughput (ps-bench A/B); raise it on a shard host with idle cores and big slices.
    torch_threads: int = 1
    health_port: int = -1  # also answer Health on this port from a thread of its own (-1: no; 0: pick one)
    max_memory: int | None = None  # bytes a job may hold (psserver.state.budget; None: a share of the machine's memory)
    insecure: bool = False  # serve beyond loopback with neither a token nor mutual TLS (refused otherwise)

    def __post_init__(self) -> None:
        self.security.check_exposed(self.host, self.insecure)
        if self.shard < 0:
            raise ValueError(f"The shard index ({self.shard}) must be zero or more.")
        if not 0 <= self.port < 65536:
            raise ValueError(f"The port ({self.port}) must be between 0 and 65535.")
        if self.num_shards is not None and not 0 <= self.shard < self.num_shards:
            raise ValueError(f"--shard is {self.shard} but --num-shards is {self.num_shards} "
                             f"(shards 0..{self.num_shards - 1})")
        if (self.num_shards, self.partitions, self.partition_bytes) != (None, None, None) and not self.restore_from:
            raise ValueError("--num-shards, --partitions and --partition-bytes re-shard a job on restore: they "
                             "need --restore-from (the old shards' checkpoint folders)")
        if self.restore and self.restore_from:
            raise ValueError("--restore resumes from --checkpoint-dir, --restore-from from the old shards' "
                             "folders: pass one of them")
        if self.restore and not self.checkpoint_dir:
            raise ValueError("--restore needs --checkpoint-dir: where should the checkpoint come from?")
        if not -1 <= self.health_port < 65536:
            raise ValueError(f"The health port ({self.health_port}) must be between 0 and 65535 (or -1: none).")
        if not (self.lease_timeout >= 0 and math.isfinite(self.lease_timeout)):
            raise ValueError(f"The lease timeout ({self.lease_timeout} s) must be zero (never) or more seconds.")
        if not (0 <= self.join_timeout <= MAX_JOIN_TIMEOUT):
            raise ValueError(f"The join timeout ({self.join_timeout} s) must be between 0 (the default: 3 s, or the "
                             f"lease if shorter) and {MAX_JOIN_TIMEOUT:g} s.")
        if handoff_timeout_error(self.handoff_timeout):
            raise ValueError(handoff_timeout_error(self.handoff_timeout))
        if self.checkpoint_every < 1:
            raise ValueError(f"The checkpoint interval ({self.checkpoint_every} versions) must be at least 1.")
        if self.torch_threads < 0:
            raise ValueError(f"The torch threads ({self.torch_threads}) must be zero (torch's default) or more.")
        if self.chunk_bytes < 16 or self.chunk_bytes > self.max_message_bytes // 2:
            raise ValueError(
                f"The chunk size ({self.chunk_bytes} bytes) must be between 16 and half the message limit "
                f"({self.max_message_bytes // 2})."
            )


def tune_gc() -> None:
    """Keep Python's garbage collector from pausing the event loop.

    With hundreds of calls in flight the heap holds many live objects, and each
    full collection walks them all: ps-loadgen saw the main port's health p99 at
    256 trainers fall from ~100 ms to ~40 ms, and pushes/s rise by a tenth, with
    start-up objects frozen (never scanned again) and collections made rarer.
    The shard's objects are short-lived request state and a few long-lived
    tensors, so little is left for the collector to find in between.
    """
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


@dataclass(frozen=True)
class ShardProcess:
    """What one ps-server process serves with (``build_shard_process``)."""

    host: ShardHost  # every partition this process serves, and the metrics registry over them
    runtime: Runtime  # the state worker, receive buffers, waiters, round timer
    service: ParameterServerService  # the gRPC servicer over both
    watch: LoopWatch  # the event loop's watchdog (and the health port's tick)
    heap: HeapKeeper  # the allocator's free heap, read and given back past its bound


def reshard_states(cfg: ServerConfig) -> list:
    """This shard's partitions re-cut from the old job's checkpoints (ReshardError: a one-line refusal)."""
    from psserver.resharding.reshard_files import check_target, states_for

    check_target(cfg.checkpoint_dir, list(cfg.restore_from), cfg.shard)
    return states_for(list(cfg.restore_from), cfg.num_shards, cfg.shard, cfg.partitions, cfg.partition_bytes)


def build_shard_process(cfg: ServerConfig, loop: asyncio.AbstractEventLoop, loop_thread: int,
                        publish_tick=lambda t: None, initial_states: list | None = None) -> ShardProcess:
    """The one place a shard's parts are made, each handed what it calls when it is made.

    In the order of what calls what: the wake-ups and the serving process's own gauges first (the loop's
    watchdog, the connections, the bytes held by unread replies: the host's snapshot reads them), then the
    host with them (it makes the partitions and the metrics registry over its own snapshot), restored from
    its checkpoints if asked, then the runtime over the host and the wake-ups, then the servicer over all.
    ``loop`` runs on thread ``loop_thread`` and serves the process's calls; ``publish_tick``: the health port's.
    """
    wakeups = Wakeups(loop, loop_thread)
    watch = LoopWatch(loop, publish_tick)
    limits = ServiceLimits(**{**vars(cfg.limits), "max_push_bytes": cfg.max_push_bytes,
                              "chunk_bytes": cfg.chunk_bytes, "nonfinite": cfg.nonfinite,
                              "max_message_bytes": cfg.max_message_bytes})
    connections = Connections(limits.max_calls_per_peer, limits.max_connections, limits.max_watch_streams,
                              count=lambda name: host.wide.count(name))  # refusals: shard-wide (every layout's)
    replies = ReplyLedger(limits.max_reply_bytes_per_peer, limits.max_reply_bytes)
    requests = RequestLedger(limits.max_request_bytes_per_peer, limits.max_request_bytes)

    def gauges() -> dict[str, float]:
        replication = service.replication  # (a hot standby's primary: psserver.replication.shipper)
        return {"reply_bytes_held": replies.held_bytes, "request_bytes_held": requests.held_bytes,
                "connections": len(connections.calls),
                "watch_streams": connections.watch_streams, **watch.gauges(), **heap.gauges(),
                **(replication.gauges() if replication is not None else {})}

    budget = MemoryBudget(cfg.max_memory)
    heap = HeapKeeper(heap_bound(budget.limit))
    host = ShardHost(cfg.shard, lease_timeout=cfg.lease_timeout, join_timeout=cfg.join_timeout,
                     checkpoint_dir=cfg.checkpoint_dir,
                     checkpoint_every=cfg.checkpoint_every, on_change=wakeups.changed,
                     budget=budget, gauges=gauges)
    layouts = LayoutHost(host)  # the layout epochs served: layout 0 is ``host``
    host.metrics.read_from(lambda: layouts.current.snapshot())  # the newest layout's, as GetStats (shared: successor)
    if cfg.restore:  # the newest layout on disk: a later one's host serves (and counts) from now on
        host = layout_restore.restore(host, layouts, cfg.checkpoint_dir)
    elif cfg.restore_from:
        host.restore_states(reshard_states(cfg), ",".join(cfg.restore_from))
    elif initial_states:  # a promoted standby: the state its primary shipped last (psserver.replication)
        host.restore_states(initial_states, "its primary's last shipment", planned=True,
                            counter="replica_restores", note="promoted")
    runtime = Runtime(host, wakeups, limits.receive_buffers, tick=layouts.tick)
    # a live re-shard's side on this shard; its streams to peers carry the job's token (TLS to peers: not yet)
    handoffs = HandoffIO(layouts, runtime, ClientSecurity(token=cfg.security.token), cfg.handoff_timeout)
    service = ParameterServerService(host, runtime, limits, authenticated=cfg.security.authenticates,
                                     connections=connections, replies=replies, layouts=layouts, handoffs=handoffs,
                                     requests=requests, admin_token=cfg.security.admin_token)
    return ShardProcess(host, runtime, service, watch, heap)


class ShardServer:
    """A running shard: ``ShardServer(cfg).start()`` then ``.port``, ``.stop()``."""

    def __init__(self, cfg: ServerConfig, initial_states: list | None = None):
        """``initial_states``: one ShardState per partition to serve from (a promoted standby's)."""
        self.cfg, self.initial_states = cfg, initial_states
        self.service: ParameterServerService | None = None
        # Made by ``start`` (build_shard_process): ``shard`` is every partition this process serves
        # (psserver.partition.host; unpartitioned jobs use one), ``runtime`` what its calls run on.
        self.shard: ShardHost | None = None
        self.runtime: Runtime | None = None
        self.layouts: LayoutHost | None = None  # the layout epochs served (psserver.resharding.layout_host)
        self.handoffs: HandoffIO | None = None  # a live re-shard's side here (psserver.resharding.handoff.shard_ops)
        self.port = 0
        self.health_port = -1
        self.probe_port: ProbePort | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> "ShardServer":
        # Our one line for a port in use, before gRPC's C core logs its own (add_port.cc) and anything starts.
        check_bindable(self.cfg.host, self.cfg.port, "--port")
        if self.cfg.health_port > 0:
            check_bindable(self.cfg.host, self.cfg.health_port, "--health-port")
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        warm_up()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"shard{self.cfg.shard}-loop",
                                        daemon=True)
        self._thread.start()
        try:
            if self.cfg.health_port >= 0:  # started first: the loop's watchdog publishes its ticks to it
                self.probe_port = ProbePort(self.cfg.host, self.cfg.health_port)
            process = build_shard_process(self.cfg, self._loop, self._thread.ident,  # a --restore's reading too
                                          self.probe_port.publish_tick if self.probe_port else lambda t: None,
                                          self.initial_states)
            self.service = process.service
            self.shard, self.runtime, self._watch = process.host, process.runtime, process.watch
            self._heap = process.heap
            self.layouts, self.handoffs = process.service.layouts, process.service.handoffs
            tune_gc()
            self.port = asyncio.run_coroutine_threadsafe(self._start(process.service), self._loop).result(START_TIMEOUT)
            if self.probe_port is not None:
                self.probe_port.set_serving(True)
                self.health_port = self.probe_port.port
                log.info("shard %d answers health checks on %s too (a process of its own)", self.cfg.shard,
                         host_port(self.cfg.host, self.health_port))
        except BaseException:
            if self.probe_port is not None:
                self.probe_port.stop()
            if getattr(self, "server", None) is not None:  # a gRPC server dropped unstopped warns at exit
                asyncio.run_coroutine_threadsafe(self.server.stop(0), self._loop).result(START_TIMEOUT)
            self._close_loop()
            raise
        log.info("shard %d serving on %s (table kernel: %s)", self.cfg.shard, self.address, kernel.name())
        return self

    async def _start(self, service: ParameterServerService) -> int:
        opts = [
            ("grpc.max_receive_message_length", self.cfg.max_message_bytes),
            ("grpc.max_send_message_length", self.cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Connections that go quiet are probed, so a vanished client's calls end and free what they hold.
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # a replicated shard's clients probe every second (psserver.protocol.security.REPLICA_CHANNEL): not
            # answered with GOAWAY (too many pings) while a call waits with no data
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
        ]
        self.server = grpc.aio.server(
            options=opts,
            interceptors=self.cfg.security.aio_interceptors(
                lambda method: self.shard.wide.count("refused_UNAUTHENTICATED")),
        )
        add_service(service, self.server)
        self.health = CappedHealth(service.connections)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = host_port(self.cfg.host, self.cfg.port)
        creds = self.cfg.security.credentials()
        try:
            port = (self.server.add_insecure_port(address) if creds is None
                    else self.server.add_secure_port(address, creds))
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e}") from None
        if port == 0:
            raise OSError(f"cannot listen on {address}: the address is in use or not local")
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._timer = asyncio.ensure_future(self.runtime.round_timer())
        self._heap_checks = asyncio.ensure_future(self._keep_heap())
        return port

    async def _keep_heap(self) -> None:
        """Once a second, off the loop: the free heap read, and given back past its bound (psserver.state.heap)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(CHECK_SECONDS)
            try:
                await loop.run_in_executor(None, self._heap.check)
            except Exception:  # noqa: BLE001 -- a failed check must not end the checks
                log.exception("shard %d: the heap check failed", self.cfg.shard)

    def on_state_worker(self, fn, *args):
        """``fn(*args)`` on this process's state worker, from another thread (its event loop's): its answer, or
        what it raised.  For tools and tests that act on a running shard's state as a call would."""
        async def run():
            return await self.runtime.offload(fn, *args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(START_TIMEOUT)

    @property
    def address(self) -> str:
        return host_port(self.cfg.host, self.port)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def capture_since(self, since: list | None) -> tuple[list[bytes], list, bool]:
        """On the state worker: every partition's state with only the table rows touched after ``since`` (the
        marks the last call returned; None: whole states), the marks now, and whether any table is partial
        (ShardHost.capture_since)."""
        return self.layouts.current.capture_since(since)

    def exposed(self) -> tuple:
        """The shard's read counters now (ShardHost.exposed): a hot standby's shipper compares them with a capture's."""
        return self.layouts.current.exposed()

    def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING at once, waiting pulls released (UNAVAILABLE), in-flight calls drain within ``grace``,
        then a final checkpoint that includes the open round."""
        if self._stopped or self._loop is None:
            return
        self._stopped = True
        grace = self.cfg.shutdown_grace if grace is None else grace
        if self.probe_port is not None:
            self.probe_port.set_serving(False)
        try:
            asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop).result(grace + START_TIMEOUT)
        finally:
            self._watch.stop()
            self._close_loop(before_close=self.runtime.shutdown)  # the state worker finishes what it runs
            self.handoffs.join()  # a live re-shard's stream threads (stopped in _stop)
            if self.probe_port is not None:
                self.probe_port.stop()
            self.layouts.final_checkpoint()  # the newest layout's; a tombstone writes nothing more

    async def _stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        self.runtime.begin_stopping()
        self.handoffs.stop()  # its streams' threads end
        self.layouts.stop()  # every layout's pulls waiting for a round return UNAVAILABLE: their trainers retry
        self._timer.cancel()
        self._heap_checks.cancel()
        await self.server.stop(grace)

    def _close_loop(self, before_close=None) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        if before_close is not None:
            before_close()  # threads that may still post to the loop end while it is stopped, not closed
        self._loop.close()
