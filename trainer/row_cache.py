"""A worker-side cache of hot rows with a staleness bound (issue 21 item 3; HET's idea).

A forward's pull asks the cache first: a row read within the bound is served from here and not pulled again.
Everything is vectorised with torch -- a lookup is one ``searchsorted`` over the sorted ids held, an insert a
``topk`` for victims and a linear merge -- so no Python runs per row.

**How staleness is counted.**  Every (shard, table) has a version on its shard: the number of updates applied
to the table there (async: one per push; sync and stale-timeout: one per round).  A cached row remembers the
version of the reply that brought it.  Its staleness is ``known - read``, where ``known`` is the newest version
of its table on its shard that this trainer has learned from any reply (pull, push, fused push-pull) -- in sync
modes at least the close of this trainer's last push's round, the version its next pull would wait for.  A row
is served only while ``0 <= known - read <= max_staleness``; older (or, after a restore, "newer" than the
shard) it is pulled again and counted as a stale re-pull.  Another trainer's pushes count from the next reply
of that shard this trainer gets (every step's push brings one), so the bound is over what this trainer knows,
as with every version it uses.

**Pushed rows.**  This trainer's own push moves the table's version, so the cached copy of a pushed row ages
by it like any other row: with bound 0 it is dropped at once (it could never be served again), with a bound
S it may be served for at most S more versions -- the bounded-staleness rule counts the trainer's own updates
too.  (The shard applies its per-row optimizer; the trainer cannot recompute the new value without the
optimizer's state, and dropping every pushed row would leave nothing to hit: a training forward pushes every
row it reads.)  Bound 0 is therefore exact: no row is served once its table moved since it was read.

Memory: ``capacity`` rows of ``dim`` floats plus four int64 per slot, allocated once; empty slots are filled
first, then the least recently used rows are evicted (a stale row pulled again is refreshed in its slot).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Lookup:
    """What the cache holds of a pull's ids: ``hit`` (served), ``stale`` (held but too old), and for the hits
    their ``rows`` and the ``versions`` they were read at (in the order of ``ids[hit]``)."""

    hit: torch.Tensor
    stale: torch.Tensor
    rows: torch.Tensor
    versions: torch.Tensor


class RowCache:
    """One table's cached rows: at most ``capacity``, served while at most ``max_staleness`` versions old."""

    def __init__(self, capacity: int, dim: int, max_staleness: int = 0, count: Callable | None = None):
        """``count(**n)``: where hits, stale, misses, evicted and dropped are counted (default: ``counts``)."""
        if capacity < 1:
            raise ValueError(f"cache_rows ({capacity}) must be at least 1")
        if max_staleness < 0:
            raise ValueError(f"cache_staleness ({max_staleness}) must be at least 0")
        self.capacity, self.dim, self.max_staleness = capacity, dim, max_staleness
        self.rows = torch.zeros(capacity, dim)
        self.version = torch.zeros(capacity, dtype=torch.int64)
        self.shard = torch.zeros(capacity, dtype=torch.int64)
        self.used = torch.full((capacity,), -1, dtype=torch.int64)  # last use (a tick); -1: an empty slot
        self.keys = torch.empty(0, dtype=torch.int64)  # the ids held, sorted
        self.slots = torch.empty(0, dtype=torch.int64)  # each one's slot
        self.tick = 0
        self.counts: Counter = Counter()
        self._count = count or self.counts.update
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.keys)

    def _find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(held, slot) per id; ``slot`` is meaningless where not held."""
        if not len(self.keys):
            return torch.zeros(len(ids), dtype=torch.bool), torch.zeros(len(ids), dtype=torch.int64)
        pos = torch.searchsorted(self.keys, ids).clamp_(max=len(self.keys) - 1)
        return self.keys[pos] == ids, self.slots[pos]

    def lookup(self, ids: torch.Tensor, known: torch.Tensor) -> Lookup:
        """The rows of ``ids`` within the bound, given ``known[shard]``: each shard's newest known version."""
        with self._lock:
            held, slot = self._find(ids)
            age = known[self.shard[slot]] - self.version[slot]
            hit = held & (age >= 0) & (age <= self.max_staleness)
            stale = held & ~hit
            self.tick += 1
            served = slot[hit]
            self.used[served] = self.tick
            n_hit, n_stale = int(hit.sum()), int(stale.sum())
            self._count(hits=n_hit, stale=n_stale, misses=len(ids) - n_hit - n_stale)
            return Lookup(hit, stale, self.rows[served], self.version[served])

    def insert(self, ids: torch.Tensor, rows: torch.Tensor, versions: torch.Tensor, shards: torch.Tensor) -> None:
        """Hold the rows of unique ``ids`` read at ``versions`` from ``shards`` (those held already: replaced)."""
        with self._lock:
            self.tick += 1
            held, slot = self._find(ids)
            at = slot[held]
            self.rows[at], self.version[at], self.used[at] = rows[held], versions[held], self.tick
            new = (~held).nonzero().flatten()[: self.capacity]
            if len(new):
                self._place(ids[new], rows[new], versions[new], shards[new])

    def _place(self, ids: torch.Tensor, rows: torch.Tensor, versions: torch.Tensor, shards: torch.Tensor) -> None:
        victims = torch.topk(self.used, len(ids), largest=False).indices  # empty (-1) first, then least recent
        taken = self.used[victims] >= 0
        self._count(evicted=int(taken.sum()))
        self._forget_slots(victims[taken])
        self.rows[victims], self.version[victims], self.shard[victims] = rows, versions, shards
        self.used[victims] = self.tick
        order = torch.argsort(ids)
        self.keys, self.slots = _merge(self.keys, self.slots, ids[order], victims[order])

    def _forget_slots(self, slots: torch.Tensor) -> None:
        if not len(slots):
            return
        gone = torch.zeros(self.capacity, dtype=torch.bool)
        gone[slots] = True
        keep = ~gone[self.slots]
        self.keys, self.slots = self.keys[keep], self.slots[keep]
        self.used[slots] = -1

    def drop(self, ids: torch.Tensor) -> None:
        """Forget the rows of ``ids`` (those held)."""
        with self._lock:
            held, slot = self._find(ids)
            self._forget_slots(slot[held])
            self._count(dropped=int(held.sum()))

    def drop_shard(self, shard: int) -> None:
        """Forget every row of ``shard`` (it restarted: its versions may have gone back)."""
        with self._lock:
            slots = self.slots[self.shard[self.slots] == shard]
            self._forget_slots(slots)
            self._count(dropped=len(slots))

    def pushed(self, ids: torch.Tensor) -> None:
        """This trainer pushed gradients of ``ids``: their copies age by the version the push moves; with
        bound 0 they could never be served again, so their slots are freed now."""
        if self.max_staleness == 0 and len(self.keys):
            self.drop(ids)


