"""The trainer's side of sparse tables: PullRows and PushRows fanned out to the shards that hold the rows.

``ShardedRows`` rides on a ``trainer.channels.client.ShardedClient``: its channels, identity,
retry policy, thread pool and counters.  Ids are split by ``shard_of`` (the same
splitmix64 placement the shards check); every shard gets one call per pull (if it
holds any of the ids) and one per push (always, possibly of no ids, so sync rounds
close and Adam's per-table step count matches one process).

Versions: each (shard, table) has its own version.  A push's base is the version of
this trainer's latest pull of that table from that shard (or what the shard said
after the last push).  In sync and stale-timeout modes a pull waits for the version
after this trainer's last push to that table on that shard -- the round it was in
closed; in async mode it waits for nothing.

Where it lives: ``ShardedRows`` is the one object the embeddings, the prefetch, the row cache, the table window and
the Step call (trainer.stepping.step_call: ``begin_push``/``part_request``/``part_answered``/``end_push``) all hold,
so its public surface is wide; it is composed of rooms that each own their part and hands on to them: which shard
holds which ids and the row calls to them (``routes``, trainer.tables.row_routes; one call to one shard is
trainer.tables.row_calls), the pull side with the rows prefetched ahead (``pulls``, trainer.tables.row_pulls), the push
side -- numbered, encoded, settled by shard (``pushes``, trainer.tables.row_pushes); the lanes' versions, numbering and
kept pushes are trainer.tables.row_lanes (numbering: trainer.channels.push_numbers, shared with the dense slices);
async tables' windows are trainer.tables.table_window.  What stays here: the tables, their counters, caches and
window, and what a restart or a layout switch does to all of them.

Exactly once: each (shard, table) numbers its pushes from 1; a push whose reply was
lost (UNAVAILABLE, DEADLINE_EXCEEDED) is retried with the same number and the shard
answers DUPLICATE instead of applying it twice.  A push that failed for good on some
shards raises ``RowsPushFailed`` and keeps the gradients: calling ``push`` again for
that table resends them to the unfinished shards only, under the same numbers;
``abandon(table)`` drops them instead, and the next push gets new numbers (a shard
that did apply the dropped one must not answer DUPLICATE to a new gradient).

Shard restarts: a pull answered a version older than one seen before counts the
versions the restored shard lost (async tables go on from it as they are); a row
call answered NOT_FOUND, FAILED_PRECONDITION or OUT_OF_RANGE
(trainer.channels.client.restarted; a pull waiting past what a restored shard can
reach is refused OUT_OF_RANGE too) hands the shard to ``on_restart`` -- the trainer
registers again there and calls ``resync`` with the tables' versions read from the
shard.  Every lane of that shard then goes on from those versions under new
numbers; the push that found the restart goes again there (as the dense slot's
does), a failed push still kept for that shard is dropped and counted
(``pushes_lost``), as are the versions the shard rolled back (``versions_lost``).
A pull that found it is made again.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Callable

import torch

from psserver.protocol.codec import DEFAULT_CHUNK_BYTES
from psserver.protocol.job import JobSpec, table_mode
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rows.table import TableSpec
from psserver.protocol.rules import Mode
from trainer.channels.client import ShardClient, ShardedClient
from trainer.tables.row_cache import RowCache
from trainer.tables.row_calls import RowCalls
from trainer.tables.row_errors import RowsCallFailed, RowsPushFailed  # noqa: F401 -- re-exported (their old home)
from trainer.tables.row_lanes import RowLanes
from trainer.tables.row_prefetch import Claim, RowPrefetch
from trainer.tables.row_pulls import RowPulls
from trainer.tables.row_pushes import PushPlan, RowPushes, RowsPart
from trainer.tables.row_routes import RowRoutes

log = logging.getLogger(__name__)


class ShardedRows:
    """Sparse tables of ``job`` over the shards of ``sharded_client``."""

    def __init__(self, sharded_client: ShardedClient, job: JobSpec, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 on_restart: Callable | None = None):
        self.client, self.job = sharded_client, job
        self.tables: dict[str, TableSpec] = {t.name: t for t in job.tables}
        self.modes = {t.name: table_mode(t, job) for t in job.tables}
        m = len(sharded_client.shards)
        self.counters: Counter = Counter()
        self._lock = threading.Lock()  # of ``counters``, which the lanes' book counts into too
        self.book = RowLanes(self.modes, m, self.counters, self._lock)  # versions, numbering, kept pushes
        self.caches: dict[str, RowCache] = {}  # tables with a worker-side row cache (use_cache)
        self.window = None  # async tables' push window (use_window; trainer.tables.table_window)
        # on_restart(shard_client, error): called when a row call finds the shard restarted (RowRoutes)
        self.routes = RowRoutes(sharded_client, self.count, on_restart)
        self.pulls = RowPulls(self.routes, self.book, self.tables, self.modes, self.caches, self.known_versions,
                              self.count)
        self.pushes = RowPushes(self.routes, self.book, self._spec, self.pulls.ahead, self.caches, chunk_bytes,
                                self.count, self._lock)

    @property
    def ahead(self) -> RowPrefetch:
        """The next batches' rows, pulled ahead (trainer.tables.row_prefetch; the pull side's)."""
        return self.pulls.ahead

    @property
    def calls(self) -> RowCalls:
        """One row call to one shard, retried (the routes')."""
        return self.routes.calls

    @property
    def on_restart(self) -> Callable | None:
        """on_restart(shard_client, error): registers again and calls resync() (None: the error is raised)."""
        return self.routes.on_restart

    @property
    def fuse(self) -> bool:
        """A sync table's push carries the next batch's prefetched ids (PushPullRows; RowPushes.fuse)."""
        return self.pushes.fuse

    @fuse.setter
    def fuse(self, on: bool) -> None:
        self.pushes.fuse = on

    @property
    def name_pulls(self) -> bool:
        """A push names the pulls its rows were read at instead of resending their ids (RowPushes.name_pulls)."""
        return self.pushes.name_pulls

    @name_pulls.setter
    def name_pulls(self, on: bool) -> None:
        self.pushes.name_pulls = on

    def count(self, **amounts: int) -> None:
        with self._lock:
            self.counters.update(amounts)

    def _spec(self, table: str) -> TableSpec:
        spec = self.tables.get(table)
        if spec is None:
            raise KeyError(f"table {table!r} is not in the job (its tables: {', '.join(self.tables) or 'none'})")
        return spec

    def split(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """For each shard, the positions in ``ids`` of the ids it holds (RowRoutes.split)."""
        return self.routes.split(ids)

    # -- the row cache (trainer.tables.row_cache) and the push window (trainer.tables.table_window) ----------
    def use_cache(self, table: str, rows: int, max_staleness: int = 0) -> None:
        """Cache up to ``rows`` of ``table``'s rows here, served while at most ``max_staleness`` versions old."""
        self.caches[table] = RowCache(rows, self._spec(table).dim, max_staleness,
                                      count=lambda **n: self.count(**{f"cache_{k}": v for k, v in n.items()}))

    def known_versions(self, table: str) -> torch.Tensor:
        """Per shard, the newest version of ``table`` this trainer knows of (RowLanes.known_versions), plus its
        own pushes still in flight there (trainer.tables.table_window): a cached row ages by them too."""
        known = self.book.known_versions(table)
        if self.window is not None and table in self.window.windows:
            known = [k + n for k, n in zip(known, self.window.in_flight_of(table))]
        return torch.tensor(known)

    def use_window(self, size: int) -> None:
        """Async tables' pushes: up to ``size`` each in flight, acknowledged in the background
        (trainer.tables.table_window); sync tables are pushed as before."""
        from trainer.tables.table_window import TableWindows
        self.window = TableWindows(self, [n for n, m in self.modes.items() if m == Mode.ASYNC], size)

    def flush(self) -> None:
        """Wait for every table push in flight (RowsPushFailed if some failed for good: flush again retries)."""
        if self.window is not None:
            self.window.flush()

    def window_failed(self, table: str) -> bool:
        """A windowed push of ``table`` failed for good and waits to be retried (or abandoned)."""
        return self.window is not None and self.window.failed(table)

    # -- pull (trainer.tables.row_pulls) --------------------------------------------------------------
    def pull(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows ``(len(ids), dim)`` of unique int64 CPU ``ids``, in their order, from the shards in
        parallel; in sync modes each shard's at the version after this trainer's last push there.  A table
        with a row cache serves the rows it holds within its bound and pulls only the others."""
        return self.pulls.pull(table, self._spec(table), ids)

    # -- push (trainer.tables.row_pushes) -------------------------------------------------------------
    def push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, num_samples: int) -> None:
        """Summed gradient rows of unique ``ids`` to every shard (those holding none of them get an empty push).

        Raises:
            RowsPushFailed: some shard failed for good; the gradients are kept and the next ``push`` of this
                table retries the unfinished shards with them (its own arguments are then not read).
        """
        # async: handed over, the step goes on -- unless a push of the table failed outside the window (a Step
        # call's part, trainer.stepping.step_call): that one is sent again first, under its numbers, to the shards that did
        # not answer it (the window would number it anew and every shard would apply it, the answered ones twice)
        if self.window is not None and table in self.window.windows and table not in self.book.pending:
            return self.window.push(table, self._spec(table), ids, grads, num_samples)
        self.pushes.push(table, ids, grads, num_samples)

    def begin_push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, num_samples: int) -> PushPlan:
        """A push's payloads by shard, the shards still to do, the rows it asks for (RowPushes.begin_push)."""
        return self.pushes.begin_push(table, ids, grads, num_samples)

    def unclaim_rest(self, plan: PushPlan) -> None:
        """The claimed shards whose push brought no rows back (RowPushes.unclaim_rest)."""
        self.pushes.unclaim_rest(plan)

    def end_push(self, plan: PushPlan, results: list) -> None:
        """Each shard's result of ``plan.todo`` settled (RowPushes.end_push; RowsPushFailed keeps the push)."""
        self.pushes.end_push(plan, results)

    def push_alone(self, s: ShardClient, plan: PushPlan) -> str:
        """Shard ``s``'s push of ``plan`` as a call of its own, without the claimed rows (a Step that found the
        shard restarted, trainer.stepping.step_call)."""
        return self.pushes.push_shard(s, plan.table, *plan.pending.payloads[s.index])

    def part_request(self, s: ShardClient, plan: PushPlan) -> RowsPart:
        """Shard ``s``'s push of ``plan`` (trainer.stepping.step_call sends it as a part of a Step call)."""
        return self.pushes.part(s, plan.table, *plan.pending.payloads[s.index], plan.claim)

    def part(self, s: ShardClient, table: str, ids: torch.Tensor, grads: torch.Tensor, num_samples: int,
             claim: Claim | None, numbered: tuple[int, int] | None = None) -> RowsPart:
        """Shard ``s``'s push under its lane's number, encoded (RowPushes.part; ``numbered``: a window's)."""
        return self.pushes.part(s, table, ids, grads, num_samples, claim, numbered)

    def push_once(self, s: ShardClient, part: RowsPart) -> str:
        """``part`` sent and its answer taken in (RowPushes.push_once)."""
        return self.pushes.push_once(s, part)

    def part_answered(self, s: ShardClient, part: RowsPart, reply: _pb.PushRowsReply, pulled: tuple | None,
                      attempts: int) -> str:
        """What the shard answered to ``part``, taken into its lane (RowPushes.part_answered)."""
        return self.pushes.part_answered(s, part, reply, pulled, attempts)

    # -- faults -------------------------------------------------------------------------------------
    def resync(self, shard: int, versions: dict[str, int]) -> None:
        """Shard ``shard`` restarted and this trainer registered again: every table goes on from ``versions``
        (the shard's, by table; RowLanes.resync), and the rows cached or prefetched from it are dropped."""
        self.book.resync(shard, versions)
        if self.window is not None:
            self.window.resynced(shard)
        for cache in self.caches.values():  # (not under the lock: the caches count through it)
            cache.drop_shard(shard)
        self.ahead.drop()

    def off_round(self, rounds: dict[str, int], taking_back: set[str] = frozenset()) -> str:
        """Why the tables cannot follow a layout whose tables start at ``rounds`` now ('' when they can):
        trainer.membership.relayout refuses the switch by this reason (RowLanes.off_round; an async table's push window).
        ``taking_back``: tables whose kept push every shard refused layout-moved (``take_back``)."""
        if self.window is not None and self.window.windows:
            return f"async tables ({', '.join(sorted(self.window.windows))}) push through a window"
        return self.book.off_round(rounds, taking_back)

    def take_back(self, table: str) -> None:
        """Every shard refused ``table``'s kept push ``layout-moved``: nothing of it was applied anywhere, so it is
        dropped here and the table's rows (kept by the embedding, trainer.tables.embedding) go again in the new layout."""
        self.book.pending.pop(table, None)

    def relaid(self, job: JobSpec, rounds: dict[str, int]) -> None:
        """The client's shards were switched to a later layout (trainer.membership.relayout): ids are split by the new shard
        count from now on (``split`` reads it), each table's lanes start at its switch round ``rounds``, the row
        calls go over the new shards' channels, and what was read from the old shards is forgotten -- prefetched
        batches, cached rows (counted ``cache_dropped``) and remembered pulls."""
        old = self.book.num_shards
        m = len(self.client.shards)
        self.job = job
        self.book.relaid(m, rounds)
        self.routes.relaid()
        for cache in self.caches.values():
            for shard in range(old):
                cache.drop_shard(shard)
        self.ahead.relaid(m)
        self.count(tables_relaid=1)
        log.warning("tables %s follow %d shards (was %d) from rounds %s: lanes, row calls and placement rebuilt, "
                    "prefetched and cached rows of the old shards dropped", sorted(self.tables), m, old, rounds)

    def start_at(self, shard: int, versions: dict[str, int]) -> None:
        """A new trainer's lanes of shard ``shard`` go on from the tables' ``versions`` there (nothing lost)."""
        self.book.start_at(shard, versions)

    def abandon(self, table: str) -> bool:
        """Drop ``table``'s failed push instead of retrying it (trainer.stepping.api's abandon_step): the shards that
        did not answer get new numbers (RowLanes.abandon).  Returns whether there was one."""
        self._spec(table)
        if self.window_failed(table):
            self.count(pushes_abandoned=self.window.abandon(table))
            return True
        return self.book.abandon(table)

    # -- the rest -----------------------------------------------------------------------------------
    def versions(self) -> dict[str, list[int]]:
        """Each table's version on each shard, as this trainer last saw it."""
        return self.book.versions()

    def prefetch(self, table: str, ids: torch.Tensor, ahead: int = 1) -> None:
        """Pull ``table``'s rows of ``ids`` ahead for the step ``ahead`` steps from now (trainer.tables.row_prefetch)."""
        self.ahead.announce(table, ids, ahead)

    def step_dropped(self, table: str) -> None:
        """This step's push of ``table`` will not be made (the step was abandoned): its prefetches move on."""
        self.ahead.pushed(table)

    def close(self) -> None:
        """The prefetch (and push window) threads end; the channels belong to the ShardedClient."""
        self.ahead.close()
        if self.window is not None:
            self.window.close()
