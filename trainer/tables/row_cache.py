"""A worker-side cache of hot rows with a staleness bound (issue 21 item 3; HET's idea).

A forward's pull asks the cache first: a row read within the bound is served from here and not pulled again.
Everything is vectorised -- the ids held sit in the shard's own open-addressing id index (IdIndex), so a
lookup, an insert or a drop is a find and a few gathers over the call's ids -- so no Python runs per row.

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

Memory: ``capacity`` rows of ``dim`` floats plus four int64 per slot (id, version, shard, last use) and a free-slot
stack, allocated once, and the id index (psserver.protocol.rows.index, the shard's own: an open-addressing table
of 2 to 8 positions of 21 bytes per row held, rebuilt as it grows, so bounded by ``capacity`` too).  Empty slots
are filled first, then the least recently used rows are evicted (a stale row pulled again is refreshed in its
slot).  Why this shape: a sorted id list merged on every insert cost ~3-6 ms a step at 100,000 rows (boolean
filters and merges over every slot); here a lookup, an insert and a drop are a handful of vectorised ops over
the call's ids, and only an eviction looks at every slot (one ``topk``), which frees EVICT_SLACK of the
capacity beyond what the call needs so that it is paid once per that many new rows, not on every step.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from psserver.protocol.rows.index import IdIndex

# An eviction frees this fraction of the capacity beyond what the insert needs (least recently used first, never
# a row this insert refreshed): at capacity the scan of every slot's last use is paid once per that many new rows.
EVICT_SLACK = 1 / 64


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
        self.ids = torch.zeros(capacity, dtype=torch.int64)  # the id each slot holds (where used >= 0)
        self.version = torch.zeros(capacity, dtype=torch.int64)
        self.shard = torch.zeros(capacity, dtype=torch.int64)
        self.used = torch.full((capacity,), -1, dtype=torch.int64)  # last use (a tick); -1: an empty slot
        self._free = torch.arange(capacity - 1, -1, -1, dtype=torch.int64)  # a stack: _free[:_top] are empty
        self._top = capacity
        self._index = IdIndex()  # id -> slot of the rows held
        self.tick = 0
        self.counts: Counter = Counter()
        self._count = count or self.counts.update
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def keys(self) -> torch.Tensor:
        """The ids held, sorted (for inspection: a pass over the index)."""
        return self._held()[0]

    @property
    def slots(self) -> torch.Tensor:
        """The slot of each id of ``keys``."""
        return self._held()[1]

    def _held(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, slots = self._index.items()
        order = torch.argsort(ids)
        return ids[order], slots[order]

    def nbytes(self) -> int:
        """Bytes held: the slots' tensors, the free stack and the id index."""
        tensors = (self.rows, self.ids, self.version, self.shard, self.used, self._free)
        return sum(t.numel() * t.element_size() for t in tensors) + self._index.nbytes()

    def _find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(held, slot) per id; ``slot`` is 0 (meaningless) where not held."""
        slot = self._index.find(ids)
        held = slot >= 0
        return held, slot.clamp_(min=0)

    def lookup(self, ids: torch.Tensor, known: torch.Tensor) -> Lookup:
        """The rows of ``ids`` within the bound, given ``known[shard]``: each shard's newest known version."""
        with self._lock:
            if not len(self):  # nothing held (bound 0 drops every pushed row): every id a miss, no find
                self.tick += 1
                self._count(hits=0, stale=0, misses=len(ids))
                none = torch.zeros(len(ids), dtype=torch.bool)
                return Lookup(none, none.clone(), self.rows[:0], self.version[:0])
            held, slot = self._find(ids)
            age = known[self.shard[slot]] - self.version[slot]
            hit = held & (age >= 0) & (age <= self.max_staleness)
            stale = held & ~hit
            self.tick += 1
            served = slot[hit]
            self.used.index_fill_(0, served, self.tick)
            n_hit, n_stale = int(hit.sum()), int(stale.sum())
            self._count(hits=n_hit, stale=n_stale, misses=len(ids) - n_hit - n_stale)
            return Lookup(hit, stale, self.rows[served], self.version[served])

    def insert(self, ids: torch.Tensor, rows: torch.Tensor, versions: torch.Tensor, shards: torch.Tensor) -> None:
        """Hold the rows of unique ``ids`` read at ``versions`` from ``shards`` (those held already: replaced)."""
        with self._lock:
            self.tick += 1
            if not len(self):  # nothing held: every id is new (no find)
                self._place(ids[: self.capacity], rows[: self.capacity], versions[: self.capacity],
                            shards[: self.capacity])
                return
            held, slot = self._find(ids)
            at = slot[held]
            self.rows[at], self.version[at] = rows[held], versions[held]
            self.used.index_fill_(0, at, self.tick)
            new = (~held).nonzero().flatten()[: self.capacity]
            if len(new):
                self._place(ids[new], rows[new], versions[new], shards[new])

    def _place(self, ids: torch.Tensor, rows: torch.Tensor, versions: torch.Tensor, shards: torch.Tensor) -> None:
        """Put new ids in empty slots, evicting the least recently used rows first if there are too few."""
        k = len(ids)
        if k > self._top:
            self._evict(k - self._top)
        slots = self._free[self._top - k: self._top].clone()
        self._top -= k
        self.rows[slots], self.version[slots], self.shard[slots], self.ids[slots] = rows, versions, shards, ids
        self.used.index_fill_(0, slots, self.tick)
        self._index.insert(ids, slots)

    def _evict(self, need: int) -> None:
        """Free ``need`` slots or more: the least recently used rows, plus up to EVICT_SLACK of the capacity
        more of them that this call did not touch."""
        live = torch.where(self.used < 0, self.tick + 1, self.used)  # empty slots last (there are none to take)
        extra = min(int(self.capacity * EVICT_SLACK), self.capacity - self._top - need)
        victims = torch.topk(live, need + extra, largest=False, sorted=True).indices
        keep_extra = self.used[victims[need:]] < self.tick
        victims = torch.cat([victims[:need], victims[need:][keep_extra]])
        self._count(evicted=len(victims))
        self._free_slots(victims)

    def _free_slots(self, slots: torch.Tensor) -> None:
        """Forget the rows in ``slots`` (each held) and push the slots on the free stack."""
        if len(slots):
            self._index.remove(self.ids[slots])
            self._release(slots)

    def _release(self, slots: torch.Tensor) -> None:
        """Mark ``slots`` (their ids out of the index already) empty and push them on the free stack."""
        if not len(self._index):  # empty: start a fresh index, not one full of tombstones (bound 0 empties it often)
            self._index = IdIndex()
        self.used.index_fill_(0, slots, -1)
        self._free[self._top: self._top + len(slots)] = slots
        self._top += len(slots)

    def drop(self, ids: torch.Tensor) -> None:
        """Forget the rows of ``ids`` (those held)."""
        with self._lock:
            slots = self._index.remove(ids)
            slots = slots[slots >= 0]
            if len(slots):
                self._release(slots)
            self._count(dropped=len(slots))

    def drop_shard(self, shard: int) -> None:
        """Forget every row of ``shard`` (it restarted: its versions may have gone back)."""
        with self._lock:
            slots = ((self.used >= 0) & (self.shard == shard)).nonzero().flatten()
            self._free_slots(slots)
            self._count(dropped=len(slots))

    def pushed(self, ids: torch.Tensor) -> None:
        """This trainer pushed gradients of ``ids``: their copies age by the version the push moves; with
        bound 0 they could never be served again, so their slots are freed now."""
        if self.max_staleness == 0 and len(self):
            self.drop(ids)


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
