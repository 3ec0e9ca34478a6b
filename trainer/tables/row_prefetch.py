"""Rows of the next batch, pulled before its forward asks for them (issue 21 item 1).

A training loop knows its next batch while the current one computes.  ``RowPrefetch`` keeps, per table, a
short queue of announced batches (their unique ids) and pulls their rows in the background, so the forward
finds them already here instead of making a round trip per shard:

* an async table's rows are pulled at once (the version the shard has now: what "async" allows) -- or, while
  steps go as one Step call a shard (``fold_async``), carried by the step's push, answered at once after it;
* a sync (or stale-timeout) table's rows are pulled once this step's push of the table is answered, with the
  pull waiting for the close of that push's round -- exactly the version a forward's own pull would read, so
  N trainers x batch b still equal one process on batch N.b bit for bit.

An announced batch belongs to a step: the one about to be computed (``ahead=0``) or the next (``ahead=1``).
It can be used once the table's pushes reach that step, and is dropped when that step's push is done.  Rows
the forward asks for that were not announced are pulled as before (``ShardedRows.pull``); a prefetch that
failed (a shard restarting) is counted and its ids pulled as before too -- nothing here raises into a step.
The version a shard answered is adopted as the push's base only when a forward uses the rows.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Callable

import torch

log = logging.getLogger(__name__)


@dataclass
class _Batch:
    """An announced batch of one table: its sorted unique ids, split by shard, and their pulls."""

    ids: torch.Tensor
    after: int  # usable once the table's pushes reach this count
    parts: list[torch.Tensor]  # per shard: positions in ``ids`` it owns (split once: the push reuses it)
    pulls: dict[int, Future] = field(default_factory=dict)  # shard -> Future of (rows, version)
    rows: torch.Tensor | None = None  # gathered on first use
    known: torch.Tensor | None = None  # bool per id: its row arrived
    versions: torch.Tensor | None = None  # per id: the version its shard answered
    adopted: set = field(default_factory=set)  # shards whose version is this step's push base
    arrived: list = field(default_factory=list)  # shards whose rows were gathered (their ids are ``known``)

    def owner(self) -> torch.Tensor:
        """Per id, its shard (only a forward asking for other ids than the batch's needs it)."""
        owner = torch.empty(len(self.ids), dtype=torch.int64)
        for s, pos in enumerate(self.parts):
            owner[pos] = s
        return owner


@dataclass
class Claim:
    """The next step's batch of a sync table whose rows this step's push asks for (PushPullRows): per shard,
    the ids it carries and the pull slot its reply fills (``RowPrefetch.deliver``) or gives back (``unclaim``)."""

    table: str
    batch: _Batch
    ids: dict[int, torch.Tensor]
    futures: dict[int, Future]


class RowPrefetch:
    """The announced batches of every table of one ``ShardedRows``.

    ``fetch(shard, table, ids) -> (rows, version)`` pulls without touching push bookkeeping (sync tables: at
    the version after this trainer's last push); ``adopt(shard, table, version)`` makes a used pull's version
    the next push's base; ``split(ids)`` gives each shard's positions; ``count(**n)`` counts.
    """

    def __init__(self, tables: dict[str, int], sync: dict[str, bool], num_shards: int, split: Callable,
                 fetch: Callable, adopt: Callable, count: Callable):
        self.dims, self.sync, self.num_shards = tables, sync, num_shards
        self._split, self._fetch, self._adopt, self._count = split, fetch, adopt, count
        self._queues: dict[str, deque[_Batch]] = {t: deque() for t in tables}
        self._pushes = dict.fromkeys(tables, 0)
        self._lock = threading.Lock()
        # Set while each step goes as one Step call a shard (trainer.stepping.step_call): an async table's next batch is
        # then not pulled on its own at announce but claimed by the step's push (its part carries the ids and the
        # shard answers at once); a push that brings no rows back leaves them to ``pushed``/``take``, as for sync.
        self.fold_async = False
        self._pool = ThreadPoolExecutor(max_workers=max(1, num_shards), thread_name_prefix="ps-rows-ahead")

    # -- announcing --------------------------------------------------------------------------------
    def announce(self, table: str, ids: torch.Tensor, ahead: int = 1) -> None:
        """The ids ``table`` will be asked for in the step ``ahead`` steps from now (0: the current one)."""
        if table not in self._queues:
            raise KeyError(f"table {table!r} is not in the job (its tables: {', '.join(self._queues) or 'none'})")
        uniq = torch.unique(ids.detach().reshape(-1).to("cpu", torch.int64))
        with self._lock:
            b = _Batch(uniq, self._pushes[table] + ahead, self._split(uniq))
            self._queues[table].append(b)
            if b.after <= self._pushes[table] or not (self.sync[table] or self.fold_async):
                self._start(table, b)
        self._count(prefetch_ids=len(uniq))

    def _start(self, table: str, b: _Batch) -> None:
        for s, pos in enumerate(b.parts):
            if len(pos) and s not in b.pulls:
                b.pulls[s] = self._pool.submit(self._fetch, s, table, b.ids[pos])

    # -- using ---------------------------------------------------------------------------------------
    def take(self, table: str, ids: torch.Tensor, with_versions: bool = False) -> tuple | None:
        """(rows, known): the prefetched rows of the sorted unique ``ids`` where ``known``; None when nothing
        usable was announced for this step.  Waits for the pulls still under way.  ``with_versions``: also
        the version each row was read at (trainer.tables.row_cache)."""
        with self._lock:
            b = self._current(table)
            if b is not None and (self.sync[table] or self.fold_async):
                self._start(table, b)  # (announced and used in one step, or a folded one not claimed: pulled now)
        if b is None or not len(b.ids):
            return None
        if b.rows is None:
            self._gather(table, b)
        if len(ids) == len(b.ids) and torch.equal(ids, b.ids):  # the forward asks for the batch announced (usual)
            return self._take_whole(table, b, with_versions)
        pos = torch.searchsorted(b.ids, ids).clamp_(max=len(b.ids) - 1)
        known = (b.ids[pos] == ids) & b.known[pos]
        self._adopt_shards(table, b, b.owner()[pos[known]].unique().tolist())  # the shards this forward reads
        self._count(prefetch_hits=int(known.sum()), prefetch_misses=int((~known).sum()))
        return (b.rows[pos], known, b.versions[pos]) if with_versions else (b.rows[pos], known)

    def _take_whole(self, table: str, b: _Batch, with_versions: bool) -> tuple:
        """``take`` of exactly the batch's ids: its rows as gathered, no search -- a copy only where some did not
        arrive (the caller pulls those into what it is handed)."""
        whole = len(b.arrived) == sum(1 for pos in b.parts if len(pos))
        self._adopt_shards(table, b, b.arrived)
        hits = sum(len(b.parts[s]) for s in b.arrived)
        self._count(prefetch_hits=hits, prefetch_misses=len(b.ids) - hits)
        rows, versions = (b.rows, b.versions) if whole else (b.rows.clone(), b.versions.clone())
        return (rows, b.known, versions) if with_versions else (rows, b.known)

    def _adopt_shards(self, table: str, b: _Batch, shards) -> None:
        """The shards a forward reads from: their versions are its push's base."""
        for s in shards:
            if s not in b.adopted:
                b.adopted.add(s)
                self._adopt(s, table, b.pulls[s].result()[1])

    def _current(self, table: str) -> _Batch | None:
        """The batch announced for the step the table's pushes have reached (under the lock)."""
        return next((b for b in self._queues.get(table, ()) if b.after <= self._pushes[table]), None)

    def parts_of(self, table: str, ids: torch.Tensor) -> list[torch.Tensor] | None:
        """Each shard's positions in ``ids`` when they are this step's announced batch (the push of the rows its
        forward read: split once, at the announce); None otherwise (the caller splits them)."""
        with self._lock:
            b = self._current(table)
        if b is None or len(b.ids) != len(ids) or not torch.equal(b.ids, ids):
            return None
        return b.parts

    def _gather(self, table: str, b: _Batch) -> None:
        """The pulls' rows into one block in id order: every shard's piece and its version copied in at once."""
        pieces, order, arrived = [], [], []
        for s, fut in list(b.pulls.items()):
            try:
                rows, version = fut.result()
            except Exception as e:  # the forward pulls these ids itself (and rejoins a restarted shard there)
                del b.pulls[s]
                self._count(prefetch_failed=1)
                log.warning("prefetch of table %r from shard %d failed (%s); the forward pulls its rows", table,
                            s, e)
                continue
            pieces.append((rows, version))
            order.append(b.parts[s])
            arrived.append(s)
        n = len(b.ids)
        b.arrived = arrived
        if len(arrived) == sum(1 for pos in b.parts if len(pos)):  # all of them (usual): no mask to write
            b.known = torch.ones(n, dtype=torch.bool)
        else:
            b.known = torch.zeros(n, dtype=torch.bool)
            if order:
                b.known[torch.cat(order)] = True
        b.rows = torch.empty(n, self.dims[table])
        b.versions = torch.zeros(n, dtype=torch.int64)
        if order:
            at = torch.cat(order) if len(order) > 1 else order[0]
            b.rows.index_copy_(0, at, torch.cat([r for r, _ in pieces]) if len(pieces) > 1 else pieces[0][0])
            b.versions.index_copy_(0, at, torch.cat([torch.full((len(p),), v, dtype=torch.int64)
                                                     for p, (_, v) in zip(order, pieces)]))

    # -- pushed and pulled in one call (PushPullRows) ---------------------------------------------------
    def claim(self, table: str) -> Claim | None:
        """A sync table's batch that this step's push makes usable (the next step's) and whose pulls have not
        started: the push carries its ids, one shard each, and the replies deliver the rows -- the version a
        pull started by ``pushed`` would wait for (the close of this push's round), without its round trip.
        An async table's too while ``fold_async``: the shard answers at once, as the pull at announce would."""
        with self._lock:
            if table not in self.sync or not (self.sync[table] or self.fold_async):
                return None
            n = self._pushes[table] + 1
            b = next((b for b in self._queues[table] if b.after == n), None)
            if b is None:
                return None
            ids, futures = {}, {}
            for s, pos in enumerate(b.parts):
                if len(pos) and s not in b.pulls:
                    ids[s], futures[s] = b.ids[pos], Future()
                    b.pulls[s] = futures[s]
        return Claim(table, b, ids, futures) if ids else None

    @staticmethod
    def deliver(claim: Claim, shard: int, rows: torch.Tensor, version: int) -> None:
        claim.futures[shard].set_result((rows, version))

    def unclaim(self, claim: Claim, shard: int) -> None:
        """The push to ``shard`` brought no rows (failed, stale, lost): its pull is started by ``pushed`` as
        without the fused call (or claimed again by the push's retry)."""
        with self._lock:
            if claim.batch.pulls.get(shard) is claim.futures[shard]:
                del claim.batch.pulls[shard]

    # -- the step moves on ---------------------------------------------------------------------------
    def pushed(self, table: str) -> None:
        """``table``'s push of this step is done (or the step was dropped): forget this step's batch and
        start the pulls of the next one's sync rows (they wait for the round this push is in)."""
        with self._lock:
            if table not in self._pushes:
                return
            n = self._pushes[table] = self._pushes[table] + 1
            q = self._queues[table]
            while q and q[0].after < n:
                q.popleft()
            for b in q:
                if b.after <= n:
                    self._start(table, b)

    def settle(self) -> None:
        """Wait until every pull under way has answered (or failed: its forward pulls again).  For a run that must
        be repeatable bit for bit from its first step: an async table's rows pulled ahead of the first push may
        otherwise be read before or after it lands."""
        with self._lock:
            pulls = [f for q in self._queues.values() for b in q for f in b.pulls.values()]
        futures_wait(pulls)

    def drop(self) -> None:
        """Forget every announced batch (a shard restarted: rows pulled before it may be of an older state);
        the forwards pull their rows as before."""
        with self._lock:
            dropped = sum(len(q) for q in self._queues.values())
            for q in self._queues.values():
                q.clear()
        self._count(prefetch_dropped=dropped)

    def relaid(self, num_shards: int) -> None:
        """A layout switch (trainer.membership.relayout): every announced batch forgotten (split by the old shards; their
        forwards pull as before, counted ``prefetch_dropped``) and the pulls' threads sized for ``num_shards``."""
        self.drop()
        old, self.num_shards = self._pool, num_shards
        self._pool = ThreadPoolExecutor(max_workers=max(1, num_shards), thread_name_prefix="ps-rows-ahead")
        old.shutdown(wait=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)  # closing the channels ends pulls under way
