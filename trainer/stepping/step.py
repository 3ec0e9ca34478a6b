"""How one step runs, whichever exchange variant the trainer was built with, and what a failed step refuses.

The variants: one Step call a shard carrying the dense slice and every table (trainer.stepping.step_call), with or
without prefetched rows; what it leaves to do goes plain (the tables pushed, then the dense exchange) or, once
rows are prefetched, beside (the tables on their own thread while the dense exchange runs,
trainer.stepping.table_push); pipelined (the dense exchange behind the next forward, trainer.stepping.pipelined) and
windowed (async pushes acknowledged later, trainer.stepping.windowed).  A step is all or nothing from the caller's
view: while a failed one waits, anything that would change its gradient is refused until ``step()`` retries it
or ``abandon()`` drops it.  trainer.stepping.api's facade delegates here.
"""

from __future__ import annotations

import logging

import grpc

from trainer.stepping.attempt import StepMoved, StepPastLost, rows_moved
from trainer.stepping.lost_slots import answer_lost, ask_lost
from trainer.stepping.early_push import EarlyPusher
from trainer.stepping.exchange import DenseExchange
from trainer.stepping.overlap import Prefetcher
from trainer.stepping.pipelined import PipelinedExchange
from trainer.membership.relayout import Relayout
from trainer.membership.session import Session
from trainer.membership.slots import FlatModel
from trainer.stepping.step_call import StepCall
from trainer.stepping.stepper import StepInfo
from trainer.stepping.table_push import TablePush
from trainer.stepping.windowed import WindowedExchange

log = logging.getLogger(__name__)


