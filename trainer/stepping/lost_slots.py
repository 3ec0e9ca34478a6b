"""A step of base R-1 that a drained shard, lost between its vote and DECIDE, never answered (docs/design/handoff-io.md,
"A drained shard lost after its vote").

The other slots applied the step and their replies named a layout that takes over at R = base + 1; the lost slot
could not be reached within the retry budget.  Whether it applied the push is not inferred from the others (a sync
round closes without a trainer whose lease expired): its push book at R moved with its range to the new layout's
owners (psserver.resharding.handoff.moved_books).  So the trainer switches to that layout, asks each new owner of the lost slot's
range (``DenseCalls.ask_moved``: a PushPull naming the old slot, no gradient) and takes its weights at R:

* "duplicate": the push is in the state the new layout starts from -- the step is done (counted
  ``steps_answered_by_new_owners``);
* "stale": round R-1 closed there without it -- the step is dropped there, as one whose lease expired, and goes
  on from the new owners' weights (counted ``steps_dropped_past_unreachable`` and ``stale_pushes``).

Either way it is logged.  ``new_owners`` is pure and unit-tested.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import grpc
import torch

from psserver.protocol.layouts import new_job
from trainer.stepping.attempt import StepFailed, StepPastLost
from trainer.membership.relayout import Relayout, due, slot_ranges
from trainer.stepping.stepper import StepInfo

log = logging.getLogger(__name__)


def new_owners(old: tuple[int, int], new: Sequence[tuple[int, int]]) -> list[int]:
    """The new slots whose ranges overlap the old slot's range ``old``, in order."""
    a, b = old
    return [j for j, (c, d) in enumerate(new) if a < b and c < d and c < b and a < d]


def answer_lost(relayout: Relayout, exchange, lost: StepPastLost, base: int) -> StepInfo | None:
    """The step finished through the lost slots' new owners, or None when no layout takes over at ``base + 1``
    (then it is the failed step it was).  ``exchange``: trainer.stepping.exchange.DenseExchange, holding the attempt.  The
    switch comes first (the questions go on the new layout's clients); the questions left are kept on the attempt,
    so a question that fails too (its own retry budget spent) is asked again by the next ``step()``."""
    layout = due(relayout.timeline.learn(), relayout.epoch, base + 1)
    if layout is None or layout.round != base + 1:
        return None
    attempt, slots = exchange.attempt, exchange.slots
    old_ranges = list(slots.ranges)
    job = new_job(slots.client.job, layout.num_shards, layout.partitions)
    new_ranges = slot_ranges(slots.flat.flat.numel(), job)
    attempt.lost = {j: (base, attempt.sequences[j], new_owners(old_ranges[j], new_ranges), lost.failed[j].code().name)
                    for j in lost.lost}
    relayout.switch(layout, base + 1)  # every slot at R; the lost range's weights come with the answers below
    return ask_lost(relayout, exchange)


def ask_lost(relayout: Relayout, exchange) -> StepInfo:
    """Ask the questions the attempt still has (``StepAttempt.lost``: old slot -> (base, sequence, its new owners,
    why it was lost)); the step's info once every one is answered, else StepFailed naming the new owner that was
    not reached (counted ``steps_failed``; ``step()`` asks again)."""
    t0 = time.perf_counter()
    attempt, slots = exchange.attempt, exchange.slots
    for j, (base, sequence, owners, why) in sorted(attempt.lost.items()):
        outcomes = []
        for n in owners:
            try:
                outcomes.append(_ask(exchange, n, j, sequence, base))
            except grpc.RpcError as e:
                slots.client.count("steps_failed")
                error = StepFailed(exchange.steps + 1, attempt.applied(), {n: e},
                                   [s.address for s in slots.client.parts])
                log.warning("rank %d: asking layout %d's slot %d about lost old slot %d: %s", relayout.session.rank,
                            relayout.epoch, n, j, error)
                raise error from e
        outcome = "duplicate" if outcomes and all(o == "duplicate" for o in outcomes) else "stale"
        attempt.record(j, outcome)
        attempt.timings[j] = (0.0, 0.0, 0.0)
        del attempt.lost[j]
        slots.client.count("steps_answered_by_new_owners" if outcome == "duplicate" else
                           "steps_dropped_past_unreachable")
        log.warning("rank %d: old slot %d (%s) was unreachable for the step of base %d; layout %d's owners of its "
                    "range answered from its push book: %s", relayout.session.rank, j, why, base, relayout.epoch,
                    "applied there (DUPLICATE)" if outcome == "duplicate" else
                    "round closed without it: dropped there, as a push whose lease expired")
    attempt.lost = None
    return exchange.finished(attempt, time.perf_counter() - t0)


def _ask(exchange, n: int, old_slot: int, sequence: int, base: int) -> str:
    """New slot ``n``'s answer for ``old_slot``; its weights land in the model, its version in the slots."""
    slots = exchange.slots
    s = slots.client.parts[n]
    target = slots.slice(slots.flat.flat, n)
    landing = slots.staging.weights_buffer(n, target)
    out = s.dense.ask_moved(old_slot, sequence, base, slots.client.wire, target.numel(), exchange.round_timeout,
                            landing)
    with torch.no_grad():
        slots.staging.weights_to_device(n, target)
    slots.versions[n] = out.version
    return out.outcome
