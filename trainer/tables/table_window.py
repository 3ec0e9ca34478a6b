"""Async table pushes that do not wait for their acknowledgement: up to W per table in flight (``push_window=W``).

``ShardedRows.push`` of an async table hands its per-shard payloads here: each (shard, table) lane gives the
push a number of its own (``PushNumbers.take``) and its base (the version of the rows this step read), fixed
now, and the push goes to the table's window (trainer.tables.push_window), which sends it on a thread of its own and
returns once at most W-1 of the table's pushes are unacknowledged -- so at most W per (shard, table) are on
the wire, and at most ROW_PUSHES_ON_WIRE_PER_SHARD per shard across the tables (under the shard's per-rank call
cap).  Exactly once: a lost reply is retried inside the call under the same number (the shard answers
DUPLICATE where it applied it; an async table keeps holes for pushes overtaken on the way,
psserver.sparse.serving); a push that failed for good stays in the window, the next ``push`` of the table
(or ``flush``) sends it again under its numbers, to the shards that did not answer, before anything new.

A shard found restarted is rejoined once (``on_restart``; the pushes in flight that find it later are lost
there, not rejoined again) and the pushes to it that found it are lost, counted in ``pushes_lost``, as
without a window.  An acknowledgement moves the lane's known version on, not its base: the next push's base
stays the version its own rows were read at, so the shard counts this trainer's pushes in flight in its
staleness.  ``in_flight`` per lane is what a row cache adds to the version it knows (trainer.tables.row_cache must
not serve a row older than its bound counting the pushes still on the way).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import grpc
import torch

from psserver.protocol.limits import ROW_PUSHES_ON_WIRE_PER_SHARD
from trainer.channels.client import restarted
from trainer.tables.push_window import PushWindow, WindowFailed
from trainer.tables.row_errors import RowsPushFailed

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TablePushParts:
    """One step's push of one table: shard -> (ids, grads, num_samples, sequence, base, restart generation);
    ``done`` (shard -> outcome) survives a failure, so sending again skips the shards that answered."""

    table: str
    parts: dict[int, tuple]
    done: dict[int, str] = field(default_factory=dict)


class PartsFailed(Exception):
    """A windowed table push failed on some shards for good: ``failed`` shard -> error, ``done`` the shards
    that answered."""

    def __init__(self, failed: dict[int, BaseException], done: list[int]):
        self.failed, self.done = failed, done
        super().__init__(f"shards {sorted(failed)} failed: {failed[min(failed)]}")


class TableWindows:
    """The async tables' windows of ``rows`` (a trainer.tables.sparse_client.ShardedRows), ``size`` pushes each."""

    def __init__(self, rows, tables: list[str], size: int):
        self.rows, self.size = rows, size
        m = len(rows.client.shards)
        self._sends = ThreadPoolExecutor(max_workers=size * max(1, len(tables)), thread_name_prefix="ps-tw")
        self._io = ThreadPoolExecutor(max_workers=min(64, size * m * max(1, len(tables))),
                                      thread_name_prefix="ps-tw-io")
        self.windows = {t: PushWindow(size, self._sends.submit) for t in tables}
        self.in_flight: Counter = Counter()  # (shard, table) -> parts sent and not yet answered
        self._lock = threading.Lock()  # of in_flight, written by the senders
        self._generation = [0] * m  # shard -> rejoins so far (a push made before one does not rejoin again)
        self._restart_locks = [threading.Lock() for _ in range(m)]
        # parts on the wire to each shard, across tables: a shard refuses a rank's calls past --max-calls-per-rank
        self._wire = [threading.BoundedSemaphore(ROW_PUSHES_ON_WIRE_PER_SHARD) for _ in range(m)]
        self._handed: set[str] = set()  # tables whose failed push() call's gradient is in the window already

    # ------------------------------------------------------------------ the caller's thread
    def push(self, table: str, spec, ids: torch.Tensor, grads: torch.Tensor, num_samples: int) -> None:
        """Hand one step's push of ``table`` to its window and go on; RowsPushFailed if a push of the table
        failed for good (the caller keeps its gradient and calls again: that call sends the failed ones again
        and not this gradient twice)."""
        if grads.shape != (len(ids), spec.dim):
            raise ValueError(f"grads has shape {tuple(grads.shape)}, table {table!r} needs ({len(ids)}, {spec.dim})")
        grads = grads.detach().to("cpu", torch.float32)
        try:
            self.hand_in(table, {s: (ids[pos], grads[pos], num_samples) for s, pos in enumerate(self.rows.split(ids))})
        except WindowFailed as e:
            raise self.rows_failure(table, e) from e
        self.rows.ahead.pushed(table)
        if table in self.rows.caches:
            self.rows.caches[table].pushed(ids)

    def hand_in(self, table: str, payloads: dict[int, tuple]) -> None:
        """Hand one step's push (shard -> (ids, grads, num_samples)) to the table's window; WindowFailed as
        ``push`` says."""
        w = self.windows[table]
        self._retry(w)  # a failed push goes again under its numbers before anything new
        if table in self._handed:  # the call that failed had handed its gradient in: wait for room only
            w.wait_room()
            self._handed.discard(table)
            return
        parts = {}
        for s, (ids, grads, n) in payloads.items():
            lane = self.rows.book.lanes[(s, table)]
            parts[s] = (ids, grads, n, lane.take(), lane.base, self._generation[s])
        with self._lock:
            self.in_flight.update({(s, table): 1 for s in parts})
        before, waits = w.stats.submitted, w.stats.full_waits
        try:
            w.submit(partial(self._send, TablePushParts(table, parts)))
        except WindowFailed:
            if w.stats.submitted > before:
                self._handed.add(table)
            else:  # not sent: its numbers are given up (the shard keeps them as holes that age out)
                with self._lock:
                    self.in_flight.subtract({(s, table): 1 for s in parts})
            raise
        finally:
            self.rows.count(window_pushes_sent=w.stats.submitted - before,
                             window_full_waits=w.stats.full_waits - waits)

    def flush(self) -> None:
        """Wait for every table push in flight; failed ones are sent again first (RowsPushFailed if some fail)."""
        for table, w in self.windows.items():
            self._retry(w)
            try:
                w.drain()
            except WindowFailed as e:
                raise self.rows_failure(table, e) from e

    def rows_failure(self, table: str, e: WindowFailed):
        """The window's failure as an unwindowed push raises it (RowsPushFailed): by shard, with what answered."""
        failed, done = {}, None
        for err in e.errors.values():
            failed.update({s: x for s, x in getattr(err, "failed", {0: err}).items() if s not in failed})
            done = set(getattr(err, "done", ())) if done is None else done & set(getattr(err, "done", ()))
        return RowsPushFailed(table, sorted(done or ()), failed, [s.address for s in self.rows.client.shards])

    def _retry(self, w: PushWindow) -> None:
        """Send ``w``'s failed pushes again, under their numbers (counted in ``window_pushes_retried``)."""
        if w.failed():
            self.rows.count(window_pushes_retried=w.retry_failed())

    def failed(self, table: str) -> bool:
        """A push of ``table`` (windowed) failed for good and waits to be sent again or abandoned."""
        return table in self.windows and (bool(self.windows[table].failed()) or table in self._handed)

    def abandon(self, table: str) -> int:
        """Drop the table's failed pushes; returns how many shards' parts were given up (maybe applied there)."""
        w = self.windows[table]
        failed = [p.send.args[0] for p in w.failed()]
        w.abandon_failed()
        self._handed.discard(table)
        undone = [(s, p.table) for p in failed for s in p.parts if s not in p.done]
        with self._lock:
            self.in_flight.subtract(Counter(undone))
        return len(undone)

    def idle(self) -> bool:
        """No push in flight and none failed: a step may push the tables itself, as one call a shard with its dense
        slice (trainer.stepping.step_call), with nothing of the window to overtake."""
        with self._lock:
            if any(n > 0 for n in self.in_flight.values()):
                return False
        return not any(self.failed(t) for t in self.windows)

    def in_flight_of(self, table: str) -> list[int]:
        with self._lock:
            return [self.in_flight[(s, table)] for s in range(len(self._generation))]

    def resynced(self, shard: int) -> None:
        """Shard ``shard`` was rejoined: pushes made before this that find it restarted do not rejoin again."""
        self._generation[shard] += 1

    def close(self) -> None:
        self._sends.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the window's threads
    def _send(self, push: TablePushParts) -> TablePushParts:
        todo = [s for s in push.parts if s not in push.done]
        futures = {s: self._io.submit(self._send_part, push, s) for s in todo}
        failed = {}
        for s, f in futures.items():
            try:
                push.done[s] = f.result()
            except Exception as e:  # noqa: BLE001 -- kept by shard; the push stays in the window
                failed[s] = e
                continue
            with self._lock:
                self.in_flight[(s, push.table)] -= 1
        if failed:
            log.warning("a push of table %r failed on shards %s (%s); kept, to be sent again under its numbers",
                        push.table, sorted(failed), failed[min(failed)])
            raise PartsFailed(failed, sorted(push.done))
        return push

    @contextmanager
    def _on_wire(self, s: int):
        """One of shard ``s``'s places on the wire (ROW_PUSHES_ON_WIRE_PER_SHARD), waited for and counted
        (``window_wire_waits``) when every one is taken."""
        wire = self._wire[s]
        if not wire.acquire(blocking=False):
            self.rows.count(window_wire_waits=1)
            wire.acquire()
        try:
            yield
        finally:
            wire.release()

    def _send_part(self, push: TablePushParts, s: int) -> str:
        ids, grads, n, sequence, base, generation = push.parts[s]
        shard = self.rows.client.shards[s]
        try:
            with self._on_wire(s):
                return self.rows.push_once(shard, self.rows.part(shard, push.table, ids, grads, n, None,
                                                                   numbered=(sequence, base)))
        except grpc.RpcError as e:
            if not restarted(e) or self.rows.on_restart is None:
                raise
            with self._restart_locks[s]:
                if generation == self._generation[s]:  # the first to find this restart: rejoin (resync)
                    self.rows.on_restart(shard, e)
        self.rows.book.count_lost(s, push.table)
        log.warning("a push of table %r to shard %d was lost with its restart", push.table, s)
        return "lost"
