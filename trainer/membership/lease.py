"""A trainer's lease with the shards: heartbeats to every slot while it computes or waits.

``Heartbeats`` is started by the join (trainer.membership.registration, at a quarter of the shortest lease the
shards answered) and stopped before the channels close (trainer.membership.session.Session.stop_heartbeats).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import grpc

from trainer.channels.client import ShardClient, ShardedClient

log = logging.getLogger("trainer.membership.session")  # the session's lines, as before the split


class Heartbeats:
    """The heartbeat thread over ``client``'s slots (counted ``heartbeat_failures``)."""

    def __init__(self, client: ShardedClient):
        self.client = client
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, interval: float) -> None:
        """A heartbeat to every slot each ``interval`` seconds, on a thread of its own."""
        self._thread = threading.Thread(target=self._loop, args=(interval,), name="ps-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self, interval: float) -> None:
        """Keeps this trainer's lease while it computes or waits; a dead process stops sending.

        Every slot's channel is probed, side by side: a heartbeat on a connection that died half-open (a
        dropped link) fails it at once, so a call in flight on it is retried instead of waiting ~30 s for
        keepalive (measured: without them, the partition fault soak stalled 30 s per dropped connection);
        side by side, one hung shard delays no other shard's heartbeats.  (Partition 0's also renews the
        lease on every partition of its shard: psserver.partition.host.)"""
        with ThreadPoolExecutor(max_workers=min(16, len(self.client.parts)), thread_name_prefix="ps-beat") as beats:
            while not self._stop.wait(interval):
                futures_wait([beats.submit(self._once, s, interval) for s in self.client.parts])

    def _once(self, s: ShardClient, timeout: float) -> None:
        try:
            s.heartbeat(timeout=timeout)
        except grpc.RpcError as e:
            self.client.count("heartbeat_failures")
            log.warning("heartbeat to %s (%s) failed: %s %s", s.name, s.address, e.code().name, e.details())

    def stop(self) -> None:
        """Before the channels close under them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
