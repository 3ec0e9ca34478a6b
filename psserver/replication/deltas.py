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
from dataclasses import replace

from psserver.protocol.rows.table import RowStore
from psserver.state.checkpoint import ShardState

log = logging.getLogger(__name__)


def merge(base: ShardState, later: ShardState) -> ShardState:
    """``later`` (a shipment after ``base``) made whole: each table whose rows are only those touched since
    ``base`` takes ``base``'s other rows, and its per-row update versions likewise."""
    if not later.tables:
        return later
    tables = {}
    for name, table in later.tables.items():
        if "since" in table["rows"]:
            old = base.tables[name]
            versions = {**old["updated_at"], **table["updated_at"]}
            table = {**table, "rows": RowStore.merge_states(old["rows"], table["rows"]),
                     "updated_at": {i: v for i, v in versions.items() if v >= 0}}
        tables[name] = table
    return replace(later, tables=tables)


def whole(base: list[bytes], later: list[list[bytes]]) -> list[bytes]:
    """The whole states (one a partition) after shipments ``later`` over ``base``."""
    if not later:
        return base
    states = [ShardState.from_bytes(b) for b in base]
    for shipment in later:
        states = [merge(old, ShardState.from_bytes(new)) for old, new in zip(states, shipment)]
    return [s.to_bytes() for s in states]


class Holdings:
    """What a standby holds: a whole state (one payload a partition), its shipment number, and the shipments
    since it; folded into a new whole state off the caller's thread once they hold as many bytes as it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.base: list[bytes] = []
        self.later: list[list[bytes]] = []
        self.shipment = 0  # the newest shipment held (its number)
        self._folding = False
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
            fold = not self._folding and sum(map(len, (b for s in self.later for b in s))) >= sum(map(len, self.base))
            self._folding = self._folding or fold
        if fold:
            threading.Thread(target=self._fold, name="standby-fold", daemon=True).start()
        return True

    def _fold(self) -> None:
        with self._lock:
            base, later = self.base, list(self.later)
        try:
            merged = whole(base, later)
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
