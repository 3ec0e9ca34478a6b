"""What the async servicer runs on: the state worker, version waiters, receive buffers, the round timer.

* ``state``: ONE thread that runs every shard method touching tensors or the
  round, in the order calls arrive -- so they never contend, and the event loop
  never blocks on them.  A shard whose slice is small (``INLINE_STATE_ELEMENTS``)
  runs them on the loop instead: its tensor work takes microseconds, less than
  the hop to a thread and back (and the interpreter-lock hand-offs it costs), and
  that is the regime of hundreds of trainers per shard.  Work whose cost is not
  the slice's (a state digest of the tables, a big row call) goes to the worker
  whatever the slice (``offload``), and while it runs the small work queues
  behind it there instead of blocking the loop on the shard's lock.
* ``VersionWaiters``: pulls waiting for a version are futures keyed by that
  version; a state change wakes only the ones it satisfies (readiness is
  monotone in the version), so a round closing for 1,024 trainers costs 1,024
  wake-ups, not 1,024 per push.
* ``ReceiveBuffers``: a bounded pool of slice-sized buffers; a push beyond the
  bound waits for one (its bytes wait in gRPC's flow control), so memory is
  bounded by the pool, not by the number of trainers.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Awaitable, Callable

import torch

from psserver.partition.host import ShardHost
from psserver.partition.shard import Shard
from psserver.protocol.errors import PsError
from psserver.protocol.rules import Mode
from psserver.serving.reply_holds import ReplyHolds

log = logging.getLogger(__name__)


WAKE_BATCH = 16  # waiters resolved per turn of the event loop
# Slices up to this many elements have their shard methods run on the event loop: an optimizer step or a
# round sum of 16K floats takes microseconds, less than a hop to the state worker and back.  Kept under
# torch's parallel grain (32K elements): a larger op runs on OpenMP threads that the loop's thread would then
# own and keep spinning -- which halved a 2-trainer CNN run's throughput when the bound was 64K.
INLINE_STATE_ELEMENTS = 1 << 14
# With one intra-op thread (ps-server's default, --torch-threads 1) there are no OpenMP threads to spin, and a
# dense slice's step runs on the loop up to this bound: 1 MB of fp32, an apply of a few hundred microseconds
# on one core, less than the hop to the worker and back costs a small model's step under load (issue 21).
INLINE_DENSE_ELEMENTS_ONE_THREAD = 1 << 18


class VersionWaiters:
    """Futures waiting for ``ready(min_version)``; woken from any thread with ``changed_threadsafe``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ready: Callable[[int], bool], loop_thread: int | None = None):
        self._loop, self._ready = loop, ready
        self._loop_thread = threading.get_ident() if loop_thread is None else loop_thread  # default: made on the loop
        self._waiting: dict[int, set[asyncio.Future]] = {}  # sets: a waiter leaves in O(1), whoever wakes it
        self._scheduled = False

    def changed_threadsafe(self) -> None:
        if not self._scheduled:  # coalesce: one wake-up per burst of changes
            on_loop = threading.get_ident() == self._loop_thread
            if on_loop and not self._waiting:
                return  # nobody waits, and on the loop nobody can start to before this returns: no turn of the loop
            self._scheduled = True
            if on_loop:
                self._loop.call_soon(self._wake)
            else:
                self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        """Resolve the satisfied waiters, WAKE_BATCH at a time: a round that closes for 1,024 trainers would
        otherwise queue 1,024 replies ahead of a health check that arrives meanwhile."""
        self._scheduled = False
        woken = 0
        for version in sorted(self._waiting):
            if not self._ready(version):
                break  # readiness is monotone: no higher version is ready either
            waiters = self._waiting[version]
            while waiters and woken < WAKE_BATCH:
                fut = waiters.pop()
                if not fut.done():
                    fut.set_result(True)
                    woken += 1
            if waiters:
                self._scheduled = True
                self._loop.call_soon(self._wake)  # the rest after what is queued now, health checks included
                return
            del self._waiting[version]

    async def wait(self, min_version: int, timeout: float) -> bool:
        """True once ready, False after ``timeout`` seconds; cancelled at once with its call."""
        if self._ready(min_version):
            return True
        if timeout <= 0:
            return False
        fut = self._loop.create_future()
        self._waiting.setdefault(min_version, set()).add(fut)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            return self._ready(min_version)
        finally:
            waiters = self._waiting.get(min_version)
            if waiters is not None:
                waiters.discard(fut)
                if not waiters:
                    del self._waiting[min_version]

    def __len__(self) -> int:
        return sum(len(v) for v in self._waiting.values())


