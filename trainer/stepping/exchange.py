"""The dense exchange of one step: every slot its gradient slice, and the weights back.

The variants share this one path and differ at a few points: plain (one PushPull call per slot), overlap
(push, then take the weights pulled in the background: trainer.stepping.overlap), push during backward (the push was
started by a hook: trainer.stepping.early_push) and pipelined (behind the next forward, each slot landing on its own:
trainer.stepping.pipelined).  What a slot does next is decided by trainer.stepping.attempt's pure functions.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

import grpc
import torch

from psserver.protocol.rules import STALE, Mode, reply_version
from trainer.stepping.attempt import (
    Move,
    StepAttempt,
    StepFailed,
    StepMoved,
    StepPastLost,
    after_rejoin,
    lost_past_switch,
    moved_everywhere,
    moved_partly,
    moved_past_unreachable,
    rejoins_on,
    slot_move,
    split_exchange,
)
from trainer.channels.client import PushOutcome, ShardClient
from trainer.stepping.clipping import clip_local_
from trainer.stepping.early_push import EarlyPusher
from trainer.stepping.overlap import Prefetcher
from trainer.stepping.pipeline import LayerWaits, OrderedGate
from trainer.membership.session import Session
from trainer.membership.slots import DenseSlots
from trainer.stepping.stepper import StepInfo

log = logging.getLogger(__name__)


class DenseExchange:
    """Runs, and retries, the dense part of steps; ``attempt`` is a step that failed on some slots until
    ``step()`` retries or abandons it."""

    def __init__(self, slots: DenseSlots, session: Session, round_timeout: float,
                 clip_grad_norm: float | None, prefetch: Prefetcher | None = None, early: EarlyPusher | None = None,
                 waits: LayerWaits | None = None):
        self.slots, self.session, self.client = slots, session, slots.client
        self.round_timeout, self.clip_grad_norm = round_timeout, clip_grad_norm
        self.prefetch, self.early, self.waits = prefetch, early, waits
        self.attempt: StepAttempt | None = None
        self.answers_lost = False  # the step runner answers StepPastLost (it follows layouts: trainer.stepping.lost_slots)
        self.steps = 0  # dense steps completed

    def begin_pipelined(self, started: dict[int, Future]) -> None:
        """A step to run behind the next forward; recorded on the caller's thread (its stream's gradients)."""
        self.attempt = StepAttempt(todo=set(range(self.slots.num_parts)), started=started, pipelined=True,
                                   produced=self.slots.produced())

    def abandon(self) -> list[int]:
        """Drop the failed step: its slots' next pushes get new numbers.  Returns the slots it left undone."""
        todo = sorted(self.attempt.todo) if self.attempt is not None else []  # [] : only a table push failed
        for i in todo:
            self.client.parts[i].dense.abandon_push()
        self.attempt = None
        return todo

    def dense_step(self, num_samples: int) -> StepInfo:
        """Every slot its gradient slice, and the weights back; StepFailed if some slots did not finish."""
        flat = self.slots.flat
        grad = flat.gather_grads()
        if self.attempt is None:  # a retried step pushes the same, already clipped, gradient
            clip_local_(flat.params, self.clip_grad_norm)  # this trainer's gradient, not the round's average
        # Recorded before the fan-out, and each shard's result as it comes: however step() is left (an error,
        # KeyboardInterrupt), the next call knows which shards are done and retries only the others.
        attempt = self.attempt = self.attempt or StepAttempt(todo=set(range(self.slots.num_parts)))
        futures_wait(attempt.inflight)  # an interrupted try's calls on other threads finish first
        attempt.inflight.clear()
        if not attempt.pipelined:  # (pipelined: recorded by step() on the caller's thread, before this one ran)
            attempt.produced = self.slots.produced()  # the caller's gradients
        todo = sorted(attempt.todo)
        t_exchange = time.perf_counter()
        results = self._fan_out(todo, grad, num_samples, attempt)
        if attempt.todo:
            self._fail(attempt, dict(zip(todo, results)))
        self.attempt = None
        if not attempt.pipelined:  # pipelined: each slot was zeroed as it landed (the next backward may run)
            flat.zero_grad()
        self.steps += 1
        return self._info(attempt, time.perf_counter() - t_exchange)

    def _fan_out(self, todo: list[int], grad: torch.Tensor, num_samples: int, attempt: StepAttempt) -> list:
        """The slots ``todo``, side by side: each one's outcome, or the Exception it raised."""
        # Partitioned: slots start in the flat vector's order, so the partitions the next forward needs first
        # go first (trainer.stepping.pipeline.OrderedGate).  No cap on how many run at once: capping at two per shard
        # (one pushing, one pulling) measured slower on 2 cores -- ResNet-18 37.5-40.8 vs 41.6-42.7 samples/s,
        # the 23M MLP 158 vs 213 -- as each group of rounds waits for the slowest trainer in turn.
        gate = OrderedGate(todo, len(todo)) if self.slots.job.partitions > 1 else None
        try:
            return self.client.map_settled(lambda s: self._exchange(s, grad, num_samples, attempt, gate),
                                           None if len(todo) == self.slots.num_parts else todo, attempt.inflight,
                                           parts=True) if todo else []
        finally:
            if not attempt.pipelined:  # (a pipelined step's forward settles slot by slot, on its own thread)
                if self.early is not None:
                    self.early.finish_step()
                self.slots.staging.settle()  # the next forward, on the caller's stream, waits for the new weights

    def finished(self, attempt: StepAttempt, wall: float) -> StepInfo:
        """A step every slot answered outside ``dense_step`` (trainer.stepping.step_call): the gradients zeroed, counted."""
        self.attempt = None
        self.slots.flat.zero_grad()
        self.steps += 1
        return self._info(attempt, wall)

    def rerouted(self) -> None:
        """A step refused layout-moved goes again whole on the new layout's slots (trainer.membership.relayout): a fresh
        attempt over them, the gradient as it was (already clipped)."""
        self.attempt = StepAttempt(todo=set(range(self.slots.num_parts)))

    def _fail(self, attempt: StepAttempt, results: dict[int, object]) -> None:
        failed = {i: r for i, r in results.items() if isinstance(r, Exception)}
        names = [s.address for s in self.client.parts], [s.name for s in self.client.parts]
        newest = moved_everywhere(failed, attempt.applied())
        if newest is not None:  # changed nothing anywhere: not a failed step (the runner re-routes it)
            raise StepMoved(newest, self.steps + 1, [], failed, *names)
        lost = lost_past_switch(failed, attempt.applied()) if self.answers_lost and not attempt.pipelined else None
        if lost is not None:  # answered by the lost slots' new owners if a layout took over (trainer.stepping.lost_slots)
            raise StepPastLost(lost, self.steps + 1, attempt.applied(), failed, *names)
        dropped = moved_partly(failed, attempt.applied()) if self.slots.job.mode == Mode.ASYNC else None
        if dropped is not None:  # an async step split by a live re-shard's stops: the refused parts dropped
            self._drop_moved(attempt, failed, dropped)
            return
        partly = moved_past_unreachable(failed, attempt.applied())
        if partly is not None:  # re-routed if its base is past the new layout's R, else raised as failed
            raise StepMoved(partly[0], self.steps + 1, [], failed, *names, unreachable=partly[1])
        self.client.count("steps_failed")
        error = StepFailed(self.steps + 1, attempt.applied(), failed, [s.address for s in self.client.parts],
                           [s.name for s in self.client.parts])
        log.warning("rank %d: %s", self.session.rank, error)
        raise error from next(iter(failed.values()))

    def _drop_moved(self, attempt: StepAttempt, failed: dict, newest: int) -> None:
        """The slots of an async step that refused it ``layout-moved`` (trainer.stepping.attempt.moved_partly) answered as
        if stale: nothing applied there, the step done, the next one in the new layout (counted, logged)."""
        for i in failed:
            s = self.client.parts[i]
            s.calls.saw_layout(newest)
            s.dense.abandon_push()
            attempt.outcomes[i] = STALE
            attempt.todo.discard(i)
        self.client.count("pushes_dropped_at_switch", len(failed))
        log.warning("rank %d: %d slots of an async step refused it layout-moved after the others applied it (a live "
                    "re-shard's stops, newest layout %d): those parts dropped as stale, the next step goes in the "
                    "new layout", self.session.rank, len(failed), newest)

    def _info(self, attempt: StepAttempt, wall: float) -> StepInfo:
        outcomes = [attempt.outcomes[i] for i in sorted(attempt.outcomes)]  # the step's slots (its layout's)
        push, pull, wait = split_exchange(list(attempt.timings.values()), wall, self.slots.job.partitions > 1)
        return StepInfo(versions=list(self.slots.versions), outcomes=outcomes, push_seconds=push,
                        pull_seconds=pull, wait_seconds=wait, stale=outcomes.count(STALE),
                        staleness=max(attempt.staleness.values(), default=0))

    def _exchange(self, s: ShardClient, grad: torch.Tensor, num_samples: int, attempt: StepAttempt,
                  gate: OrderedGate | None = None) -> str:
        """One shard's (partition's) part of a step, started in the gate's order."""
        if gate is not None:
            gate.enter(s.slot)
        try:
            return self.exchange_slot(s, grad, num_samples, attempt)
        finally:
            if gate is not None:
                gate.leave()

    def exchange_slot(self, s: ShardClient, grad: torch.Tensor, num_samples: int, attempt: StepAttempt) -> str:
        """A shard found restarted is rejoined and this step's gradient pushed to it again, on the version it
        resumed at: the rounds the restart rolled back are lost, this step is not.  (Dropped, it left this
        trainer a step ahead there of a peer whose unanswered push was retried into the restored round, while
        the other shards' rounds kept them paired: in sync mode each waited for the other --
        tests/cluster/test_partition_faults.py.)"""
        outcome = None
        try:
            if s.slot in self.session.resume_dense:  # a table call of this step rejoined it: its weights are due
                self.session.resume_dense_slice(s)
            else:
                outcome = self._exchange_once(s, grad, num_samples, attempt)
        except grpc.RpcError as e:
            if not rejoins_on(e):
                raise
            outcome = after_rejoin(self.session.rejoin(s, e))
        if outcome is None:  # rejoined: a push of its own, answered by the restarted shard
            attempt.forget_push(s.slot)
            outcome = self._exchange_once(s, grad, num_samples, attempt)
        attempt.record(s.slot, outcome)
        if attempt.pipelined:
            self.slots.staging.zero(s.slot, self.slots.slice(self.slots.flat.grad, s.slot))
            self.waits.landed(s.slot)
        return outcome

    def _exchange_once(self, s: ShardClient, grad: torch.Tensor, num_samples: int, attempt: StepAttempt) -> str:
        i = s.slot
        t0 = time.perf_counter()
        out = attempt.answered(i, s.dense.last_answer)  # pushed in an earlier try of this step: only the pull left
        started = None if out is not None else self._started_push(i, num_samples, attempt)
        move = slot_move(answered=out is not None, started=started is not None, overlap=self.prefetch is not None)
        if move in (Move.PUSH_PULL, Move.PUSH):
            attempt.sequences.setdefault(i, s.dense.next_sequence())
        if move == Move.PUSH_PULL:
            return self._push_pull(s, grad, num_samples, attempt, t0)
        if move == Move.PUSH:
            out = attempt.acks[i] = self.slots.push(i, num_samples, attempt.produced)
        elif move == Move.AWAIT:
            out = attempt.acks[i] = self._await(i, started, attempt)
        attempt.staleness[i] = out.staleness
        t1 = time.perf_counter()
        if self.prefetch is not None:
            # Take the weights pulled while this gradient was computed, then pull the next ones in the
            # background while the next gradient is computed (on these: one push staler than otherwise).
            self.prefetch.collect(i)
            self.prefetch.start(s, out.version)
            attempt.timings[i] = (t1 - t0, time.perf_counter() - t1, 0.0)
            return out.outcome
        # async: its own step; stale: catch up with the shard; sync: the close of this gradient's round
        versions = self.slots.versions
        wanted = reply_version(self.slots.job.mode, out.outcome, versions[i], out.version)
        versions[i], waited = self.slots.pull_into(s, wanted, self.round_timeout, with_wait=True)
        attempt.timings[i] = (t1 - t0, time.perf_counter() - t1 - waited, waited)
        return out.outcome

    def _started_push(self, i: int, num_samples: int, attempt: StepAttempt) -> Future | None:
        """A push of slot ``i`` already under way: an earlier try's, or one begun during backward."""
        if i in attempt.started:
            return attempt.started[i]
        return self.early.take(i, num_samples) if self.early is not None and not attempt.pipelined else None

    @staticmethod
    def _await(i: int, started: Future, attempt: StepAttempt) -> PushOutcome:
        """step() waits for what is left of a push begun earlier."""
        attempt.started[i] = started
        try:
            return started.result()
        finally:
            if started.done():  # answered, or failed: a retry pushes again under the same number
                attempt.started.pop(i, None)

    def _push_pull(self, s: ShardClient, grad: torch.Tensor, num_samples: int, attempt: StepAttempt,
                   t0: float) -> str:
        """The plain path: one PushPull call, whose reply is the weights to go on from."""
        i, slots = s.slot, self.slots
        target = slots.slice(slots.flat.flat, i)
        landing = slots.staging.weights_buffer(i, target)  # the model itself on the CPU
        out, _, pushed, waited = s.dense.push_pull(
            slots.staging.to_host(i, slots.slice(grad, i), attempt.produced), slots.versions[i], num_samples,
            slots.client.wire, self.round_timeout, out=landing)
        with torch.no_grad():
            slots.staging.weights_to_device(i, target)
        slots.versions[i] = out.version
        attempt.staleness[i] = out.staleness
        attempt.timings[i] = (pushed, time.perf_counter() - t0 - pushed - waited, waited)
        return out.outcome
