"""The tables' part of a step: each shard-backed table's gradient rows, pushed while the dense exchange runs.

Once the loop prefetches rows (``side_by_side``, set by ``push_beside()`` from ``ps.prefetch``), ``start``
pushes on a thread of its own while step() runs the dense exchange, so a step's table calls and its dense calls to a shard are in flight
together (one round trip's wait instead of two); a restarted shard that both find is rejoined once
(trainer.membership.session's per-slot rejoin lock).  Without prefetch, what a step's one Step call a shard
(trainer.stepping.step_call) leaves to do goes tables first: a shard's checkpoint
taken at a dense version then holds every table pushed in that step (as a Step call's does: the shard takes it
after the call's table pushes), which two calls side by side may not (the table one version behind; each
restores and is resynced at its own version).  Once per step: a table whose push failed keeps its rows (the error propagates out of step()); the retry pushes
the tables not yet done, and of those only to the shards that did not finish (ShardedRows keeps that).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import grpc

from trainer.stepping.attempt import rows_moved

log = logging.getLogger(__name__)


class TablePush:
    def __init__(self, tables: list, counter, rank_of: Callable[[], int] = lambda: 0):
        """``counter``: what counts failures and abandons (the sharded client's ``count``); ``rank_of``: this
        trainer's rank for the log (the session's, which a join hands out)."""
        self.tables, self._counter, self._rank_of = tables, counter, rank_of
        self._pushed: set[str] = set()  # tables whose push of the current step is done
        self.side_by_side = False
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ps-tables") if tables else None

    def start(self, num_samples: int) -> Future | None:
        """``push`` on the tables' thread (None when there is nothing to push); ``Future.result()`` raises
        what ``push`` would."""
        if self._thread is None or all(t.name in self._pushed for t in self.tables):
            return None
        return self._thread.submit(self.push, num_samples)

    def push_beside(self) -> None:
        """From the next step on, push on the tables' thread beside the dense exchange (rows are prefetched)."""
        self.side_by_side = True

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def push(self, num_samples: int) -> None:
        for t in self.tables:
            if t.name in self._pushed:
                continue
            try:
                t.flush_gradients(num_samples)
            except grpc.RpcError as e:
                if rows_moved(e) is None:  # (refused layout-moved everywhere: re-sent in the new layout, trainer.stepping.step)
                    self._counter.count("table_pushes_failed")
                    log.warning("rank %d: the push of table %r failed (%s); step() again retries it",
                                self._rank_of(), t.name, e)
                raise
            self._pushed.add(t.name)

    def mark_pushed(self, name: str) -> None:
        """Table ``name``'s push of this step was made elsewhere (trainer.stepping.step_call's one call a shard)."""
        self._pushed.add(name)

    def any_pushed(self) -> bool:
        """Some table's push of this step is done (a retry of a step whose other parts failed)."""
        return bool(self._pushed)

    def done(self) -> None:
        """The step's dense part is done too: the next push is the next step's."""
        self._pushed.clear()

    def pending(self) -> bool:
        """A table's failed push waits to be retried (a windowed one too: trainer.tables.table_window)."""
        return any(t.push_pending or _window_failed(t) for t in self.tables)

    def flush(self) -> None:
        """Wait for the tables' pushes still in flight (an async push window's: trainer.tables.table_window)."""
        for backend in {id(t.backend): t.backend for t in self.tables}.values():
            flush = getattr(backend, "flush", None)
            if flush is not None:
                flush()

    def abandon(self) -> None:
        """The shards that did not answer a table's push: new numbers there too (ShardedRows.abandon; a local
        backend keeps no failed push)."""
        for t in self.tables:
            abandon = getattr(t.backend, "abandon", None)
            if (t.push_pending or _window_failed(t)) and abandon is not None and abandon(t.name):
                self._counter.count("table_pushes_abandoned")
            dropped = getattr(t.backend, "step_dropped", None)
            if t.name not in self._pushed and dropped is not None:
                dropped(t.name)  # the rows prefetched for the next step (trainer.tables.row_prefetch) move on

    def zero(self) -> None:
        """Forget the tables' rows and gradients of this step (and any failed push of them)."""
        for t in self.tables:
            t.zero_grad_rows()
        self._pushed.clear()


def _window_failed(t) -> bool:
    """``t``'s windowed push failed and waits (ShardedRows.window_failed; a local backend has no window)."""
    failed = getattr(t.backend, "window_failed", None)
    return failed is not None and failed(t.name)
