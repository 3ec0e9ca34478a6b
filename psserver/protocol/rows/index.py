"""Id -> slot index of a table's live rows: open addressing, vectorised over a batch of ids.

Why not a Python dict: a batch of a few thousand ids cost ~2 ms in ``dict.get`` and
``tolist`` alone -- a third of what a single process with ``nn.EmbeddingBag(sparse=True)``
spends on its whole step.  Here every operation is a handful of array ops per probe
round, over the ids still probing.  The arrays are numpy's, not torch's: on batches of
a few thousand ids an op's fixed cost dominates, and numpy's (fancy indexing above
all) is 3-5x lower -- the same index in torch ops cost ~0.3 ms per find.

* the table is ``capacity`` positions (a power of two) of (key, slot, state): 21 bytes
  each with the scratch, 2 to 4 positions per live id (a speed/memory trade: at loads
  near 1/2 probe chains, and the time of a batch, about double);
* an id's home position is ``mix64(id ^ SALT) & (capacity - 1)``; the salt makes these
  bits independent of the placement hash (which picks the shard from the same ids, so
  without it every id of one shard would share its low bits);
* linear probing: a lookup walks from home until it finds the key or an EMPTY position,
  WINDOW positions per round (one gather of (ids, WINDOW)), so one round ends nearly
  every probe; a removed key leaves a GONE marker (tombstone) so later keys stay reachable;
* the load (live + tombstones) stays at most 1/2: the table is rebuilt, without
  tombstones, before an insert would pass it, so probe chains stay short.

Inserting a batch resolves collisions between its own ids by letting them claim free
positions at once (a scatter); one claimant per position wins, the others probe on.
A rebuild fills its empty table without probe rounds (``_place_into_empty``).
"""

from __future__ import annotations

import numpy as np
import torch

from psserver.protocol.rows import kernel
from psserver.protocol.rows.placement import mix64_u64

EMPTY, FULL, GONE = 0, 1, 2
MIN_CAPACITY = 64
MAX_LOAD = 0.5
WINDOW = 8  # positions probed per round: at loads up to 1/2 a probe rarely passes 8
_STEPS = np.arange(WINDOW, dtype=np.int64)
_SALT = np.uint64(0xD6E8FEB86659FD93)


def _capacity_for(n: int) -> int:
    """The smallest power of two keeping ``n`` keys at a load of at most 1/4 (room to grow)."""
    cap = MIN_CAPACITY
    while cap * MAX_LOAD / 2 < n:
        cap *= 2
    return cap


def _np(ids: torch.Tensor) -> np.ndarray:
    return ids.contiguous().numpy()


class Room:
    """Where the probes of one ``find_with_room`` ended, for ids it did not find (-1 for those it found); valid
    while the index has made no change since (``changes``)."""

    def __init__(self, positions: np.ndarray, changes: int):
        self.positions, self.changes = positions, changes

    def of(self, which: torch.Tensor) -> "Room":
        """The room of the ids at ``which`` (indices into the find's ids)."""
        return Room(self.positions[_np(which)], self.changes)


