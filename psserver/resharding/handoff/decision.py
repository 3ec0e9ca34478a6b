"""How a live re-shard's plan ends on a shard (docs/design/handoff-io.md): DECIDE installs the new layout from R
(LayoutHost.install), drains this shard from it (LayoutHost.drain) or lets the old one go on, and RETIRE frees the
tombstones.  Apart from HandoffIO, which prepares the plan and runs its moves, because the end has its own state:
switched or aborted, a DECIDE under way, the partitions whose held replies wait for the install."""

from __future__ import annotations

import dataclasses

from psserver.protocol.errors import NotReady
from psserver.protocol.layouts import first_layout, next_layout
from psserver.resharding.handoff import machine as h
from psserver.resharding.handoff import shard_async as async_
from psserver.resharding.handoff.dest import DestState
from psserver.resharding.handoff.shard_rows import with_table_rounds


class HandoffDecision:
    """DECIDE and RETIRE of the plan ``io`` holds (psserver.resharding.handoff.shard_ops.HandoffIO; not imported: it
    imports this room), and how the plan ended: ``switched``, ``aborted`` (a new plan may start after either)."""

    def __init__(self, io):
        self.io = io
        self.switched = self.aborted = False  # how the plan held ended (a new plan may start after either)
        self.deciding = False  # a DECIDE under way (its aborts are not abort_here's)
        self.release_after_install: set = set()  # partitions whose held replies go out once DECIDE installed

    def reset(self) -> None:
        """A new plan: neither switched nor aborted."""
        self.switched, self.aborted = False, False

    def settled(self) -> bool:
        """The plan held is over: switched, or aborted everywhere on this shard (a new plan may start)."""
        return self.switched or self.aborted

    def decide(self, request) -> None:
        with self.io.lock:
            self.deciding = True
            try:
                self._decide_locked(request)
            finally:
                self.deciding = False

    def _decide_locked(self, request) -> None:
        now, decide = self.io.clock(), h.Decide(request.switch)
        for m in [*self.io.sources, *self.io.dests.values()]:  # checked everywhere first: a refusal changes nothing
            m.machine.on(decide, now)
        switch = request.switch and not self.switched
        R = async_.new_round(self.io, request.round) if switch and self._async() else None  # (sync: None)
        drain = self._drained_layout(R) if switch and self.io.plan.new_index is None else None
        new = self._new_layout(R) if switch and drain is None else None
        if not request.switch:  # before the replies go out: the push of base R that follows is taken
            self.io.layouts.handoff_round = None
        for s in self.io.sources:
            self.io.event(s, decide)
        for d in self.io.dests.values():
            d.carry(d.machine_on(decide))
        if new is not None:
            self.io.layouts.install(*new, stops_below=R is not None)
            self.io.moved.keep(new[0].number, new[0].round, {k: d.books_by_slot() for k, d in self.io.dests.items()})
            self.switched = True
        elif drain is not None:
            self.io.layouts.drain(drain, self.io.plan.you, stops_below=R is not None)
            self.switched = True
        if R is not None and self.switched:
            async_.switched(self.io, self.io.layouts.timeline()[-1])
        elif not request.switch:
            async_.aborted(self.io)
        self.io.layouts.handoff_round = None
        for part in self.release_after_install:  # after the install: the replies name the new layout
            self.io.runtime.holds.release(part)
        self.release_after_install.clear()
        self.io.rows.end()
        self.aborted = self.aborted or not request.switch

    def retire(self, request) -> None:
        """Every move RETIRED, then the tombstones freed (the old layouts' state; the copies and replays the
        hand-off kept): LayoutHost.retire.  Checked on every move first: a refusal changes nothing."""
        with self.io.lock:
            now = self.io.clock()
            for s in self.io.sources:
                s.machine.on(h.Retire(None), now)
            if not self.switched:
                raise NotReady(f"retire reached plan {self.io.plan.id!r} but this shard has not switched "
                               f"(aborted: {self.aborted}): RETIRE follows DECIDE switch")
            for s in self.io.sources:
                self.io.event(s, h.Retire(None))
                s.copy = None
                s.log.restart(s.log.start)
            for d in self.io.dests.values():
                d.replays.clear()
            self.io.layouts.retire()

    def _async(self) -> bool:
        job = self.io.layouts.current.head.job
        return async_.is_async(job if job is not None else next((d.job for d in self.io.dests.values()), None))

    def _drained_layout(self, async_round: int | None = None):
        """DECIDE switch on a shard left out of ``--to``: the next layout from R (no piece of it here); NotReady,
        changing nothing, unless the old layout is at R with no round open (async: at its stops, ``async_round``)."""
        plan, job = self.io.plan, self.io.layouts.current.head.job
        R = max((s.machine.round or 0 for s in self.io.sources), default=0) if async_round is None else async_round
        job2 = plan.layouts(job)[2]
        layout = with_table_rounds(next_layout(self.io.layouts.timeline(), job2, R, plan.new), job2)
        try:
            self.io.layouts.check_boundary(layout, stops_below=async_round is not None)
        except ValueError as e:
            raise NotReady(f"decide is switch but {e}: the old layout must stop at R (docs/design/handoff-io.md)") from None
        return layout

    def _new_layout(self, async_round: int | None = None) -> tuple:
        """DECIDE switch: (the next layout from R, its host made from the new pieces, epoch 0); NotReady, changing
        nothing, unless every new piece is READY and the old layout is at R with no round open.  ``async_round``:
        an async job's R, which every new piece starts at (psserver.resharding.handoff.shard_async)."""
        plan, dests = self.io.plan, self.io.dests
        job = next(iter(dests.values())).job if dests else None
        if job is None or len(dests) != plan.layouts(job)[2].partitions or any(
                d.machine.state is not DestState.READY for d in dests.values()):
            raise NotReady(f"decide is switch but this shard's new pieces are "
                           f"{[d.machine.state.value for d in dests.values()]}, not every one ready")
        _, _, job2 = plan.layouts(job)
        states = [dests[k].state(plan.new_index, job2, async_round) for k in range(job2.partitions)]
        R = states[0].version
        states[0] = dataclasses.replace(states[0], tables=self.io.rows.tables_state(job, len(plan.old), R))
        timeline = self.io.layouts.timeline() if self.io.layouts.current.head.job is not None or self.io.layouts.newest \
            else [first_layout(job)]
        layout = with_table_rounds(next_layout(timeline, job2, R, plan.new), job2)
        try:
            self.io.layouts.check_boundary(layout, stops_below=async_round is not None)
        except ValueError as e:
            raise NotReady(f"decide is switch but {e}: the old layout must stop at R (docs/design/handoff-io.md)") from None
        host = self.io.layouts.current.successor(plan.new_index)
        host.restore_states(states, f"layout {layout.number} (hand-off {plan.id})", planned=True)
        return layout, host, timeline[0]
