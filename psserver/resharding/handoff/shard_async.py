"""A live re-shard of an async or stale-timeout job (stage 8 of docs/design/live-reshard.md): what differs from a sync one.

**stale-timeout** has rounds, so it moves as sync does; one exception: under ``--stale-policy scale`` a stale push
would be scaled into round R on the old layout (opening a round there that never closes: acknowledged, never
applied).  From COMMIT, once a source is at R, a stale push is dropped instead (``stale_gate``: the stale refusal,
counted ``stale_dropped_handoff``); the tombstone keeps the gate.

An async job has no rounds: each push is applied at once with its own step and bumps its partition's version, and
each partition's version is its own.  So instead of a round R every shard agrees on:

* **The stop.** COMMIT stops each source partition at the version it is at then, V (``commit``): from there a new
  push to it is not applied but refused ``handoff`` (UNAVAILABLE; the trainer sends it again under the same number
  within its retry budget), counted ``handoff_async_pushes_held``.  A retry of a push acknowledged before the stop is
  still DUPLICATE (the gate runs after the book).  Each applied push before V was a forward (its gradient and lr,
  psserver.state.dense_hooks), so the destination replays the range to V and the vote compares digests at V.
* **The new layout's version.** DECIDE names R = the largest V of every source (the coordinator reads them from the
  replies' ``round``).  Every new piece starts at version R, so the new layout's shards agree on one version, and a
  push re-sent there with its old base b is measured ``R - b`` stale: never less than on its old shard (``V - b``),
  so ``--max-staleness`` still bounds what is applied; a push may count staler by the spread of the sources' V.
* **After the switch** a push in the old layout is DUPLICATE if that partition acknowledged it, else ``layout-moved``
  naming the new layout (``moved``): nothing was applied, and the trainer sends it whole there under a new number
  (its new slots number on above every old one).  A push in the newest layout is routed whatever its base
  (psserver.resharding.layout_host).  On an abort the gate goes and the held pushes are applied when sent again.

Scope: dense, optimizer ``sgd`` (with or without momentum: element-wise state only; Adam's step count would differ
between sources at different V), no tables, no data cursor in use.  stale-timeout is still refused.
"""

from __future__ import annotations

import logging

from psserver.protocol.errors import HandoffPending, JobMismatch, LayoutMoved, NotReady
from psserver.protocol.job import JobSpec
from psserver.protocol.layouts import LayoutEpoch
from psserver.protocol.rules import Mode

log = logging.getLogger(__name__)


def is_async(job: JobSpec | None) -> bool:
    return job is not None and job.mode == Mode.ASYNC


def check_job(job: JobSpec, cursor_claims: int = 0) -> None:
    """PREPARE's refusals of a job that is not sync (FAILED_PRECONDITION, nothing changed): stale-timeout, and an
    async job this stage cannot move (an optimizer with a step count, a data cursor in use)."""
    if job.mode not in (Mode.SYNC, Mode.ASYNC, Mode.STALE_TIMEOUT):  # (a mode a later version adds)
        raise JobMismatch(f"mode is {job.mode} but a live re-shard takes mode sync, async or stale-timeout")
    if job.mode != Mode.ASYNC:
        return
    if job.optimizer.name != "sgd":
        raise JobMismatch(f"optimizer is {job.optimizer.name} but a live re-shard of an async job takes optimizer "
                          "sgd (its sources stop at different versions, so a step count would differ between them)")
    if cursor_claims:
        raise JobMismatch(f"data cursor claims is {cursor_claims} but a live re-shard of an async job takes claims 0 "
                          "(the cursor does not move yet): re-shard a job that does not claim batches")


def commit(io, sides: list) -> None:
    """COMMIT on an async job (on the state worker, so no push slips between the read and the stop): every source
    stops at its partition's version now; checked on every move first, so a refusal changes nothing."""
    from psserver.resharding.handoff import machine as h  # (the io room imports this one)
    now = io.clock()
    for s in sides:
        s.machine.on(h.Commit(s.part.version, stop_now=True), now)
    for s in sides:
        io.event(s, h.Commit(s.part.version, stop_now=True))
        s.part.push_gate = held_gate(s.machine.label)


