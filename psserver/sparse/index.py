"""Id -> slot index of a table's live rows: open addressing, vectorised over a batch of ids.

Why not a Python dict: a batch of a few thousand ids cost ~2 ms in ``dict.get`` and
``tolist`` alone -- a third of what a single process with ``nn.EmbeddingBag(sparse=True)``
spends on its whole step.  Here every operation is a handful of tensor ops per probe
round, over the ids still probing:

* the table is ``capacity`` positions (a power of two) of (key, slot, state): 21 bytes
  each with the scratch, 2 to 4 positions per live id (a speed/memory trade: at loads
  near 1/2 probe chains, and the time of a batch, about double);
* an id's home position is ``mix64(id ^ SALT) & (capacity - 1)``; the salt makes these
  bits independent of the placement hash (which picks the shard from the same ids, so
  without it every id of one shard would share its low bits);
* linear probing: a lookup walks from home until it finds the key or an EMPTY position;
  a removed key leaves a GONE marker (tombstone) so later keys stay reachable;
* the load (live + tombstones) stays at most 1/2: the table is rebuilt, without
  tombstones, before an insert would pass it, so probe chains stay short.

Inserting a batch resolves collisions between its own ids by letting them claim free
positions at once (a scatter); one claimant per position wins, the others probe on.
"""

from __future__ import annotations

import torch

from psserver.sparse.placement import as_int64, mix64

SALT = as_int64(0xD6E8FEB86659FD93)
EMPTY, FULL, GONE = 0, 1, 2
MIN_CAPACITY = 64
MAX_LOAD = 0.5


def _capacity_for(n: int) -> int:
    """The smallest power of two keeping ``n`` keys at a load of at most 1/4 (room to grow)."""
    cap = MIN_CAPACITY
    while cap * MAX_LOAD / 2 < n:
        cap *= 2
    return cap


class IdIndex:
    """int64 id -> int64 slot.  Callers insert only absent ids and remove only present ones
    (RowStore resolves ids with ``find`` first), so no operation needs to check."""

    def __init__(self, capacity: int = MIN_CAPACITY):
        self._reset(_capacity_for(capacity // 4))

    def _reset(self, capacity: int) -> None:
        self._keys = torch.zeros(capacity, dtype=torch.int64)
        self._slots = torch.full((capacity,), -1, dtype=torch.int64)
        self._state = torch.zeros(capacity, dtype=torch.int8)
        self._claim = torch.empty(capacity, dtype=torch.int32)  # scratch for insert's collisions
        self._mask = capacity - 1
        self.size = 0
        self.tombstones = 0

    def __len__(self) -> int:
        return self.size

    @property
    def capacity(self) -> int:
        return len(self._keys)

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        return mix64(ids ^ SALT) & self._mask

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Where each id sits in the table, -1 for ids not in it."""
        out = torch.full((len(ids),), -1, dtype=torch.int64)
        todo, keys, pos = torch.arange(len(ids)), ids, self._home(ids)
        while len(todo):
            state = self._state[pos]
            hit = (state == FULL) & (self._keys[pos] == keys)
            out[todo[hit]] = pos[hit]
            go_on = ~hit & (state != EMPTY)
            todo, keys, pos = todo[go_on], keys[go_on], (pos[go_on] + 1) & self._mask
        return out

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 for ids not in the index."""
        pos = self.positions(ids)
        found = pos >= 0
        out = torch.full((len(ids),), -1, dtype=torch.int64)
        out[found] = self._slots[pos[found]]
        return out

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ``ids`` (unique, none already present) with their ``slots``."""
        if (self.size + self.tombstones + len(ids)) > self.capacity * MAX_LOAD:
            self._rebuild(self.size + len(ids))
        self._place(ids, slots)

    def _place(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        todo, pos = torch.arange(len(ids), dtype=torch.int32), self._home(ids)
        while len(todo):
            free = self._state[pos] != FULL
            cand, cand_pos = todo[free], pos[free]
            self._claim[cand_pos] = cand  # of several claimants of one position, one write survives
            won = self._claim[cand_pos] == cand
            win, win_pos = cand[won], cand_pos[won]
            self.tombstones -= int((self._state[win_pos] == GONE).sum())
            self._keys[win_pos], self._slots[win_pos], self._state[win_pos] = ids[win], slots[win], FULL
            self.size += len(win)
            placed = torch.zeros(len(ids), dtype=torch.bool)
            placed[win] = True
            left = ~placed[todo]
            todo, pos = todo[left], (pos[left] + 1) & self._mask

    def remove(self, ids: torch.Tensor) -> None:
        """Forget ``ids`` (each present)."""
        pos = self.positions(ids)
        pos = pos[pos >= 0]
        self._state[pos] = GONE
        self._slots[pos] = -1
        self.size -= len(pos)
        self.tombstones += len(pos)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (id, slot) held, in table order."""
        live = self._state == FULL
        return self._keys[live], self._slots[live]

    def _rebuild(self, expected: int) -> None:
        """Re-place every live key in a table sized for ``expected`` keys, dropping tombstones."""
        keys, slots = self.items()
        self._reset(_capacity_for(expected))
        self._place(keys, slots)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._keys, self._slots, self._state, self._claim))
