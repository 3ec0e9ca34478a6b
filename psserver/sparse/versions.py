"""When each row of an async table was last updated, for the per-row staleness bound, without per-id Python.

A dict of id -> version cost ~0.1-0.3 ms per 2,048-row push in ``dict.update`` and a list comprehension over
``tolist()``, and grew with every id ever pushed until pruned.  Here the version sits beside the row's slot
in the table's RowStore: a push's update writes it at the slots the update just resolved (no lookup of its
own), and a staleness check is one find in the store's vectorised index and two gathers.  Each entry also
keeps the id it is about, so a slot that an evicted row freed and a new row took reads as never updated:
evicted rows start afresh, and the memory is bounded by the table's slots.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from psserver.protocol.rows.table import RowStore


class RowVersions:
    """Slot -> (id, version of that row's last update) for one RowStore; -1 for a row never updated."""

    def __init__(self, store: RowStore):
        self.store = store
        self._ids = np.zeros(0, dtype=np.int64)
        self._versions = np.zeros(0, dtype=np.int64)

    def _fit(self, top: int) -> None:
        """Room for slots below ``top`` (grown by doubling, new entries never updated)."""
        if top > len(self._versions):
            n = max(top, 2 * len(self._versions), 1024)
            self._ids = np.concatenate([self._ids, np.zeros(n - len(self._ids), dtype=np.int64)])
            self._versions = np.concatenate([self._versions, np.full(n - len(self._versions), -1, dtype=np.int64)])

    def room_below(self, top: int) -> bool:
        """Whether an update of slots below ``top`` needs no growth (a copy of every entry)."""
        return top <= len(self._versions)

    def set(self, ids: torch.Tensor, slots: torch.Tensor, version: int) -> None:
        """Rows ``ids`` at ``slots`` (-1: not stored, skipped) were updated at ``version``."""
        s, i = slots.numpy(), ids.numpy()
        stored = s >= 0
        s, i = s[stored], i[stored]
        if len(s):
            self._fit(int(s.max()) + 1)
            self._ids[s], self._versions[s] = i, version

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        """The version of each id's last update, -1 for ids whose row was not updated since it was stored."""
        s = self.store.slots(ids).numpy()
        ok = (s >= 0) & (s < len(self._versions))
        at = np.where(ok, s, 0)
        ok &= self._ids[at] == ids.numpy() if len(self._ids) else False
        return torch.from_numpy(np.where(ok, self._versions[at] if len(self._versions) else -1, -1))

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, versions) of every stored row updated since it was stored, by slot."""
        cand = np.flatnonzero(self._versions >= 0)
        ids = torch.from_numpy(self._ids[cand].copy())
        valid = self.store.slots(ids).numpy() == cand
        return ids[torch.from_numpy(valid)], torch.from_numpy(self._versions[cand[valid]].copy())

    def __len__(self) -> int:
        return len(self.items()[0])

    def __iter__(self) -> Iterator[int]:
        return iter(self.items()[0].tolist())

    def saved(self) -> dict[str, torch.Tensor]:
        """A checkpoint's form: ``ids`` and their ``versions``, sorted by id (tensors: a table of millions of rows
        is saved and loaded as two buffers, not as a dict of Python ints)."""
        ids, versions = self.items()
        order = torch.argsort(ids)
        return {"ids": ids[order], "versions": versions[order]}

    def restore(self, saved) -> None:
        """Take a checkpoint's map (``saved()``'s form, or the dict older checkpoints hold); ids whose rows the
        store does not hold are dropped (they start afresh)."""
        self._ids, self._versions = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        ids, versions = as_pairs(saved)
        versions = versions.numpy()
        slots = self.store.slots(ids)
        for version in np.unique(versions):
            at = torch.from_numpy(versions == version)
            self.set(ids[at], slots[at], int(version))


def as_pairs(saved) -> tuple[torch.Tensor, torch.Tensor]:
    """A saved map as (ids, versions) tensors: ``RowVersions.saved()``'s form, or an older checkpoint's dict."""
    if isinstance(saved, dict) and set(saved) == {"ids", "versions"} and isinstance(saved["ids"], torch.Tensor):
        return saved["ids"], saved["versions"]
    return torch.tensor(list(saved), dtype=torch.int64), torch.tensor(list(saved.values()), dtype=torch.int64)