def held_gate(label: str):
    """Between COMMIT and DECIDE (and while a move throttles): a push that would step past the hold is refused
    ``handoff``, counted and logged once per partition and version."""
    logged: set[int] = set()

    def gate(part, base: int) -> Exception | None:
        held = part.enrolment.handoff_held_from
        if held is None or part.version < held:
            return None
        part.count("handoff_async_pushes_held")
        if part.version not in logged:
            logged.add(part.version)
            log.warning("%s: an async push held at version %d (a live re-shard's stop): refused handoff, sent "
                        "again by the trainer until DECIDE", label, part.version)
        return HandoffPending(f"version is {part.version} but {label} stopped applying pushes at version {held} for a "
                              "live re-shard of this async job: send it again (taken after an abort, refused "
                              "layout-moved after the switch)")
    return gate


def moved_gate(layout: LayoutEpoch):
    """After the switch, on the old layout's pieces (the tombstone): every new push is ``layout-moved``."""
    def gate(part, base: int) -> Exception | None:
        part.count("refused_layout_moved")
        shards = f" (its shards: {', '.join(layout.addresses)})" if layout.addresses else ""
        return LayoutMoved(f"layout_epoch is {layout.number - 1} but this async job moved to layout {layout.number} "
                           f"(from version {layout.round}) and this piece stopped at version {part.version}: send "
                           f"the push in layout {layout.number}{shards}", layout.number)
    return gate


def scales_stale(job: JobSpec | None) -> bool:
    return job is not None and job.mode == Mode.STALE_TIMEOUT and job.stale_policy == "scale"


def stale_gate(R: int, label: str):
    """stale-timeout with ``--stale-policy scale``, from COMMIT R on: a stale push reaching a source at R (or its
    tombstone) is dropped, not scaled into round R of the old layout (which never closes); counted and logged."""
    def gate(part, base: int) -> Exception | None:
        if part.version < R or base >= part.version:
            return None  # a round below R (closes in the old layout and is forwarded), or a fresh push
        part.count("stale_dropped_handoff")
        part.count("stale_dropped")
        log.warning("%s: a stale push of base %d at version %d dropped, not scaled into round %d (R, a live "
                    "re-shard's switch)", label, base, part.version, R)
        return part.hooks.stale(base, part.version - base)
    return gate


def new_round(io, requested: int) -> int:
    """DECIDE switch's R: the coordinator's, which must not be below any stop here (a source's V, a new piece's
    part's); NotReady (FAILED_PRECONDITION) naming both, nothing changed."""
    stops = [s.machine.round or 0 for s in io.sources]
    stops += [r.version for d in io.dests.values() for r in d.replays.values()]
    if not stops or requested < max(stops):
        raise NotReady(f"round is {requested} but this shard's async stops reach version {max(stops, default=0)}: "
                       "DECIDE switch names the largest stop of every source (the replies' round)")
    return requested


def switched(io, layout: LayoutEpoch) -> None:
    """The old pieces answer new pushes ``layout-moved`` from now on (retries of acknowledged ones: DUPLICATE)."""
    for s in io.sources:
        s.part.push_gate = moved_gate(layout)


def aborted(io) -> None:
    for s in io.sources:
        s.part.push_gate = None


def followed(layouts) -> bool:
    """Every trainer has followed the newest layout here (what RETIRE waits for, ReshardReply.followed): sync,
    round R closed on every partition; async, every live member has a push acknowledged in it on every partition
    (its calls in the old layout were answered before it pushed in the new one)."""
    host = layouts.current
    job = host.head.job
    if job is None or not layouts.newest or layouts.drained:
        return False
    parts = host.parts[:job.partitions]
    if not is_async(job):
        R = layouts.timeline()[-1].round
        return all(p.version > R for p in parts)
    return all(rank in p.pushes.acked for p in parts for rank in p.members.view().live)
