"""A Step call's work on the shard's state in one trip to the state worker (issue 21 item 1).

Why a room of its own: a Step's table part used to cross to the state worker three times one after another (its
checks, its push, its pull), and each table on its own, so a step of the click model paid three thread hops a
shard and a 26-table model 78.  Here one function does, in order, what those hops did: every table part's checks
(nothing changes if one refuses), then the dense push (decided before any table pushes, as the envelope
promises: psserver.serving.step_parts), then each table's push and -- where the version its pull waits for is there
already (an async table, or a round this very push closed) -- its pull.  A pull whose version is not there yet
(a sync round still open for other trainers) is left to the servicer's wait, as PushPullRows waits.  Pure over
the shard and its tables: unit-tested with fakes, no network (tests/unit/test_step_trip.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from psserver.protocol.errors import StaleGradient
from psserver.protocol.rules import reply_version


@dataclass
class TablePart:
    """One table part of a Step, read and bounded on the loop; the trip fills in what became of it."""

    header: Any  # its RowsHeader: who, which table, the base version
    table: Any  # the ServedTable it names
    push: Any  # the RowsPush read from its chunks
    pull_ids: torch.Tensor | None  # the next batch's ids to answer with, or None
    pushed: Any = None  # the push's ids as the table checked them (CheckedIds; set before the trip: a named pull's)
    checked: Any = None  # the pull's ids as checked (CheckedIds), or None
    result: Any = None  # the push's RowsResult
    pulled: tuple[int, torch.Tensor] | None = None  # (version, rows) if pulled in the trip
    error: BaseException | None = None  # what the push or the pull raised (the call's status)
    waited: bool = False  # it may have waited for its round (one ahead): the headers after it are checked again

    @property
    def elements(self) -> int:
        """Row values the part moves: what decides whether its work may run on the loop."""
        pulls = 0 if self.pull_ids is None else len(self.pull_ids) * self.table.spec.dim
        return self.push.grads.numel() + pulls


def run_trip(shard, parts: list[TablePart], refuse_nonfinite: bool, dense: Callable[[], Any] | None = None,
             stopping: Callable[[], bool] = lambda: False):
    """Every part checked -- with a dense part, also for what its push would be refused for at its turn
    (``check_row_push_lands``) -- then ``dense()`` (the dense push: its return is returned; a refusal it raises
    is the call's, and no table has pushed), then each part's push and, if ready, its pull.  A part's push or
    pull that still fails is kept on the part (``error``) and the others go on, as parts run side by side did."""
    for p in parts:
        p.pushed, p.checked = p.table.check_step_part(p.push, refuse_nonfinite, p.pull_ids, p.pushed)
    if dense is not None:  # what a table push would be refused for once its turn came: refused before the dense
        for p in parts:    # push, so a refused Step changes nothing
            shard.check_row_push_lands(p.header.table, p.push)
    with shard.checkpoints_after_trip():  # (a checkpoint the dense push made due holds the tables' pushes too)
        out = dense() if dense is not None else None
        _push_tables(shard, parts, refuse_nonfinite, stopping)
    return out


def _push_tables(shard, parts: list[TablePart], refuse_nonfinite: bool, stopping: Callable[[], bool]) -> None:
    """Each part's push and, if ready, its pull; what fails is kept on the part."""
    for p in parts:
        h = p.header
        try:
            p.result = shard.push_rows(h.fingerprint, h.table, p.push, refuse_nonfinite, p.pushed)
        except StaleGradient as e:
            shard.count("row_pushes_stale")
            p.error = e
            continue
        except Exception as e:  # noqa: BLE001 -- the call's status, raised on the loop once the trip is back
            p.error = e
            continue
        if p.checked is None or stopping():
            continue
        want = reply_version(p.table.mode, p.result.outcome, h.version, p.result.version)
        if p.table.ready(want):
            try:
                p.pulled = shard.pull_rows(h.rank, h.trainer_id, h.fingerprint, h.table, p.checked)
            except Exception as e:  # noqa: BLE001 -- as above
                p.error = e
