"""Refusals of sparse-table calls: ValueErrors for pure callers, PsErrors for the servicer.

Each is both, so unit code can catch ValueError while the servicer maps it to its
gRPC status like every other refusal (INVALID_ARGUMENT; a count over a cap is
RESOURCE_EXHAUSTED, as for dense pushes).  Messages name the field and both values;
a refused call leaves the table unchanged.
"""

from __future__ import annotations

from psserver.protocol.errors import InvalidRequest, TooLarge


class SparseRefusal(InvalidRequest, ValueError):
    """Base: a sparse call that was refused and changed nothing."""


class BadIds(SparseRefusal):
    """ids is not a 1-D int64 tensor."""


class DuplicateIds(SparseRefusal):
    """A push names an id twice: its gradient rows must be summed on the trainer first."""


class WrongShape(SparseRefusal):
    """Gradient rows whose shape, width (dim) or dtype is not the table's."""


class NonFinite(SparseRefusal):
    """A gradient value is NaN or infinite."""


class IdOutOfRange(SparseRefusal):
    """An id outside 0..num_embeddings-1 of a bounded table."""


class BadTableState(SparseRefusal):
    """A saved table state that does not fit its spec (restore)."""


class TooManyIds(TooLarge, ValueError):
    """More ids in one call than the cap (or than the table may hold at once)."""


class TableFull(TooLarge, ValueError):
    """A call would add rows to a table past the row limit the shard's memory budget gave it (tables without
    max_rows; with max_rows the least recently used rows are evicted instead)."""