class IdIndex:
    """int64 id -> int64 slot.  Callers insert only absent ids and remove only present ones
    (RowStore resolves ids with ``find`` first), so no operation needs to check."""

    def __init__(self, capacity: int = MIN_CAPACITY):
        self._changes = 0  # changes made: inserts, removals, rebuilds (a Room is of one count)
        self._reset(_capacity_for(capacity // 4))

    def _reset(self, capacity: int) -> None:
        self._keys = np.zeros(capacity, dtype=np.int64)
        self._slots = np.full(capacity, -1, dtype=np.int64)
        self._state = np.zeros(capacity, dtype=np.int8)
        self._claim = np.empty(capacity, dtype=np.int32)  # scratch for insert's collisions
        self._mask = capacity - 1
        self.size = 0
        self.tombstones = 0
        self._changes += 1  # a Room of before a change is not used

    def __len__(self) -> int:
        return self.size

    @property
    def capacity(self) -> int:
        return len(self._keys)

    def rebuilds_for(self, n: int) -> bool:
        """Whether inserting ``n`` keys would rebuild the table (a pass over every live key): ``insert``'s test."""
        return self.size + self.tombstones + n > self.capacity * MAX_LOAD

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (mix64_u64(ids.view(np.uint64) ^ _SALT) & np.uint64(self._mask)).view(np.int64)

    def _positions(self, ids: np.ndarray, empty_at: np.ndarray | None = None) -> np.ndarray:
        """Where each id sits in the table, -1 for ids not in it; with ``empty_at``, where the probe of each id
        not in it ended (the empty position an insert of it may take) is written there."""
        if kernel.native is not None:  # the same probe in one loop (psserver.protocol.rows.kernel)
            out = np.empty(len(ids), dtype=np.int64)
            kernel.native.probe(self._keys, self._state, self._mask, np.ascontiguousarray(ids), out, empty_at)
            return out
        home = self._home(ids)
        # Round 0, the home position alone: at loads up to 1/2 most probes end there (their key, or an empty
        # position), and a gather of n positions costs a fraction of one of (n, WINDOW).
        state = self._state[home]
        hit = (state == FULL) & (self._keys[home] == ids)
        out = np.where(hit, home, -1)
        if empty_at is not None:
            empty_at[:] = np.where(state == EMPTY, home, -1)
        todo = np.flatnonzero(~hit & (state != EMPTY))
        keys, start = ids[todo], home[todo]
        while len(keys):
            pos = (start[:, None] + _STEPS) & self._mask
            state = self._state[pos]
            hit = (state == FULL) & (self._keys[pos] == keys[:, None])
            stop = hit | (state == EMPTY)  # a probe ends at its key or at the first empty position
            first = stop.argmax(axis=1)  # the first stop in the window (0 if none)
            rows = np.arange(len(keys))
            found = hit[rows, first]
            at = pos[rows, first]
            out[todo[found]] = at[found]
            go_on = ~stop[rows, first]
            if empty_at is not None:
                empty = ~found & ~go_on
                empty_at[todo[empty]] = at[empty]
            todo, keys, start = todo[go_on], keys[go_on], (start[go_on] + WINDOW) & self._mask
        return out

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Where each id sits in the table, -1 for ids not in it."""
        return torch.from_numpy(self._positions(_np(ids)))

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 for ids not in the index."""
        pos = self._positions(_np(ids))
        return torch.from_numpy(np.where(pos >= 0, self._slots[pos], -1))

    def find_with_room(self, ids: torch.Tensor) -> tuple[torch.Tensor, "Room"]:
        """``find``, and where each missing id's probe ended: an ``insert`` of some of them before anything else
        changes the index places them there without probing again (one pass where a find and an insert took
        two: issue 21 item 2)."""
        raw = _np(ids)
        empty_at = np.empty(len(raw), dtype=np.int64)
        pos = self._positions(raw, empty_at)
        return torch.from_numpy(np.where(pos >= 0, self._slots[pos], -1)), Room(empty_at, self._changes)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor, room: "Room | None" = None) -> None:
        """Add ``ids`` (unique, none already present) with their ``slots``; ``room``: where ``find_with_room``
        saw their probes end (``Room.of``), used only if the index has not changed since."""
        if self.rebuilds_for(len(ids)):
            self._rebuild(self.size + len(ids))
        ids, slots = _np(ids), _np(slots)
        if self.size + self.tombstones == 0:
            self._place_into_empty(ids, slots)
        elif room is not None and room.changes == self._changes:
            self._place_at(ids, slots, room.positions)
        else:
            self._place(ids, slots)
        self._changes += 1

    def fused_arrays(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None:
        """The table's arrays (keys, slots, states, the claim scratch) and mask, for the C kernel's fused lookup of
        ``n`` ids (psserver.protocol.rows.space.RowSpace.fused_lookup), which probes and places absent ids in them
        as ``find_with_room`` and ``insert`` with its room do; None where that insert would rebuild the table or
        fill an empty one (a placement of its own)."""
        if self.size + self.tombstones == 0 or self.rebuilds_for(n):
            return None
        return self._keys, self._slots, self._state, self._claim, self._mask

    def fused_inserted(self, placed: int, ids: np.ndarray, slots: np.ndarray) -> None:
        """After a fused lookup put ``placed`` new ids where their probes ended: counted; ``ids`` (with their
        ``slots``) lost their position to another new id, and are placed by probing on, as ``_place_at`` does."""
        self.size += placed
        if len(ids):
            self._place(ids, slots)
        self._changes += 1

    def _place_at(self, ids: np.ndarray, slots: np.ndarray, at: np.ndarray) -> None:
        """Put each id at ``at``, the empty position where its probe ended in an unchanged index (so every
        position from its home to there holds another key or a tombstone: it stays reachable); of ids sharing
        a position one wins, the others are placed by ``_place``."""
        if kernel.native is not None:  # the same placement in one loop (psserver.protocol.rows.kernel)
            losers = np.empty(len(ids), dtype=np.int64)
            lost = kernel.native.place_at(self._keys, self._slots, self._state, self._claim, np.ascontiguousarray(ids),
                                          np.ascontiguousarray(slots), np.ascontiguousarray(at), losers)
            self.size += len(ids) - lost
            if lost:
                self._place(ids[losers[:lost]], slots[losers[:lost]])
            return
        n = np.arange(len(ids), dtype=np.int32)
        self._claim[at] = n
        won = self._claim[at] == n
        win = at[won]
        self._keys[win], self._slots[win], self._state[win] = ids[won], slots[won], FULL
        self.size += len(win)
        if not won.all():
            self._place(ids[~won], slots[~won])

    def _place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Put each id at the first position of its probe sequence that holds no key."""
        todo, start = np.arange(len(ids), dtype=np.int32), self._home(ids)
        placed = np.zeros(len(ids), dtype=bool)
        while len(todo):
            pos = (start[:, None] + _STEPS) & self._mask
            free = self._state[pos] != FULL
            first = free.argmax(axis=1)
            rows = np.arange(len(todo))
            has = free[rows, first]
            cand, cand_pos = todo[has], pos[rows, first][has]
            self._claim[cand_pos] = cand  # of several claimants of one position, one write survives
            won = self._claim[cand_pos] == cand
            win, win_pos = cand[won], cand_pos[won]
            self.tombstones -= int(np.count_nonzero(self._state[win_pos] == GONE))
            self._keys[win_pos], self._slots[win_pos], self._state[win_pos] = ids[win], slots[win], FULL
            self.size += len(win)
            placed[win] = True
            left = ~placed[todo]
            # a loser looks at the same window again (its position is taken now); a full window moves on
            todo, start = todo[left], np.where(has, start, (start + WINDOW) & self._mask)[left]

    def _place_into_empty(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """``_place`` for an empty table (a rebuild), without probe rounds: inserted in order of home
        position, key i goes to ``max(home_i, pos_{i-1} + 1)`` -- a running maximum.  The few keys this
        would put past the end (they wrap around) are placed after the others by ``_place``."""
        home = self._home(ids)
        order = np.argsort(home, kind="stable")
        rank = np.arange(len(order))
        pos = rank + np.maximum.accumulate(home[order] - rank)
        inside = pos <= self._mask
        at, which = pos[inside], order[inside]
        self._keys[at], self._slots[at], self._state[at] = ids[which], slots[which], FULL
        self.size += len(at)
        if not inside.all():
            self._place(ids[order[~inside]], slots[order[~inside]])

    def remove(self, ids: torch.Tensor) -> torch.Tensor:
        """Forget ``ids`` (unique); the slot each one had, -1 for ids not in the index (one probe pass where a
        find and a remove would take two)."""
        pos = self._positions(_np(ids))
        out = np.where(pos >= 0, self._slots[pos], -1)
        pos = pos[pos >= 0]
        self._changes += 1
        self._state[pos] = GONE
        self._slots[pos] = -1
        self.size -= len(pos)
        self.tombstones += len(pos)
        return torch.from_numpy(out)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (id, slot) held, in table order."""
        live = self._state == FULL
        return torch.from_numpy(self._keys[live]), torch.from_numpy(self._slots[live])

    def _rebuild(self, expected: int) -> None:
        """Re-place every live key in a table sized for ``expected`` keys, dropping tombstones."""
        live = self._state == FULL
        keys, slots = self._keys[live], self._slots[live]
        self._reset(_capacity_for(expected))
        self._place_into_empty(keys, slots)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self._keys, self._slots, self._state, self._claim))