class _Held:
    """A receive buffer held by one push; the shard may swap it for another (see Shard.push)."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer: torch.Tensor | None = buffer

    async def hand_over(self, call: Awaitable):
        """Await the state worker's use of this buffer.  If the call is cancelled meanwhile the worker
        still owns the buffer (it may become the round's sum): forget it rather than reuse it."""
        try:
            return await call
        except asyncio.CancelledError:
            self.buffer = None
            raise
        except BaseException as e:
            if not isinstance(e, PsError):  # an unexpected failure: do not trust the buffer's ownership
                self.buffer = None
            raise


class ReceiveBuffers:
    """At most ``max(min_buffers, budget_bytes // slice bytes)`` receive buffers at once.

    A buffer is held from a push's first chunk until the shard took its gradient,
    which includes waiting for the client to end its stream: with big slices a
    few buffers bound the memory; with small ones (many trainers, a small model)
    a fixed few would make hundreds of pushes queue for a buffer, so the bound is
    in bytes.
    """

    def __init__(self, min_buffers: int, budget_bytes: int = 256 << 20):
        self.min_buffers, self.budget_bytes = min_buffers, budget_bytes
        self._in_use = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        # Free buffers by length: a partitioned job's pushes come in a few lengths, and a buffer of another
        # length cannot be reused (it was once popped and dropped: 30 fresh 18 MB buffers in 50 pushes).
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._free_count = 0

    def limit(self, length: int) -> int:
        return max(self.min_buffers, self.budget_bytes // max(4 * length, 1))

    @asynccontextmanager
    async def take(self, length: int):
        limit = self.limit(length)
        while self._in_use >= limit:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._wake_one()  # woken but gone: pass the turn on
                raise
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
        self._in_use += 1
        same = self._free.get(length)
        buf = same.pop() if same else None
        if buf is not None:
            self._free_count -= 1
        held = _Held(buf if buf is not None else torch.empty(length, dtype=torch.float32))
        try:
            yield held
        finally:
            if held.buffer is not None and self._free_count < limit:
                self._free[held.buffer.numel()].append(held.buffer)
                self._free_count += 1
            self._in_use -= 1
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return


class Wakeups:
    """What a shard's change wakes: pulls waiting for a partition's version, PullRows waiting for a table's,
    and the round timer of a stale-timeout job.

    Made first (psserver.serving.server.build_shard_process): its ``changed`` is the ``on_change`` every partition is
    made with, called from whichever thread changed the partition.  Waiters are made on the loop by the calls
    that wait (``pulls``, ``table``); a change that finds none wakes nobody, for nobody waited before it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, loop_thread: int):
        self.loop, self.loop_thread = loop, loop_thread
        self.timer = asyncio.Event()  # set on every change of a stale-timeout job: wakes the round timer
        self._pulls: dict[Shard, VersionWaiters] = {}  # by partition (one of each layout's: psserver.resharding.layout_host)
        self._tables: dict = {}  # by (partition 0 of a layout, which holds the tables; table name)

    def pulls(self, part: Shard) -> VersionWaiters:
        """The waiters for ``part``'s versions (on the loop)."""
        waiters = self._pulls.get(part)
        if waiters is None:
            waiters = self._pulls[part] = VersionWaiters(self.loop, part.pulls.pull_ready, self.loop_thread)
        return waiters

    def table(self, key, ready: Callable[[int], bool]) -> VersionWaiters:
        """The waiters for a table's versions, ``key`` (its shard -- each layout's tables are their own -- and
        name), ``ready`` their predicate (on the loop)."""
        waiters = self._tables.get(key)
        if waiters is None:
            waiters = self._tables[key] = VersionWaiters(self.loop, ready, self.loop_thread)
        return waiters

    def changed(self, part: Shard) -> None:
        """``part`` changed (from any thread): wake what may wait on it."""
        if self.loop.is_closed():  # the server stopped: nobody waits any more
            return
        waiters = self._pulls.get(part)
        if waiters is not None:
            waiters.changed_threadsafe()
        if part.partition == 0:  # a change of partition 0 may be a table's: wake its waiting PullRows too
            for waiters in list(self._tables.values()):
                waiters.changed_threadsafe()
        if part.mode() == Mode.STALE_TIMEOUT:
            if threading.get_ident() == self.loop_thread:
                self.timer.set()
            else:
                self.loop.call_soon_threadsafe(self.timer.set)


def _deliver(fut: asyncio.Future, result, error: BaseException | None) -> None:
    """On the loop: the state worker's result, unless the caller stopped waiting."""
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class Runtime:
    """The threads the servicer hands work to, for ``host``'s partitions; woken through ``wakeups``."""

    def __init__(self, host: ShardHost, wakeups: Wakeups, receive_buffers: int,
                 tick: Callable[[], float | None] | None = None):
        """``tick``: what the round timer runs (default ``host.tick``; every layout's host: LayoutHost.tick)."""
        self.loop, self.loop_thread = wakeups.loop, wakeups.loop_thread
        self.host, self.wakeups = host, wakeups
        self._tick = tick
        self.state = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shard{host.shard_id}-state")
        self.buffers = ReceiveBuffers(receive_buffers)  # shared by the partitions: memory is the process's
        self.holds = ReplyHolds(self.loop, self.loop_thread)  # replies waiting for a live re-shard's DECIDE
        self._stopping = False
        self._offloaded = 0  # calls handed to the state worker by ``offload`` and not finished
        # The bound for run_state's work on the loop (read once: the process's intra-op threads are set before).
        self.inline_elements = INLINE_DENSE_ELEMENTS_ONE_THREAD if torch.get_num_threads() == 1 else \
            INLINE_STATE_ELEMENTS

    @property
    def stopping(self) -> bool:
        """The server is stopping: waits that end say so (UNAVAILABLE) and the round timer ends."""
        return self._stopping

    def begin_stopping(self) -> None:
        self._stopping = True

    def waiters(self, partition: int = 0) -> VersionWaiters:
        """Pulls waiting for partition ``partition``'s versions (on the loop)."""
        return self.wakeups.pulls(self.host.parts[partition])

    def part_waiters(self, part: Shard) -> VersionWaiters:
        """Pulls waiting for ``part``'s versions: a partition of any layout this process serves (on the loop)."""
        return self.wakeups.pulls(part)

    def table_waiters(self, key, ready: Callable[[int], bool]) -> VersionWaiters:
        """PullRows waiting for a table's versions, ``key`` (shard, name): the shard of a layout (on the loop)."""
        return self.wakeups.table(key, ready)

    def inline(self) -> bool:
        """Every partition's slice is small (a partitioned job's are at least 256 elements apart at most), the
        state worker runs no offloaded call (one would hold the shard's lock, which inline work would then wait
        for on the loop), and no checkpoint is due at a partition's next version (``_capture_next``)."""
        return self._inline_below(INLINE_STATE_ELEMENTS)

    def _inline_state(self) -> bool:
        """As ``inline`` with ``inline_elements`` for the bound: where ``run_state`` runs its call."""
        return self._inline_below(self.inline_elements)

    def _inline_below(self, elements: int) -> bool:
        return (not self._offloaded and max(p.slice_length() for p in self.host.parts) <= elements
                and not self._capture_next())

    def _capture_next(self) -> bool:
        """A partition's next step hands a checkpoint to the writer: that step copies the whole state, every
        table's rows and optimizer state with it (Shard.capture: ~1 s for a 1M-row table of dim 16), so the call
        that may make it runs on the state worker however small its own work."""
        return any(p.checkpoints.due(p.version + 1) for p in self.host.parts)

    def offload(self, fn, *args) -> asyncio.Future:
        """``fn(*args)`` on the state worker whatever the slice: for work that costs more than the slice's
        (a digest of the tables, a big row call), which would stall every call and health check on the loop."""
        self._offloaded += 1
        fut = self.loop.create_future()  # the worker's result in one call_soon_threadsafe, as run_state hands it
        try:
            self.state.submit(self._on_worker, fut, fn, args, True)
        except BaseException:  # (the worker was shut down: nothing runs)
            self._offloaded -= 1
            raise
        return fut

    def _deliver_offloaded(self, fut: asyncio.Future, result, error: BaseException | None) -> None:
        """On the loop: an offloaded call's ``fn`` returned on the worker (or was skipped, its caller gone)."""
        self._offloaded -= 1
        _deliver(fut, result, error)

    def run_state(self, fn, *args) -> asyncio.Future:
        """``fn(*args)`` on the state worker -- or at once on the loop for a small slice (see INLINE_STATE_ELEMENTS
        and INLINE_DENSE_ELEMENTS_ONE_THREAD); a future either way."""
        fut = self.loop.create_future()
        if not self._inline_state():
            # Not run_in_executor: its wrapped future, chained both ways, cost more per push than the rest of
            # the hop; the result comes back in one call_soon_threadsafe.  A call cancelled before the worker
            # reaches it is not run, as with run_in_executor.
            self.state.submit(self._on_worker, fut, fn, args)
            return fut
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 -- delivered to the awaiting caller, as the executor would
            fut.set_exception(e)
        return fut

    def _on_worker(self, fut: asyncio.Future, fn, args, offloaded: bool = False) -> None:
        """``fn(*args)`` unless its caller stopped waiting first.  ``offloaded`` (``offload``'s calls): counted in
        flight until ``fn`` returned here, not until its caller stopped waiting -- a cancelled handler's ``fn``
        still runs, holding the shard's lock, and inline work must not run beside it; the count drops in the
        same loop callback that hands the result over, so a caller resumes seeing it dropped."""
        result = error = None
        if not fut.cancelled():
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 -- delivered to the awaiting caller, as the executor would
                error = e
        elif not offloaded:
            return
        try:
            self.loop.call_soon_threadsafe(self._deliver_offloaded if offloaded else _deliver, fut, result, error)
        except RuntimeError:  # the loop closed (the server stopped): no caller is waiting any more
            pass

    async def acquire_snapshot(self, part: Shard, rank: int, trainer_id: str, fingerprint: str, wire: int):
        """What a pull streams: on the loop when no step runs (the common case), else Pulls.acquire_snapshot
        on the state worker; if the call is cancelled meanwhile, the snapshot it gets is released when it
        arrives (else a step would move the parameters aside forever)."""
        fast = part.pulls.try_acquire_snapshot(wire)
        if fast is not None:
            return fast
        fut = self.run_state(part.pulls.acquire_snapshot, rank, trainer_id, fingerprint, wire)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() else
                                  part.pulls.release_snapshot(f.result()[1]))
            raise

    async def round_timer(self) -> None:
        """Expires leases and closes stale-timeout rounds at their deadlines (Shard.tick on the state worker)."""
        clock = self.host.clock
        while not self.stopping:
            try:
                next_at = await self.run_state(self._tick or self.host.tick)
            except Exception:  # noqa: BLE001 -- the timer must outlive any one bad tick
                log.exception("shard %d: round timer tick failed", self.host.shard_id)
                next_at = None
            delay = 1.0 if next_at is None else min(1.0, max(0.001, next_at - clock()))
            self.wakeups.timer.clear()
            try:
                await asyncio.wait_for(self.wakeups.timer.wait(), delay)
            except asyncio.TimeoutError:
                pass

    def shutdown(self) -> None:
        self.state.shutdown(wait=True)
