"""One sparse table's live rows on one shard: lookup, apply, admission, eviction, state.

Rows, optimizer state and bookkeeping sit in tensors indexed by a slot; an IdIndex
(psserver.protocol.rows.index) maps each live id to its slot.  A new store holds room for at most START_BYTES
of rows (one row of a dim-65,536 Adam table, not 1,024 of them: 769 MB before any row existed); capacity
doubles as rows are created and never exceeds its cap -- ``max_rows`` (past it the least recently used rows
are evicted) or else the ``row_limit`` the shard's memory budget gives the table (psserver.state.budget; past it a
call that would add rows is refused, TableFull) -- so memory is bounded whatever stream of ids arrives.  A row that is not stored (never seen, evicted, or not yet
admitted) costs nothing: it is recreated from (seed, id) when it comes back.

Clocks: ``version`` counts pushes applied (Adam's t; "unseen for T versions"
eviction); ``tick`` counts calls (lookups and pushes) and orders rows for LRU.
Every refusal is raised before anything changes.

The rows sit in slots (psserver.protocol.rows.space.RowSpace: the tensors, the id index, growth, eviction);
``RowStore`` is the table's calls on them -- their checks, clocks, admission and counts, and the checkpoint form --
and changes the slots only once a call passed every check (a refusal leaves no trace).  The pieces with no share
in that invariant are rooms of their own (``index``, ``admission``, ``init``, ``optim``, ``placement``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch

from psserver.protocol import limits
from psserver.protocol.rows import admission, errors
from psserver.protocol.rows.admission import CountMinSketch
from psserver.protocol.rows.init import Initializer
from psserver.protocol.rows.optim import SparseOptimizerConfig, state_width, update_rows
from psserver.protocol.rows.placement import check_ids
from psserver.protocol.rows.space import INT64_MAX, ROW_FIELDS, RowSpace

TABLE_MODES = ("", "sync", "async", "stale-timeout")  # "": the job's mode
# LRU eviction frees this fraction of max_rows beyond what a call needs, so that at the cap a
# scan of all rows' last use is paid once per max_rows/64 new rows, not on every call.
EVICT_SLACK = 1 / 64
START_BYTES = 256 << 10  # room for rows a new store allocates: more comes by doubling as rows arrive
# Bytes a live row costs besides its values: id and two clocks (24), and its share of the id index
# (2 to 4 positions of 21 bytes, psserver.protocol.rows.index) -- the budget counts the most.
ROW_OVERHEAD_BYTES = 24 + 4 * 21


def strictly_increasing(ids: torch.Tensor) -> bool:
    """Whether 1-D ``ids`` are sorted with no repeats: what a trainer sends (it deduplicates with
    torch.unique, which sorts), so the common case skips a full ``torch.unique``."""
    a = ids.numpy()
    return len(a) < 2 or bool((a[1:] > a[:-1]).all())


def hash_tensor(h, t: torch.Tensor) -> None:
    """Feed a CPU tensor's bytes into hashlib's ``h`` -- the bytes ``t.numpy().tobytes()`` holds, without that copy:
    hashlib reads the buffer with the GIL released, so a state digest of a big table no longer holds the event
    loop while it copies (a 2M-row table's digest stalled it 1.45 s)."""
    h.update(memoryview(t.detach().contiguous().reshape(-1).numpy()).cast("B"))


def all_finite(t: torch.Tensor) -> bool:
    """Whether a CPU float tensor holds no NaN or infinity (numpy's isfinite: ~15x torch's on one thread)."""
    return bool(np.isfinite(t.detach().numpy()).all())


def _check_int(field_name: str, value, low: int, high: int, optional: bool = False) -> None:
    """Refuse a non-integer or an integer outside [low, high], naming the field and value."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        none = " or None" if optional else ""
        raise ValueError(f"table {field_name} ({value!r}) must be an integer from {low} to {high}{none}")


# An update's rows are padded to a multiple of this many rows.  Why: torch's element-wise kernels run a
# tensor in SIMD vectors and its last ``numel % width`` elements in a scalar loop whose rounding may differ
# (FMA or not); which rows fall there would depend on which other rows the batch touched on this shard, so a
# row's value would depend on the shard count (a re-shard, psserver.resharding.reshard).  Padded, every real row's
# elements take the vector path: a row is a function of its own gradients alone.
LANE_ROWS = 64


class UpdateScratch:
    """Buffers an update works in, padded to LANE_ROWS and kept between pushes: a push gathers its rows, their
    state and its gradients into them (``index_select(out=)``, ``copy_``) instead of concatenating fresh tensors
    (three allocations and copies a push, ~100-400 KB each at a few thousand rows).  What is kept grows by
    doubling up to KEEP_BYTES; a bigger push gets buffers of its own, freed after it, as before."""

    KEEP_BYTES = 4 << 20

    def __init__(self, dim: int, width: int):
        self.dim, self.width = dim, width
        self.keep_rows = max(LANE_ROWS, self.KEEP_BYTES // ((2 * dim + width) * 4) // LANE_ROWS * LANE_ROWS)
        self._rows, self._state, self._grads = self._new(0)

    def _new(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.zeros(m, self.dim), torch.zeros(m, self.width), torch.zeros(m, self.dim)

    def _buffers(self, m: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Three buffers of ``m`` rows: views of the kept ones, or new ones past what is kept.  What is kept
        stops at ``keep_rows`` and at the store's own ``capacity`` (rounded up to LANE_ROWS), so a table's
        scratch is never more than about twice the rows it holds: the memory budget's row limits, which
        bound the rows, bound it too."""
        keep = min(self.keep_rows, capacity + (-capacity % LANE_ROWS))
        if m > keep:
            return self._new(m)
        if m > len(self._rows):
            self._rows, self._state, self._grads = self._new(min(max(m, 2 * len(self._rows)), keep))
        return self._rows[:m], self._state[:m], self._grads[:m]

    def nbytes(self) -> int:
        """Bytes kept between pushes: at most KEEP_BYTES."""
        return 4 * (self._rows.numel() + self._state.numel() + self._grads.numel())

    def padded(self, n: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three buffers for an update of ``n`` rows of a store of ``capacity`` slots, padded to a multiple of
        LANE_ROWS; what is in them is undefined (``gather`` fills them; RowSpace.fused_gather as it does)."""
        return self._buffers(n + (-n % LANE_ROWS), capacity)

    def gather(self, rows: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
               grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows and state at ``slots`` and ``grads``, each padded with zero rows to a multiple of LANE_ROWS
        (why: LANE_ROWS); views of the scratch, valid until the next call."""
        n = len(slots)
        out = self.padded(n, len(rows))
        torch.index_select(rows, 0, slots, out=out[0][:n])
        out[2][:n].copy_(grads)
        if self.width:
            torch.index_select(state, 0, slots, out=out[1][:n])
        for t in out:  # the padding: zeros again (an update may have written there: 0/0 with eps 0)
            t[n:].zero_()
        return out


@dataclass(frozen=True)
class TableSpec:
    """What a table is; fixed for the life of a job and checked against a checkpoint on restore."""

    name: str
    dim: int
    optimizer: SparseOptimizerConfig = field(default_factory=SparseOptimizerConfig)
    initializer: Initializer = field(default_factory=Initializer)
    seed: int = 0  # with the id, the only input of a row's initial values
    num_embeddings: int | None = None  # bounded table: ids 0..num_embeddings-1; None: any int64
    admit_after: int = 0  # sightings of an id that read zeros before its row is stored
    max_rows: int | None = None  # live rows kept: least recently used ones are evicted past it
    evict_after: int | None = None  # evict rows unseen for this many versions
    mode: str = ""  # "" follows the job's mode; "async" gives async embeddings next to sync dense layers
    max_staleness: int | None = None  # async tables: a row's gradient more than this many of the row's
    # updates behind is dropped (counted); None: unbounded

    def __post_init__(self) -> None:
        problem = limits.text_problem("table name", self.name, limits.MAX_NAME_CHARS)
        if problem or not self.name:
            raise ValueError(problem or "table name must not be empty")
        _check_int("dim", self.dim, 1, limits.MAX_EMBEDDING_DIM)
        _check_int("seed", self.seed, 0, INT64_MAX)
        _check_int("num_embeddings", self.num_embeddings, 1, INT64_MAX, optional=True)
        _check_int("admit_after", self.admit_after, 0, limits.MAX_ADMIT_AFTER)
        _check_int("max_rows", self.max_rows, 1, limits.MAX_TABLE_ROWS, optional=True)
        _check_int("evict_after", self.evict_after, 1, limits.MAX_SCHEDULE_STEPS, optional=True)
        if self.mode not in TABLE_MODES:
            raise ValueError(f"table mode ({self.mode!r}) must be one of {', '.join(map(repr, TABLE_MODES))}")
        _check_int("max_staleness", self.max_staleness, 0, limits.MAX_STALENESS, optional=True)
        for name, cls in (("optimizer", SparseOptimizerConfig), ("initializer", Initializer)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"table {name} ({getattr(self, name)!r}) must be a {cls.__name__}")


def row_bytes(spec: TableSpec) -> int:
    """Bytes one live row of ``spec`` costs at most: its values, its optimizer state, its bookkeeping."""
    return (spec.dim + state_width(spec.optimizer, spec.dim)) * 4 + ROW_OVERHEAD_BYTES


def scratch_bytes(spec: TableSpec, rows: int) -> int:
    """Bytes a table of at most ``rows`` rows keeps in its UpdateScratch between pushes: its rows rounded up to
    LANE_ROWS, at most ``keep_rows`` (KEEP_BYTES, or LANE_ROWS rows of a very wide table).  The memory budget
    reserves them beside the rows (psserver.state.budget): before, they were outside --max-memory."""
    per_row = (2 * spec.dim + state_width(spec.optimizer, spec.dim)) * 4
    keep_rows = max(LANE_ROWS, UpdateScratch.KEEP_BYTES // per_row // LANE_ROWS * LANE_ROWS)
    return min(keep_rows, rows + (-rows % LANE_ROWS)) * per_row


def start_bytes(spec: TableSpec) -> int:
    """Bytes a store of ``spec`` holds before any row: its first slots, the id index, the admission sketch."""
    sketch = admission.DEPTH * admission.WIDTH * 4 if spec.admit_after else 0
    return _start_capacity(spec, None) * row_bytes(spec) + 64 * 21 + sketch


def _start_capacity(spec: TableSpec, row_limit: int | None) -> int:
    """Slots a new store allocates: at most START_BYTES of rows (at least one), never past its cap."""
    cap = spec.max_rows or row_limit or limits.MAX_TABLE_ROWS
    return max(1, min(1024, START_BYTES // row_bytes(spec), cap))


@dataclass
class TableCounts:
    """What happened to rows, for metrics: each only grows."""

    rows_created: int = 0
    zero_reads: int = 0  # ids read as zeros because they were not admitted yet
    dropped_grads: int = 0  # gradient rows of ids not admitted yet: counted, not stored
    evicted_lru: int = 0
    evicted_stale: int = 0


class RowStore:
    """The live rows of one table on one shard (not thread-safe: the servicer serialises calls): its calls,
    their checks and clocks, over the slots the rows live in (``space``, psserver.protocol.rows.space)."""

    def __init__(self, spec: TableSpec, initial_capacity: int | None = None, row_limit: int | None = None,
                 room: Callable[[int], None] | None = None):
        """``row_limit``: rows this store may hold when ``spec`` sets no max_rows (None: no limit).  ``room(nbytes)``:
        asked before the slots grow by ``nbytes`` for a lookup's new rows; it raises to refuse the call (the
        machine's memory: psserver.state.budget.check_machine_room)."""
        self.spec = spec
        self.room = room
        self.row_limit = None if spec.max_rows else row_limit
        self.width = state_width(spec.optimizer, spec.dim)
        self.version = 0
        self.tick = 0
        self.counts = TableCounts()
        self.sketch = CountMinSketch() if spec.admit_after else None
        self.space = RowSpace(spec, self.width, _start_capacity(spec, row_limit) if initial_capacity is None
                              else initial_capacity, self.row_limit)
        self._last: tuple | None = None  # (ids, slots, evictions) of the last lookup: see _resolve
        self._scratch = UpdateScratch(spec.dim, self.width)
        self._marked: tuple[int, int] | None = None  # the last mark() given

    def __len__(self) -> int:
        return len(self.space)

    @property
    def capacity(self) -> int:
        """Row slots allocated now (live rows, free slots and room to grow)."""
        return self.space.capacity

    @property
    def evicted_log(self) -> list[torch.Tensor] | None:
        """Ids evicted since it was set to [] (None: not kept): a live re-shard forwards their deletion."""
        return self.space.evicted_log

    @evicted_log.setter
    def evicted_log(self, log: list[torch.Tensor] | None) -> None:
        self.space.evicted_log = log

    def room_for(self, n: int) -> bool:
        """Whether creating up to ``n`` rows costs nothing proportional to the table (RowSpace.room_for)."""
        return self.space.room_for(n)

    def slot_bound(self, n: int) -> int:
        """Every slot a row has after creating up to ``n`` rows is below this (psserver.sparse.versions)."""
        return self.space.used + n

    def holds(self, ids: torch.Tensor) -> torch.Tensor:
        """A bool per id: whether its row is stored now."""
        return self.space.index.find(ids) >= 0

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where it has no row: where per-row data kept beside the store sits
        (psserver.sparse.versions); a slot is valid until the next call that creates or evicts rows."""
        return self.space.index.find(ids)

    # -- rows made, used and evicted on the table's clocks ---------------------------------

    def _touch(self, slots: torch.Tensor) -> None:
        """Mark rows as used now, for both eviction clocks."""
        self.space.touch(slots, self.tick, self.version)

    def _create(self, ids: torch.Tensor, room=None) -> torch.Tensor:
        """Store new rows for ``ids`` (unique, absent) from the initialiser; their slots.  Makes
        room first by evicting least recently used rows, never one touched by this call."""
        if self.spec.max_rows and len(self) + len(ids) > self.spec.max_rows:
            slack = int(self.spec.max_rows * EVICT_SLACK)
            self.counts.evicted_lru += self.space.evict_lru(
                min(len(self) + len(ids) - self.spec.max_rows + slack, len(self)), self.tick)
        slots = self.space.create(ids, room)
        self.counts.rows_created += len(ids)
        return slots

    def evict_stale(self) -> int:
        """Evict rows unseen for more than ``evict_after`` versions; how many went."""
        if not self.spec.evict_after:
            return 0
        gone = self.space.evict_unseen(self.version - self.spec.evict_after)
        self.counts.evicted_stale += gone
        return gone

    # -- checks (before any change) ------------------------------------------------------

    def check_ids(self, ids: torch.Tensor) -> None:
        """Refuse malformed ids, too many of them, or ids outside a bounded table."""
        try:
            check_ids(ids)
        except ValueError as e:
            raise errors.BadIds(str(e)) from None
        if len(ids) > limits.MAX_IDS_PER_CALL:
            raise errors.TooManyIds(f"ids has {len(ids)} entries, over the limit of {limits.MAX_IDS_PER_CALL}")
        n = self.spec.num_embeddings
        if n is not None and len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < n):
            bad = ids[(ids < 0) | (ids >= n)]
            if len(bad):
                raise errors.IdOutOfRange(f"id {bad[0].item()} is out of range for table {self.spec.name!r} "
                                          f"with num_embeddings {n} (ids 0..{n - 1})")

    def check_fits(self, n_unique: int) -> None:
        """Refuse a call whose rows could not all be live at once."""
        if self.spec.max_rows and n_unique > self.spec.max_rows:
            raise errors.TooManyIds(f"ids has {n_unique} unique ids, over the max_rows of table "
                                    f"{self.spec.name!r} ({self.spec.max_rows})")
        if self.row_limit and n_unique > self.row_limit:
            raise errors.TooManyIds(f"ids has {n_unique} unique ids, over the row limit of table "
                                    f"{self.spec.name!r} ({self.row_limit}, from the shard's --max-memory)")

    def new_rows(self, uniq: torch.Tensor) -> int:
        """How many of the unique ids ``uniq`` have no row now: what a call on them may add."""
        return int((self.space.index.find(uniq) < 0).sum())

    def check_room(self, uniq: torch.Tensor) -> None:
        """Refuse a call whose new rows (of the unique ids ``uniq``) would take a table without max_rows past its
        row limit.  Costs a find only near the limit."""
        if self.room is not None and self.space.growth(len(uniq)):  # (as if none had a row: then the rows it adds)
            grow = self.space.growth(self.new_rows(uniq))
            if grow:
                self.room(grow * row_bytes(self.spec))
        if self.row_limit is None or len(self) + len(uniq) <= self.row_limit:
            return
        new = self.new_rows(uniq)
        if len(self) + new > self.row_limit:
            raise errors.TableFull(
                f"table {self.spec.name!r} holds {len(self)} rows and its row limit is {self.row_limit} (its share of "
                f"the shard's --max-memory, {row_bytes(self.spec)} bytes a row); this call would add {new}: "
                "give the table a max_rows to evict least recently used rows instead, or raise --max-memory")

    def _check_grads(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Refuse gradient rows of the wrong shape or dtype, or non-finite values."""
        want = (len(ids), self.spec.dim)
        if not isinstance(grads, torch.Tensor) or grads.dtype != torch.float32 or tuple(grads.shape) != want:
            got = f"{grads.dtype} {tuple(grads.shape)}" if isinstance(grads, torch.Tensor) else type(grads).__name__
            raise errors.WrongShape(f"grad_rows is {got}, table {self.spec.name!r} needs float32 {want} "
                                    f"(one row of dim {self.spec.dim} per id)")
        if not all_finite(grads):
            bad = (~torch.isfinite(grads)).any(dim=1)
            raise errors.NonFinite(f"grad_rows for id {ids[bad][0].item()} holds a non-finite value")

    def _admit(self, ids: torch.Tensor, sighting: bool) -> torch.Tensor:
        """Which absent ``ids`` may get a row: all without admission, else those seen more than
        ``admit_after`` times (a lookup counts as a sighting, a push does not)."""
        if self.sketch is None:
            return torch.ones(len(ids), dtype=torch.bool)
        seen = self.sketch.add(ids) if sighting else self.sketch.estimate(ids)
        return seen > self.spec.admit_after

    def _resolve(self, ids: torch.Tensor, sighting: bool) -> torch.Tensor:
        """Slots of unique ``ids`` after creating the admitted absent ones; -1 for the others.

        A push of exactly the ids of the last lookup (the one trainer of a sync round, or any
        trainer in async) reuses that lookup's slots instead of finding them again, unless a row
        was evicted since (then a slot may hold another row now)."""
        last = self._last
        if (not sighting and last is not None and last[2] == self.space.evictions and len(last[0]) == len(ids)
                and torch.equal(last[0], ids)):
            self._touch(last[1])
            return last[1].clone()
        # a lookup meets new ids (~60% of a click batch's): its insert takes the positions its find ended at; a
        # push's ids were looked up before, so it finds them without noting where absent ones would go
        index = self.space.index
        slots, room = index.find_with_room(ids) if sighting else (index.find(ids), None)
        missing = (slots < 0).nonzero().flatten()
        if not len(missing):
            self._touch(slots)
            return slots
        # touched before creating: with max_rows, touched rows are safe from LRU eviction
        self._touch(slots[slots >= 0])
        admitted = missing[self._admit(ids[missing], sighting)]
        if self.row_limit is not None:  # lookups were checked (check_room); a round's apply keeps what fits
            admitted = admitted[: max(0, self.row_limit - len(self))]
        if len(admitted):
            slots[admitted] = self._create(ids[admitted], None if room is None else room.of(admitted))
            self._touch(slots[admitted])
        return slots

    # -- the calls ---------------------------------------------------------------------

    def lookup(self, ids: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """The rows of ``ids`` (repeats allowed), float32 (len(ids), dim): stored rows, new rows
        for ids seen for the first time (or admitted now), zeros for ids not admitted yet.
        ``checked``: the caller checked ``ids`` (``check_ids`` and ``check_fits``, as a shard's served table
        does at a call's entry), so they are not checked again.

        Raises:
            BadIds, IdOutOfRange, TooManyIds: nothing changed.
        """
        if not checked:
            self.check_ids(ids)
        uniq, inverse = (ids, None) if strictly_increasing(ids) else torch.unique(ids, return_inverse=True)
        if not checked:
            self.check_fits(len(uniq))
        self.check_room(uniq)
        self.tick += 1
        fused = self.space.fused_lookup(uniq, self.tick, self.version) if self._all_get_rows(len(uniq)) else None
        if fused is not None:  # the same work in one C call (RowSpace.fused_lookup)
            slots, out, created = fused
            self.counts.rows_created += created
            self._last = (uniq.clone(), slots, self.space.evictions)
            return out if inverse is None else out[inverse]
        slots = self._resolve(uniq, sighting=True)
        if self.sketch is None:  # without admission every id has a row now
            out = self.space.rows.index_select(0, slots)
            self._last = (uniq.clone(), slots, self.space.evictions)
        else:
            have = slots >= 0
            self.counts.zero_reads += int((~have).sum())
            out = torch.zeros(len(uniq), self.spec.dim)
            out[have] = self.space.rows[slots[have]]
        return out if inverse is None else out[inverse]

    def apply(self, ids: torch.Tensor, grad_rows: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """One optimizer step on the rows of ``ids`` (unique) with their summed gradient rows; the slot
        each id's row was updated in (-1: its gradient dropped -- not admitted, or past the row limit).

        ``checked``: the caller checked ``ids`` already (a shard's served table checks every push's ids at the
        call's entry, and a round's union is of checked pushes), so only the gradient rows are checked here.

        Every call is one version, even an empty one: Adam's bias correction counts the
        table's steps as torch.optim.SparseAdam does.  Gradients of ids not admitted, or of new
        ids past the row limit (a sync round's union, checked push by push, may pass it), are
        counted and dropped.

        Raises:
            BadIds, WrongShape, DuplicateIds, NonFinite, IdOutOfRange, TooManyIds: nothing changed.
        """
        if not checked:
            self.check_ids(ids)
            _check_unique(ids)
        self._check_grads(ids, grad_rows)
        self.check_fits(len(ids))
        self.version += 1
        self.tick += 1
        fused = self._fused_apply(ids, grad_rows)
        if fused is not None:
            return fused
        slots = every = self._resolve(ids, sighting=False)
        keep = slots >= 0  # all of them unless admission or the row limit left some out
        if not bool(keep.all()):
            self.counts.dropped_grads += int((~keep).sum())
            slots, grad_rows = slots[keep], grad_rows[keep]
        space = self.space
        rows, state, grads = self._scratch.gather(space.rows, space.state, slots, grad_rows)
        update_rows(self.spec.optimizer, rows, state, grads, self.version)
        n = len(slots)
        space.rows.index_copy_(0, slots, rows[:n])
        if self.width:
            space.state.index_copy_(0, slots, state[:n])
        if self.evict_stale():  # a slot evicted now holds no row
            every = space.index.find(ids)
        return every

    def _all_get_rows(self, n: int) -> bool:
        """Whether every one of ``n`` absent ids would get a row now: no admission sketch, no row limit in reach."""
        return self.sketch is None and (self.row_limit is None or len(self) + n <= self.row_limit)

    def _fused_apply(self, ids: torch.Tensor, grad_rows: torch.Tensor) -> torch.Tensor | None:
        """``apply`` after its checks and clocks for a push of exactly the last lookup's ids (see _resolve), with
        the gather and the scatter in one C call each (RowSpace.fused_gather) and the update torch's, as there:
        the slots, or None (nothing changed: the general path's turn)."""
        last = self._last
        if not (last is not None and last[2] == self.space.evictions and len(last[0]) == len(ids)
                and torch.equal(last[0], ids)):
            return None
        space, slots = self.space, last[1]
        out = self._scratch.padded(len(slots), len(space.rows))
        if not space.fused_gather(slots, grad_rows, self.tick, self.version, out):
            return None
        n = len(slots)
        update_rows(self.spec.optimizer, out[0], out[1], out[2], self.version)
        space.fused_scatter(slots, out[0][:n], out[1][:n])
        if self.evict_stale():  # a slot evicted now holds no row
            return space.index.find(ids)
        return slots.clone()

    # -- checkpoints and accounting ----------------------------------------------------

    def state(self) -> dict:
        """The live rows only, with their optimizer state and clocks: what a checkpoint holds.
        Sorted by id, so equal tables give equal states whatever their history."""
        return {**self.space.live(), **self._meta()}

    def _meta(self) -> dict:
        """What a state holds besides its rows."""
        return {"version": self.version, "tick": self.tick, "counts": asdict(self.counts),
                "sketch": None if self.sketch is None else self.sketch.counts.clone(),
                "sketch_sightings": 0 if self.sketch is None else self.sketch.sightings}

    def mark(self) -> tuple[int, int]:
        """Where the store stands now, for ``state_since``: its clock and how often it evicted rows.  The slots
        touched from now on are noted (up to the table's size), so a ``state_since`` of this mark -- the newest --
        finds them without a scan of every row's clock."""
        self._marked = (self.tick, self.space.evictions)
        self.space.note_from_now()
        return self._marked

    def exposed(self) -> tuple:
        """Counters that move whenever what a read of this store shows changes, or what it keeps depends on reads:
        its push version and evictions; and its clock where a read decides what stays (max_rows, evict_after, an
        admission sketch).  Rows a read creates come back the same from (seed, id) wherever they are made again, in
        any batch (psserver.protocol.rows.init), so they are not in it.  (psserver.replication.shipper: a read whose
        counters match a shipment's needs no newer one.)"""
        spec = self.spec
        if spec.max_rows or spec.evict_after or spec.admit_after:
            return self.version, self.space.evictions, self.tick
        return self.version, self.space.evictions

    def state_since(self, mark: tuple[int, int]) -> dict | None:
        """``state()`` with only the rows a call touched after ``mark`` (created, updated or read), and
        ``since``: that mark's clock -- what ``deltas.merge_states`` needs beside the state at the mark to make
        this one.
        None where rows were evicted since: only a whole state says which rows went."""
        tick, evictions = mark
        if evictions != self.space.evictions:
            return None
        noted = self.space.noted() if mark == self._marked else None
        if noted is None:
            return {**self.touched_since(tick), **self._meta(), "since": tick}
        # (no eviction since: every noted slot still holds its row)
        return {**self.space.by_id(noted), **self._meta(), "since": tick}

    def touched_since(self, tick: int) -> dict:
        """The live rows a call touched after clock ``tick`` (created, updated or read), as ``state()`` lays rows
        out (sorted by id): what a live re-shard forwards (psserver.resharding.handoff.rows)."""
        return self.space.touched_after(tick)

    @classmethod
    def restore(cls, spec: TableSpec, state: dict, row_limit: int | None = None,
                room: Callable[[int], None] | None = None) -> "RowStore":
        """A store holding exactly what ``state()`` saved, for ``spec``.

        Raises:
            BadTableState: the state does not fit the spec (naming the field and both values).
        """
        n = _check_state(spec, state)
        store = cls(spec, initial_capacity=max(n, 1), row_limit=row_limit, room=room)
        store.space.put(state)
        store.version, store.tick = state["version"], state["tick"]
        store.counts = TableCounts(**state["counts"])
        if store.sketch is not None and state["sketch"] is not None:
            store.sketch.counts.copy_(state["sketch"])
            store.sketch.sightings = state["sketch_sightings"]
        return store

    def memory(self) -> dict[str, int]:
        """Bytes held: ``tensors`` (allocated slots), ``index`` (the id -> slot index and the free
        list), ``admission`` (the sketch), ``scratch`` (the update buffers kept between pushes), ``total``; and ``live_payload``, the bytes of live rows
        and their optimizer state alone."""
        tensors, index = self.space.nbytes()
        admission = 0 if self.sketch is None else self.sketch.nbytes()
        scratch = self._scratch.nbytes()
        return {"tensors": tensors, "index": index, "admission": admission, "scratch": scratch,
                "total": tensors + index + admission + scratch,
                "live_payload": len(self) * (self.spec.dim + self.width) * 4}


def _check_unique(ids: torch.Tensor) -> None:
    """Refuse repeated ids in one push."""
    if not strictly_increasing(ids):
        uniq, counts = torch.unique(ids, return_counts=True)
        if len(uniq) < len(ids):
            dup = counts > 1
            raise errors.DuplicateIds(f"id {uniq[dup][0].item()} appears {counts[dup][0].item()} times "
                                      f"in one push; sum its gradient rows first")


def _expect(name: str, value, dtype: torch.dtype, shape: tuple) -> None:
    """Refuse a saved tensor of another type, dtype or shape, naming both."""
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != shape:
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise errors.BadTableState(f"saved {name} is {got}, the table needs {dtype} {shape}")


def _check_state(spec: TableSpec, state: dict) -> int:
    """Refuse a saved state that does not fit ``spec``; the number of rows it holds."""
    ids = state.get("ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        raise errors.BadTableState(f"saved ids must be a 1-D int64 tensor, not {type(ids).__name__}")
    n = len(ids)
    _expect("ids", ids, torch.int64, (n,))
    _expect("rows", state.get("rows"), torch.float32, (n, spec.dim))
    _expect("optimizer_state", state.get("optimizer_state"), torch.float32, (n, state_width(spec.optimizer, spec.dim)))
    for name in ("last_tick", "last_version"):
        _expect(name, state.get(name), torch.int64, (n,))
    if spec.max_rows is not None and n > spec.max_rows:
        raise errors.BadTableState(f"saved state holds {n} rows, over the max_rows of table {spec.name!r} ({spec.max_rows})")
    if len(torch.unique(ids)) != n:
        raise errors.BadTableState("saved ids repeat an id")
    if spec.num_embeddings is not None and n and (ids.min() < 0 or ids.max() >= spec.num_embeddings):
        raise errors.BadTableState(f"saved ids reach outside 0..{spec.num_embeddings - 1} (num_embeddings)")
    if not (torch.isfinite(state["rows"]).all() and torch.isfinite(state["optimizer_state"]).all()):
        raise errors.BadTableState("saved rows or optimizer_state hold a non-finite value")
    sketch = state.get("sketch")
    if spec.admit_after and sketch is not None:
        _expect("sketch", sketch, torch.int32, (admission.DEPTH, admission.WIDTH))
    for name in ("version", "tick", "sketch_sightings"):
        value = state.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise errors.BadTableState(f"saved {name} ({value!r}) must be an integer, zero or more")
    if not isinstance(state.get("counts"), dict) or set(state["counts"]) != set(TableCounts.__dataclass_fields__):
        raise errors.BadTableState(f"saved counts must name {', '.join(TableCounts.__dataclass_fields__)}")
    return n
