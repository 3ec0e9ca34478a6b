"""A standby's state kept as a whole state and the shipments since: each a state whose tables carry only the
rows touched after the shipment before it (psserver.partition.host.ShardHost.capture_since).

Why: a table's rows are most of a recommendation model's state, and a round touches a few thousand of
millions, so a whole state a round grows with the table (the dense slice and its optimizer state change
every round: they travel whole).  The standby does not decode what it is shipped; it makes the whole state
(``whole``) when it is promoted, and folds shipments into its base on a thread of its own once they hold as
many bytes as it (``Holdings``): its work and memory stay proportional to what was shipped.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import torch

from psserver.protocol.rows.space import ROW_FIELDS
from psserver.protocol.rows.table import merge_states
from psserver.sparse.versions import as_pairs
from psserver.state.checkpoint import ShardState

log = logging.getLogger(__name__)


def merge(base: ShardState, later: ShardState) -> ShardState:
    """``later`` (a shipment after ``base``) made whole: each table whose rows are only those touched since
    ``base`` takes ``base``'s other rows, and its per-row update versions likewise."""
    return merge_all(base, [later])


def merge_all(base: ShardState, laters: list[ShardState]) -> ShardState:
    """The newest of ``laters`` (shipments after ``base``, in order) made whole in one pass a table: the rows of
    the shipments since the table's last whole one, each id's newest, merged once into what that whole one (or
    ``base``) held -- a fold's cost is one merge a table, not one a shipment."""
    last = laters[-1]
    if not last.tables:
        return last
    tables = {}
    for name, table in last.tables.items():
        if "since" in table["rows"]:
            run = [s.tables[name] for s in laters]
            whole_at = max((i for i, t in enumerate(run) if "since" not in t["rows"]), default=-1)
            old = run[whole_at] if whole_at >= 0 else base.tables[name]
            partials = run[whole_at + 1:]
            rows = _newest_rows([t["rows"] for t in partials])
            table = {**table, "rows": merge_states(old["rows"], {**table["rows"], **rows}),
                     "updated_at": _merge_versions(old["updated_at"],
                                                   _newest_versions([t["updated_at"] for t in partials]))}
        tables[name] = table
    return replace(last, tables=tables)


def _newest(ids: list[torch.Tensor]) -> torch.Tensor | None:
    """Where each id's last occurrence is in ``ids`` concatenated, in id order (None: only one part)."""
    if len(ids) == 1:
        return None
    every = torch.cat(ids)
    order = torch.argsort(every, stable=True)  # (equal ids keep their shipment order: the last is the newest)
    ordered = every[order]
    last = torch.ones(len(ordered), dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    return order[last]


def _newest_rows(parts: list[dict]) -> dict:
    """The per-row tensors of several shipments' rows of a table, each id's newest, sorted by id."""
    at = _newest([p["ids"] for p in parts])
    if at is None:
        return {name: parts[0][name] for name in ROW_FIELDS}
    return {name: torch.cat([p[name] for p in parts])[at] for name in ROW_FIELDS}


def _newest_versions(parts: list) -> dict:
    """Several shipments' update versions of a table (their rows only), each id's newest."""
    pairs = [as_pairs(p) for p in parts]
    at = _newest([ids for ids, _ in pairs])
    if at is None:
        return {"ids": pairs[0][0], "versions": pairs[0][1]}
    return {"ids": torch.cat([i for i, _ in pairs])[at], "versions": torch.cat([v for _, v in pairs])[at]}


def _merge_versions(old, new) -> dict:
    """A table's update versions (RowVersions.saved) after ``new``'s rows, each replaced or added (-1: a row
    never updated, left out as saved() leaves it out)."""
    (old_ids, old_versions), (ids, versions) = as_pairs(old), as_pairs(new)
    gone = torch.isin(old_ids, ids)
    ids, versions = torch.cat([old_ids[~gone], ids]), torch.cat([old_versions[~gone], versions])
    keep = versions >= 0
    ids, versions = ids[keep], versions[keep]
    order = torch.argsort(ids)
    return {"ids": ids[order], "versions": versions[order]}


def whole(base: list[bytes], later: list[list[bytes]]) -> list[bytes]:
    """The whole states (one a partition) after shipments ``later`` over ``base``."""
    if not later:
        return base
    states = [ShardState.from_bytes(b, shipment=True) for b in base]
    states = [merge_all(old, [ShardState.from_bytes(shipment[i], shipment=True) for shipment in later])
              for i, old in enumerate(states)]
    return [s.to_bytes(shipment=True) for s in states]


class Holdings:
    """What a standby holds: a whole state (one payload a partition), its shipment number, and the shipments
    since it; folded into a new whole state off the caller's thread once they hold as many bytes as it."""

    def __init__(self, fold_share: float = 1.0):
        """``fold_share``: shipments are folded once their bytes reach this share of the whole state's."""
        self.fold_share = fold_share
        self._lock = threading.Lock()
        self.base: list[bytes] = []
        self.later: list[list[bytes]] = []
        self.shipment = 0  # the newest shipment held (its number)
        self._folding = False
        self._thread: threading.Thread | None = None
        self.folds = 0

    def take_whole(self, states: list[bytes], shipment: int) -> None:
        with self._lock:
            self.base, self.later, self.shipment = list(states), [], shipment

    def take_since(self, states: list[bytes], shipment: int, base: int) -> bool:
        """A shipment built on shipment ``base``: taken if that is the one held now (else False: nothing
        changed, the primary ships a whole state next)."""
        with self._lock:
            if base != self.shipment or not self.base:
                return False
            self.later.append(list(states))
            self.shipment = shipment
            fold = not self._folding and \
                sum(map(len, (b for s in self.later for b in s))) >= self.fold_share * sum(map(len, self.base))
            self._folding = self._folding or fold
        if fold:
            self._thread = threading.Thread(target=self._fold, name="standby-fold", daemon=True)
            self._thread.start()
        return True

    def close(self) -> None:
        """Wait for a fold under way: torch torn down at exit under one aborts the process."""
        if self._thread is not None:
            self._thread.join()

    def _fold(self) -> None:
        with self._lock:
            base, later = self.base, list(self.later)
        try:
            started = time.monotonic()
            merged = whole(base, later)
            log.info("standby: folded %d shipments into the state held (%d bytes) in %.3f s", len(later),
                     sum(map(len, merged)), time.monotonic() - started)
        except Exception:  # noqa: BLE001 -- kept as they are: promotion folds them again, and says why if it fails
            log.exception("standby: folding %d shipments into the state held failed", len(later))
            merged = None
        with self._lock:
            if merged is not None and self.base is base and all(a is b for a, b in zip(self.later, later)):
                self.base, self.later = merged, self.later[len(later):]
                self.folds += 1
            self._folding = False

    def states(self) -> list[bytes]:
        """The whole states now (folds what is held: at promotion)."""
        with self._lock:
            base, later = self.base, list(self.later)
        return whole(base, later)