def _merge(keys: torch.Tensor, slots: torch.Tensor, new_keys: torch.Tensor,
           new_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sorted, disjoint id lists (with their slots) as one sorted list, in linear time."""
    n = len(keys) + len(new_keys)
    at = torch.searchsorted(keys, new_keys) + torch.arange(len(new_keys))
    is_new = torch.zeros(n, dtype=torch.bool)
    is_new[at] = True
    out_keys, out_slots = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    out_keys[at], out_slots[at] = new_keys, new_slots
    out_keys[~is_new], out_slots[~is_new] = keys, slots
    return out_keys, out_slots


def pull_through(cache: RowCache, ids: torch.Tensor, owner: torch.Tensor, known: torch.Tensor,
                 fetch: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, Lookup]:
    """Rows ``(len(ids), dim)`` of unique ``ids`` (each on shard ``owner``): those within the bound from
    ``cache``, the others by ``fetch(ids) -> (rows, version per id)``, which are then cached."""
    look = cache.lookup(ids, known)
    if bool(look.hit.all()):
        return look.rows, look
    out = torch.empty(len(ids), cache.dim)
    out[look.hit] = look.rows
    miss = ~look.hit
    rows, versions = fetch(ids[miss])
    out[miss] = rows
    cache.insert(ids[miss], rows, versions, owner[miss])
    return out, look
