"""Where one table's rows live: slots.

Every live row has a slot -- its id, values, optimizer state and two clocks (the tick of its last use, for LRU
eviction; the version of its last update, for stale eviction) sit at that index of five tensors -- and an IdIndex
(psserver.protocol.rows.index) maps the id to the slot.  Slots freed by eviction are taken first; past them the
tensors double, never beyond the table's cap.  ``RowSpace`` owns that layout: allocating and growing it, creating
rows from the initialiser, marking rows used, evicting, reading rows out by slot.  It decides nothing about which
calls may change it: the checks, the clocks' meaning and the counts are psserver.protocol.rows.table.RowStore's,
which changes it only once a call has passed them (a refusal leaves no trace).
"""

from __future__ import annotations

import numpy as np
import torch

from psserver.protocol.rows import kernel
from psserver.protocol.rows.index import IdIndex
from psserver.protocol.rows.init import init_rows, uniform_key
from psserver.protocol.rows.optim import initial_state, initial_value

INT64_MAX = (1 << 63) - 1
ROW_FIELDS = ("ids", "rows", "optimizer_state", "last_tick", "last_version")  # a state's per-row tensors, by id


class RowSpace:
    """The slots of one table's rows (``spec``'s dim, ``width`` floats of optimizer state a row), at most
    ``spec.max_rows`` or else ``row_limit`` of them (None: no cap)."""

    def __init__(self, spec, width: int, capacity: int, row_limit: int | None):
        self.spec, self.width, self.row_limit = spec, width, row_limit
        self.index = IdIndex()
        self.free = torch.empty(0, dtype=torch.int64)  # slots below ``used`` that hold no row
        self.used = 0  # slots ever handed out; slots at and above it were never used
        self.evictions = 0  # calls of ``evict``: a slot found before one may hold another row after it
        self.evicted_log: list[torch.Tensor] | None = None  # ids evicted, kept while a live re-shard forwards rows
        self._noted: list[torch.Tensor] | None = None  # slots touched since ``note_from_now`` (None: not noted)
        self._noted_count = 0
        self.ids = self.rows = self.state = self.last_tick = self.last_version = None
        self.alloc(capacity)
        # what the fused lookup hands the C kernel for every new row: the initialiser's key and the state's value
        self._fresh = (uniform_key(spec.seed), float(spec.initializer.scale), float(initial_value(spec.optimizer)))

    def __len__(self) -> int:
        return len(self.index)

    @property
    def capacity(self) -> int:
        """Row slots allocated now (live rows, free slots and room to grow)."""
        return len(self.ids)

    def alloc(self, capacity: int) -> None:
        """(Re)allocate every per-slot tensor at ``capacity`` slots, keeping the used ones.

        Slots past the used ones are left unwritten (``torch.empty``): nothing reads a slot before ``create``
        writes its id, row and state and ``touch`` its clocks, and every scan stops at ``used``.  Zeroing them
        touched every page of the doubled tensors at once -- a growth of a click table past 2**18 rows took
        ~70 ms of one step, ~0.3 ms a step amortised -- where now a page is touched when its first row is made."""
        fresh = (torch.empty(capacity, dtype=torch.int64), torch.empty(capacity, self.spec.dim),
                 torch.empty(capacity, self.width),
                 torch.empty(capacity, dtype=torch.int64),  # INT64_MAX once a row is evicted
                 torch.empty(capacity, dtype=torch.int64))
        if self.ids is not None:
            for new, old in zip(fresh, self._tensors()):
                new[: self.used] = old[: self.used]
        self.ids, self.rows, self.state, self.last_tick, self.last_version = fresh

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.rows, self.state, self.last_tick, self.last_version

    def growth(self, n: int) -> int:
        """Slots the space would add to take ``n`` new rows (0: they fit): doubling, never past its cap."""
        extra = n - min(n, len(self.free))
        if self.used + extra <= len(self.ids):
            return 0
        cap = max(self.used + extra, 2 * len(self.ids))
        bound = self.spec.max_rows or self.row_limit
        return (max(min(cap, bound), self.used + extra) if bound else cap) - len(self.ids)

    def room_for(self, n: int) -> bool:
        """Whether creating up to ``n`` rows costs nothing proportional to the table: no growth of the slots (a
        copy of every row and its state), no rebuild of the id index, no LRU eviction (a scan of every row's last
        use).  O(1) and without a find: ``n`` is an upper bound -- ids that have rows already count as new -- so
        a call near a bound is answered no.  (A stale eviction, ``evict_after``, scans at every update whatever
        ``n`` is: not asked here.)  What a call may still copy besides its rows is the free-slot list, which
        without ``evict_after`` holds at most the LRU slack, ``max_rows * EVICT_SLACK``."""
        grows = self.used + max(0, n - len(self.free)) > len(self.ids)
        evicts = bool(self.spec.max_rows) and len(self) + n > self.spec.max_rows
        return not (grows or evicts or self.index.rebuilds_for(n))

    def take(self, n: int) -> torch.Tensor:
        """``n`` empty slots: freed ones first, then new ones, growing capacity by doubling."""
        grow = self.growth(n)
        if len(self.free):
            keep = len(self.free) - min(n, len(self.free))
            reuse, self.free = self.free[keep:], self.free[:keep].clone()
        else:
            reuse = None
        extra = n - (0 if reuse is None else len(reuse))
        if grow:
            self.alloc(len(self.ids) + grow)
        fresh = torch.arange(self.used, self.used + extra, dtype=torch.int64)
        self.used += extra
        return fresh if reuse is None else torch.cat([reuse, fresh])

    # -- rows -----------------------------------------------------------------------------

    def touch(self, slots: torch.Tensor, tick: int, version: int) -> None:
        """Mark rows as used at ``tick`` and ``version``, for both eviction clocks (and, while noting, note them)."""
        self._note(slots)
        self.last_tick.index_fill_(0, slots, tick)
        self.last_version.index_fill_(0, slots, version)

    def _note(self, slots: torch.Tensor) -> None:
        if self._noted is not None:
            self._noted.append(slots)
            self._noted_count += len(slots)
            if self._noted_count > len(self.ids):  # as many as the table: a scan of its clocks costs no more
                self._noted = None

    # -- the fused calls: the same work in one C loop each, where the C kernel was built (psserver.protocol.rows.kernel)

    def fused_lookup(self, ids: torch.Tensor, tick: int, version: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """RowStore.lookup's resolve, create, touch and gather of unique ``ids`` in one C call: (their slots, their
        rows, rows created), the same bit for bit.  None -- nothing changed, the general path's turn -- without the
        C kernel, for another initialiser than uniform, or unless every id could be new without reusing a freed
        slot, growing, evicting or rebuilding the index (``room_for``)."""
        native, spec, n = kernel.native, self.spec, len(ids)
        if native is None or spec.initializer.kind != "uniform" or len(self.free) or not self.room_for(n):
            return None
        arrays = self.index.fused_arrays(n)
        if arrays is None:
            return None
        keys, index_slots, states, claim, mask = arrays
        raw = ids.contiguous().numpy()
        slots, rows, losers = torch.empty(n, dtype=torch.int64), torch.empty(n, spec.dim), np.empty(n, dtype=np.int64)
        created, lost = native.lookup_rows(
            keys, index_slots, states, claim, mask, raw, self.ids.numpy(), self.rows.numpy(), self.state.numpy(),
            self.last_tick.numpy(), self.last_version.numpy(), self.used, spec.dim, self.width, *self._fresh, tick,
            version, slots.numpy(), rows.numpy(), losers)
        self.used += created
        if created:
            moved = losers[:lost]
            self.index.fused_inserted(created - lost, raw[moved], slots.numpy()[moved])
        self._note(slots)
        return slots, rows, created

    def fused_gather(self, slots: torch.Tensor, grads: torch.Tensor, tick: int, version: int, out) -> bool:
        """A push's touch of ``slots`` and UpdateScratch.gather into ``out`` (its padded rows, state and gradient
        buffers) in one C call; False -- nothing changed -- without the C kernel or where a slot holds no row."""
        native = kernel.native
        if native is None or not native.gather_rows(
                self.rows.numpy(), self.state.numpy(), slots.numpy(), grads.detach().contiguous().numpy(),
                self.last_tick.numpy(), self.last_version.numpy(), tick, version, self.spec.dim, self.width,
                out[0].numpy(), out[1].numpy(), out[2].numpy(), len(out[0])):
            return False
        self._note(slots)
        return True

    def fused_scatter(self, slots: torch.Tensor, rows: torch.Tensor, state: torch.Tensor) -> None:
        """The rows and state updated in a ``fused_gather``'s buffers back at their ``slots`` (index_copy_)."""
        kernel.native.scatter_rows(self.rows.numpy(), self.state.numpy(), slots.numpy(), rows.numpy(),
                                   state.numpy(), self.spec.dim, self.width)

    def create(self, ids: torch.Tensor, room=None) -> torch.Tensor:
        """Store new rows for ``ids`` (unique, absent) from the initialiser; their slots.  ``room``: where the
        index's find saw their probes end (IdIndex.find_with_room), for an insert without probing again."""
        spec = self.spec
        fresh, start = not len(self.free), self.used
        slots = self.take(len(ids))
        rows = init_rows(spec.initializer, spec.seed, ids, spec.dim)
        if fresh:  # slots start..start+n, never used: copies instead of scatters
            at = slice(start, start + len(ids))
            self.ids[at], self.rows[at] = ids, rows
            if self.width:
                self.state[at].fill_(initial_value(spec.optimizer))
        else:
            self.ids[slots], self.rows[slots] = ids, rows
            self.state[slots] = initial_state(spec.optimizer, len(ids), spec.dim)
        self.index.insert(ids, slots, room)
        return slots

    def evict(self, slots: torch.Tensor) -> None:
        """Drop the rows in ``slots``: forget their ids, mark the slots free."""
        self.evictions += 1
        if self.evicted_log is not None and len(slots):
            self.evicted_log.append(self.ids[slots].clone())
        self.index.remove(self.ids[slots])
        self.last_tick[slots] = INT64_MAX
        self.last_version[slots] = INT64_MAX
        self.free = torch.cat([self.free, slots])

    def evict_lru(self, k: int, tick: int) -> int:
        """Evict the ``k`` rows used least recently, never one touched at ``tick`` (the current call); how many
        went."""
        used = self.last_tick[: self.used]
        k = min(k, int((used < tick).sum()))
        if k > 0:
            self.evict(self._least_recent(used, k))
        return max(k, 0)

    def _least_recent(self, last_tick: torch.Tensor, k: int) -> torch.Tensor:
        """Slots of the ``k`` rows used least recently, ties broken by id: the same rows go
        whatever slots a restore or a different history put them in."""
        threshold = int(torch.kthvalue(last_tick, k).values)
        below = (last_tick < threshold).nonzero().flatten()
        tied = (last_tick == threshold).nonzero().flatten()
        tied = tied[torch.argsort(self.ids[tied])][: k - len(below)]
        return torch.cat([below, tied])

    def evict_unseen(self, before: int) -> int:
        """Evict the rows last updated before version ``before``; how many went."""
        last = self.last_version[: self.used]
        slots = ((last < before) & (last != INT64_MAX)).nonzero().flatten()
        self.evict(slots)
        return len(slots)

    # -- reading rows out -----------------------------------------------------------------

    def rows_at(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-row tensors of a state (ROW_FIELDS) at ``slots``."""
        # (index_select: whole rows at a time, several times advanced indexing's pace on a standby's shipments)
        return {"ids": self.ids.index_select(0, slots), "rows": self.rows.index_select(0, slots),
                "optimizer_state": self.state.index_select(0, slots),
                "last_tick": self.last_tick.index_select(0, slots),
                "last_version": self.last_version.index_select(0, slots)}

    def by_id(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """``rows_at`` of ``slots`` sorted by their rows' ids (a state's layout: equal tables, equal states)."""
        return self.rows_at(slots.index_select(0, torch.argsort(self.ids.index_select(0, slots))))

    def live(self) -> dict[str, torch.Tensor]:
        """Every live row, sorted by id."""
        ids, slots = self.index.items()
        return self.rows_at(slots.index_select(0, torch.argsort(ids)))

    def touched_after(self, tick: int) -> dict[str, torch.Tensor]:
        """The live rows used after clock ``tick``, sorted by id (a scan of every row's clock)."""
        last = self.last_tick[: self.used]
        return self.by_id(((last > tick) & (last != INT64_MAX)).nonzero().flatten())

    def note_from_now(self) -> None:
        """Note the slots touched from now on (up to the table's size): ``noted`` finds them without a scan."""
        self._noted, self._noted_count = [], 0

    def noted(self) -> torch.Tensor | None:
        """The slots touched since ``note_from_now``, unique; None where more were touched than are noted."""
        if self._noted is None:
            return None
        return torch.unique(torch.cat(self._noted)) if self._noted else torch.empty(0, dtype=torch.int64)

    def put(self, state: dict) -> None:
        """Rows of a saved state (ROW_FIELDS, ``n`` rows) into ``n`` new slots of an empty space."""
        slots = self.take(len(state["ids"]))
        for name, tensor in zip(ROW_FIELDS, self._tensors()):
            tensor[slots] = state[name]
        self.index.insert(state["ids"], slots)

    def nbytes(self) -> tuple[int, int]:
        """(bytes of the slots' tensors, bytes of the id index and the free list)."""
        tensors = sum(t.numel() * t.element_size() for t in self._tensors())
        return tensors, self.index.nbytes() + self.free.numel() * self.free.element_size()
