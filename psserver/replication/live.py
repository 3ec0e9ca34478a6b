"""What a standby holds: its primary's state with every shipment applied as it came, on a thread of its own.

A shipment after the first carries of each table only the rows touched since the one before, and of the dense
slice the optimizer steps taken since (psserver.replication.deltas).  Here each table's rows sit in slots found
through an id index, so a shipment's rows are written over the rows they replace, or added, where they are: the
work is per shipment, never a pass over the whole state, and a promotion only lays the rows out by id once.
``deltas.whole`` merges the same shipments into the same state bit for bit (the reference the tests hold this to).
A shipment that does not apply leaves the state unusable until a whole one comes: the next shipment is refused as
building on nothing held, so the primary ships a whole state.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import replace

import torch

from psserver.protocol.rows.index import IdIndex
from psserver.protocol.rows.space import ROW_FIELDS
from psserver.replication.deltas import decoded, replay, row_meta, slice_of
from psserver.sparse.versions import as_pairs
from psserver.state.checkpoint import ShardState

log = logging.getLogger(__name__)


class LiveTable:
    """One table's rows as the shipments left them: in slots (unordered), an id index, each row's update version
    (-1: none, as ``RowVersions.saved`` leaves a row out)."""

    def __init__(self, rows: dict, updated):
        n = len(rows["ids"])
        self.fields = {name: rows[name] for name in ROW_FIELDS}
        self.used = n
        self.index = IdIndex()
        if n:
            self.index.insert(rows["ids"], torch.arange(n))
        self.versions = torch.full((n,), -1, dtype=torch.int64)
        self._set_versions(updated)

    def _set_versions(self, updated) -> None:
        ids, versions = as_pairs(updated)
        slots = self.index.find(ids)
        if bool((slots < 0).any()):
            raise ValueError("a shipment's update versions name rows its table does not hold")
        self.versions.index_copy_(0, slots, versions)

    def _grow(self, need: int) -> None:
        have = len(self.versions)
        if need <= have:
            return
        size = max(need, 2 * have)
        for name, field in self.fields.items():
            grown = torch.empty((size,) + tuple(field.shape[1:]), dtype=field.dtype)
            grown[: self.used] = field[: self.used]
            self.fields[name] = grown
        self.versions = torch.cat([self.versions, torch.full((size - have,), -1, dtype=torch.int64)])

    def apply(self, rows: dict, updated) -> None:
        """A shipment's rows (those touched since the one before): each written over its id's row, or added."""
        ids = rows["ids"]
        slots = self.index.find(ids)
        new = (slots < 0).nonzero().flatten()
        if len(new):
            self._grow(self.used + len(new))
            fresh = torch.arange(self.used, self.used + len(new))
            self.index.insert(ids.index_select(0, new), fresh)
            slots.index_copy_(0, new, fresh)
            self.used += len(new)
        for name in ROW_FIELDS:
            self.fields[name].index_copy_(0, slots, rows[name])
        self._set_versions(updated)

    def export(self) -> tuple[dict, dict]:
        """(the rows as ``RowStore.state`` lays them out, by id; the update versions as ``RowVersions.saved``)."""
        order = torch.argsort(self.fields["ids"][: self.used])
        rows = {name: self.fields[name][: self.used].index_select(0, order) for name in ROW_FIELDS}
        versions = self.versions[: self.used].index_select(0, order)
        kept = (versions >= 0).nonzero().flatten()
        return rows, {"ids": rows["ids"].index_select(0, kept), "versions": versions.index_select(0, kept)}


class LivePartition:
    """One partition's state: the newest shipment's own fields, its tables live, and its slice -- the last whole
    one shipped, with the steps shipped since replayed on it (DenseSlice.step, the primary's own, bit for bit)."""

    def __init__(self, state: ShardState):
        self.tables: dict[str, LiveTable | dict] = {}  # a whole table stays as shipped until a shipment builds on it
        self.dense_start, self.dense = state, None
        self.last = state
        self._take_tables(state)

    def apply(self, state: ShardState) -> None:
        """The next shipment, built on the one applied before.

        Raises:
            ValueError, KeyError: it does not build on the state held (the state is then unusable).
        """
        if state.dense_steps is None:
            self.dense_start, self.dense = state, None
        else:
            self._replay(state)
        self._take_tables(state)
        self.last = state

    def _replay(self, state: ShardState) -> None:
        if self.dense is None:
            self.dense = slice_of(self.dense_start)
        replay(self.dense, state)
        if self.dense.version != state.version:
            raise ValueError(f"replayed to version {self.dense.version}, the shipment is at {state.version}")

    def _take_tables(self, state: ShardState) -> None:
        for name, table in (state.tables or {}).items():
            if "since" not in table["rows"]:
                self.tables[name] = table
                continue
            live = self.tables[name]
            if isinstance(live, dict):
                live = self.tables[name] = LiveTable(live["rows"], live["updated_at"])
            live.apply(table["rows"], table["updated_at"])

    def export(self) -> ShardState:
        """The whole state, as ``deltas.whole`` makes it of the same shipments."""
        params, optimizer = (self.dense_start.params, self.dense_start.optimizer) if self.dense is None else \
            self.dense.capture()
        last = replace(self.last, params=params, optimizer=optimizer, dense_steps=None)
        if not last.tables:
            return last
        tables = {}
        for name, table in last.tables.items():
            if "since" in table["rows"]:
                rows, updated = self.tables[name].export()
                table = {**table, "rows": {**rows, **row_meta(table["rows"])}, "updated_at": updated}
            tables[name] = table
        return replace(last, tables=tables)


class Holdings:
    """A standby's shipments, taken at once (the acknowledgement waits for no work on them) and applied in order on
    a thread of its own; ``states`` waits for that thread to catch up and gives the whole states."""

    def __init__(self):
        self._cv = threading.Condition()
        self.shipment = 0  # the newest shipment taken (its number)
        self._queue: deque[tuple[int, bool, list]] = deque()  # (number, whole?, its states), not applied yet
        self._busy = False
        self._raw: list | None = None  # a whole state as shipped, while nothing was applied to it
        self._live: list[LivePartition] | None = None
        self._broken: str | None = None  # why the state held is unusable (until a whole state comes)
        self._closed = False
        self.applied = 0
        self._thread = threading.Thread(target=self._run, name="standby-apply", daemon=True)
        self._thread.start()

    def take_whole(self, states: list[bytes], shipment: int) -> None:
        with self._cv:
            self._queue.clear()  # (what was not applied yet is replaced)
            self._queue.append((shipment, True, list(states)))
            self.shipment, self._broken = shipment, None
            self._cv.notify_all()

    def take_since(self, states: list[bytes], shipment: int, base: int) -> bool:
        """A shipment built on shipment ``base``: taken if that is the newest taken and the state held is usable
        (else False: nothing changed, the primary ships a whole state next).  Shipments are numbered from 1, so
        before any whole state (shipment 0) none builds on what is held."""
        with self._cv:
            if base != self.shipment or self._broken is not None:
                return False
            self._queue.append((shipment, False, list(states)))
            self.shipment = shipment
            self._cv.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                number, is_whole, states = self._queue.popleft()
                if not is_whole and self._broken is not None:
                    continue  # (a whole state is due)
                self._busy = True
            raw, live, broken = None, None, None
            if is_whole:
                raw = states  # (taken unread: decoded when a shipment builds on it, or at a promotion)
            else:
                try:
                    live = self._live or [LivePartition(decoded(s)) for s in self._raw]
                    for part, state in zip(live, [decoded(s) for s in states], strict=True):
                        part.apply(state)
                except Exception as e:  # noqa: BLE001 -- said, and the state refused until a whole one comes
                    log.exception("standby: shipment %d did not apply to the state held; a whole state is due",
                                  number)
                    live, broken = None, f"shipment {number} did not apply: {e!r}"
            with self._cv:
                self._raw, self._live, self._broken, self._busy = raw, live, broken, False
                self.applied += 1
                self._cv.notify_all()

    def states(self) -> list:
        """The whole states now (once every shipment taken is applied).

        Raises:
            ValueError: a shipment did not apply, and no whole state came since.
        """
        with self._cv:
            self._cv.wait_for(lambda: not self._queue and not self._busy)
            raw, live, broken = self._raw, self._live, self._broken
        if broken is not None:
            raise ValueError(f"the standby holds no usable state: {broken}")
        return [p.export() for p in live] if live is not None else list(raw or [])

    def close(self) -> None:
        """Stop the applying thread (torch torn down at exit under one aborts the process)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