class StepRunner:
    """Runs steps over the exchange variant it is handed (None: that variant is off)."""

    def __init__(self, exchange: DenseExchange, table_push: TablePush, session: Session, flat: FlatModel,
                 count, windowed: WindowedExchange | None = None, pipelined: PipelinedExchange | None = None,
                 early: EarlyPusher | None = None, prefetch: Prefetcher | None = None,
                 step_call: StepCall | None = None, relayout: Relayout | None = None):
        """``count``: what counts abandoned steps (the sharded client's ``count``); ``step_call``: the beside
        variant's one call a shard (trainer.stepping.step_call), tried first."""
        self.exchange, self.table_push, self.session, self.flat, self._count = (exchange, table_push, session,
                                                                                 flat, count)
        self.windowed, self.pipelined, self.early, self.prefetch = windowed, pipelined, early, prefetch
        self.step_call, self.relayout = step_call, relayout
        exchange.answers_lost = relayout is not None  # a lost slot's new owners answer for it (trainer.stepping.lost_slots)
        self._dense_done: StepInfo | None = None  # this step's dense part, done while a table push failed

    @property
    def steps(self) -> int:
        """Dense steps completed (windowed: handed to the window)."""
        return self.windowed.steps if self.windowed is not None else self.exchange.steps

    def prepare(self, num_samples: int) -> None:
        self.no_pending_step("prepare_step()")
        if self.early is not None:
            self.early.prepare(num_samples)

    def step(self, num_samples: int) -> StepInfo:
        if self.pipelined is not None:
            return self.pipelined.step(num_samples, self.table_push)
        return self._step_one_call_first(
            num_samples, self._beside_two_calls if self.table_push.side_by_side else self._tables_then_dense)

    def _one_call(self, num_samples: int) -> StepInfo | None:
        """The step as one Step call a shard (trainer.stepping.step_call) where it can go so: its info once every
        part is done, else None -- the dense part's info kept in ``_dense_done`` when only a table is left, a
        step every shard refused layout-moved re-routed (``_moved``)."""
        if self.step_call is None or self._dense_done is not None or not self.step_call.usable(
                self.windowed is None and self.pipelined is None):
            return None
        self._dense_done = self.step_call.step(num_samples)  # None: dense parts left to do
        if self._dense_done is None and self.step_call.moved is not None and self.relayout is not None:
            self._moved(self.step_call.moved, self.exchange.slots.num_parts, sorted(self._rows_kept()))
        elif self._dense_done is not None and not self.table_push.pending():
            info, self._dense_done = self._dense_done, None
            self.table_push.done()
            return info
        return None

    def _tables_first(self, num_samples: int) -> None:
        """The tables' pushes, before the dense exchange.  A step whose base reaches a later layout's round goes
        in that layout, its tables too (trainer.membership.relayout): switched to before the first push when a reply
        named it (``_step_one_call_first``), else once every shard refused a table's push layout-moved (nothing
        applied: sent again whole)."""
        if self.relayout is None or not self.table_push.tables:
            self.table_push.push(num_samples)
            return
        base = min(self.exchange.slots.versions)
        try:
            self.table_push.push(num_samples)
        except grpc.RpcError as e:
            newest = rows_moved(e)
            if newest is None:
                raise
            self.relayout.reroute_tables(newest, base, e.table, len(e.failed))
            self.table_push.push(num_samples)

    def _dense_step(self, num_samples: int, reroute: bool = True) -> StepInfo:
        """The dense exchange: through the async push window (trainer.stepping.windowed) when there is one.  A step whose
        base reaches a later layout's round goes in that layout (trainer.membership.relayout): switched to before the
        exchange when a reply named it, else once the old layout refused the step layout-moved (``reroute``
        False: StepMoved is raised, for a caller whose tables are pushed beside it to re-route both).  A step of
        base R-1 some slots applied while the rest were lost is answered by their new owners (trainer.stepping.lost_slots)."""
        if self.windowed is not None:
            return self.windowed.step(num_samples)
        if self.relayout is None:  # (then no StepPastLost either: the exchange's answers_lost is off)
            return self.exchange.dense_step(num_samples)
        if self.exchange.attempt is not None and self.exchange.attempt.lost:  # questions left (trainer.stepping.lost_slots)
            return ask_lost(self.relayout, self.exchange)
        base = min(self.exchange.slots.versions)
        if self.exchange.attempt is None:  # (a retried step is switched only once its layout refuses it)
            self.relayout.switch_if_due(base)
        try:
            return self.exchange.dense_step(num_samples)
        except StepPastLost as lost:  # the lost slots' new owners answer for them (trainer.stepping.lost_slots)
            info = answer_lost(self.relayout, self.exchange, lost, base) if reroute else None
            if info is None:
                self._count("steps_failed")
                log.warning("rank %d: %s", self.session.rank, lost)
                raise
            return info
        except StepMoved as moved:
            if not reroute:
                raise
            if not self.relayout.reroute(moved.newest, base, len(moved.failed), unreachable=moved.unreachable):
                self._count("steps_failed")  # base below R: the unreachable slots may hold it (retry the step)
                log.warning("rank %d: %s", self.session.rank, moved)
                raise
            self.exchange.rerouted()
            return self.exchange.dense_step(num_samples)

    def _step_one_call_first(self, num_samples: int, two_calls) -> StepInfo:
        """step() as one Step call a shard where it can go so; what that leaves to do goes ``two_calls``: the
        tables on their own thread beside the dense exchange once rows are prefetched (trainer.stepping.table_push),
        else tables first, then the dense exchange.  A restart both find is rejoined once
        (trainer.membership.session).  A later layout is followed first when a reply named it; a step every shard
        refused layout-moved is re-routed whole (``_moved``)."""
        self.session.step_begins()
        try:
            fresh = self._dense_done is None and self.exchange.attempt is None and not self.table_push.pending() \
                and not self.table_push.any_pushed()
            if self.relayout is not None and fresh:  # (a retry stays in its layout)
                self.relayout.switch_if_due(min(self.exchange.slots.versions))
            info = self._one_call(num_samples)
            if info is not None:
                return info
            two_calls(num_samples)
        finally:
            self.session.step_ends()
        info, self._dense_done = self._dense_done, None
        self.table_push.done()
        return info

    def _tables_then_dense(self, num_samples: int) -> None:
        """The two-call way without prefetch: the tables still to push, then the dense part if not done."""
        self._tables_first(num_samples)
        if self._dense_done is None:
            self._dense_done = self._dense_step(num_samples)

    def _beside_two_calls(self, num_samples: int) -> None:
        """The tables on their thread beside the dense exchange; once both settled, a step refused layout-moved
        (its dense slots, a table's every shard, or both) is re-routed whole and its refused parts sent again."""
        tables = self.table_push.start(num_samples)
        dense_moved = None
        try:
            if self._dense_done is None:  # (a retry after only a table push failed: the dense part is done)
                try:
                    self._dense_done = self._dense_step(num_samples, reroute=False)
                except StepMoved as e:
                    dense_moved = e
        finally:
            table_moved = _moved_table(tables)  # a table push's other failure is raised first, as before
        if dense_moved is None and table_moved is None:
            return
        newest = max(m.newest for m in (dense_moved, table_moved) if m is not None)
        if not self._moved(newest, len(dense_moved.failed) if dense_moved else 0,
                           [table_moved.table] if table_moved else [], len(table_moved.failed) if table_moved else 0,
                           unreachable=dense_moved.unreachable if dense_moved else 0):
            self._count("steps_failed")  # base below R: the unreachable slots may hold it (retry the step)
            log.warning("rank %d: %s", self.session.rank, dense_moved)
            raise dense_moved
        self.table_push.push(num_samples)
        if self._dense_done is None:
            self._dense_done = self._dense_step(num_samples)

    def _moved(self, newest: int, dense_refused: int, tables: list[str], rows_refused: int | None = None,
               unreachable: int = 0) -> bool:
        """Every part of this step still to do was refused layout-moved (or, ``unreachable`` dense slots, could not
        be reached), none applied: nothing else in flight, take them back and switch (trainer.membership.relayout.reroute);
        the dense part then goes on a fresh attempt.  False: not re-routed (nothing changed; Relayout.reroute)."""
        rows = rows_refused if rows_refused is not None else len(tables) * len(self.exchange.client.shards)
        if not self.relayout.reroute(newest, min(self.exchange.slots.versions), dense_refused, tables, rows,
                                     unreachable=unreachable):
            return False
        if dense_refused:
            self.exchange.rerouted()
        return True

    def _rows_kept(self) -> set[str]:
        """The tables whose push is kept for a retry (every one a refused Step call carried)."""
        rows = self.relayout.rows() if self.relayout is not None else None
        return set(rows.book.pending) if rows is not None else set()

    def join_exchange(self) -> StepInfo | None:
        """A pipelined exchange's result, once it ended; its failure raised here as StepFailed."""
        return self.pipelined.join() if self.pipelined is not None else None

    def no_pending_step(self, what: str) -> None:
        """A failed step's gradient is waiting to be retried: anything that changes it first is refused
        (a retry would push the changed gradient under the old sequence numbers).  A pipelined exchange still
        running is not a failed step."""
        if self.pipelined is not None and self.pipelined.under_way():
            return
        self.join_exchange()  # one that ended: a failure is raised here, as StepFailed
        if self.exchange.attempt is not None or self.table_push.pending() or (
                self.windowed is not None and self.windowed.pending()):
            raise RuntimeError(f"{what} while a failed step waits: call step() to retry it (same gradient, "
                               f"same sequence numbers) or abandon_step() to drop it")

    def abandon(self) -> None:
        """Drop a failed step (counted in ``steps_abandoned``); the gradients are zeroed."""
        try:
            self.join_exchange()  # pipelined: wait for it; only a failed one has anything to drop
        except grpc.RpcError:
            pass
        if self.windowed is not None and self.windowed.pending():
            log.warning("rank %d abandoned failed windowed pushes %s", self.session.rank, self.windowed.abandon())
        if self.exchange.attempt is None and not self.table_push.pending():
            return
        todo = self.exchange.abandon()
        self.table_push.abandon()
        self._dense_done = None
        log.warning("rank %d abandoned a failed step on shards %s", self.session.rank, todo)
        if self.pipelined is not None:
            self.pipelined.abandoned()
        self._count("steps_abandoned")
        self.flat.zero_grad()
        self.table_push.zero()

    def take_forward_wait(self) -> float:
        return self.pipelined.take_forward_wait() if self.pipelined is not None else 0.0

    def flush(self) -> None:
        """Every weight in flight in the model; a pipelined exchange's failure is raised here as StepFailed."""
        self.join_exchange()
        self.table_push.flush()  # async tables' pushes in flight (trainer.tables.table_window)
        if self.windowed is not None:  # every push in flight acknowledged, the newest weights in the model
            self.windowed.flush()
        if self.prefetch is not None:
            self.prefetch.collect_all()

    def zero_grad(self) -> None:
        self.join_exchange()
        self.no_pending_step("zero_grad()")
        self.flat.zero_grad()
        self.table_push.zero()

    def close(self) -> None:
        """The variants' threads (after the channels closed: calls still in flight are cancelled)."""
        self.table_push.close()
        for part in (self.prefetch, self.pipelined, self.early, self.windowed):
            if part is not None:
                part.close()


def _moved_table(tables) -> grpc.RpcError | None:
    """The tables' push (a Future, or None) once settled: its error when every shard refused it layout-moved
    (trainer.stepping.attempt.rows_moved, re-routed by the caller), None when it went through; any other error raised."""
    if tables is None:
        return None
    try:
        tables.result()
    except grpc.RpcError as e:
        if rows_moved(e) is None:
            raise
        e.newest = rows_moved(e)
        return e
    return None
