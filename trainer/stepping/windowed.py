"""Async dense steps that do not wait for their acknowledgement: up to W pushes in flight (``push_window=W``).

``step()`` copies this step's gradient slices, numbers them (one sequence number per slot, fixed now, so a
push sent again is a DUPLICATE where it was applied), hands the push to the window (trainer.tables.push_window) and
returns as soon as at most W-1 pushes are unacknowledged.  Each push is a PushPull per slot; its reply's
weights land in a buffer of its own, and the newest version each slot was answered is copied into the model
at the next ``step()`` (the model is in use by the forward meanwhile), as trainer.stepping.overlap's pulls are.

Staleness: a gradient is computed on weights that may not yet include this trainer's own W-1 pushes still in
flight, so the window alone makes a push up to W-1 versions stale; with ``max_staleness`` S, connect refuses
W > S+1 (trainer.stepping.api.check_window) and the shard still refuses -- and counts -- any push staler than S.

A shard that restarted (trainer.stepping.attempt.rejoins_on) is rejoined once the pushes still in flight have settled;
this step's and the earlier unacknowledged pushes to it are lost there (counted in ``steps_lost``, as the
versions its restart rolled back are) -- sending them again would apply gradients of weights it no longer has.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import grpc
import torch

from psserver.protocol.rules import STALE
from trainer.stepping.attempt import LOST, StepFailed, rejoins_on
from trainer.channels.client import PushOutcome, ShardCallsFailed
from trainer.stepping.clipping import clip_local_
from trainer.tables.push_window import PushWindow, WindowFailed
from trainer.membership.session import Session
from trainer.membership.slots import DenseSlots
from trainer.stepping.stepper import StepInfo

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SlotPush:
    slot: int
    sequence: int
    base: int
    grad: torch.Tensor  # this step's slice, copied: the next backward overwrites .grad
    landing: torch.Tensor  # the reply's weights


@dataclass(eq=False)
class WindowedPush:
    """One step's push to every slot; ``done`` survives a failure, so sending again skips the slots done."""

    parts: list[SlotPush]
    num_samples: int
    done: dict[int, PushOutcome | str] = field(default_factory=dict)  # slot -> outcome (LOST: shard restarted)


class WindowedExchange:
    def __init__(self, slots: DenseSlots, session: Session, size: int, round_timeout: float,
                 clip_grad_norm: float | None):
        self.slots, self.session, self.client = slots, session, slots.client
        self.round_timeout, self.clip_grad_norm = round_timeout, clip_grad_norm
        n = slots.num_parts
        self._sends = ThreadPoolExecutor(max_workers=size, thread_name_prefix="ps-window")
        self._io = ThreadPoolExecutor(max_workers=size * n, thread_name_prefix="ps-window-io")
        self.window = PushWindow(size, self._sends.submit, on_ack=self._acked)
        self._newest: dict[int, tuple[int, torch.Tensor]] = {}  # slot -> newest (version, weights) answered
        self._unacked: list[WindowedPush] = []  # handed to the window, not yet acknowledged
        self._acks: list[PushOutcome] = []  # outcomes collected during the current step()
        self.steps = 0

    # ------------------------------------------------------------------ a step
    def step(self, num_samples: int) -> StepInfo:
        t0 = time.perf_counter()
        self._acks = []
        if self.window.failed():  # step() again after StepFailed: the same pushes, the same numbers
            self.window.retry_failed()
        grad = self.slots.flat.gather_grads()
        clip_local_(self.slots.flat.params, self.clip_grad_norm)
        push = WindowedPush([self._slot_push(i, grad) for i in range(self.slots.num_parts)], num_samples)
        waits_before = self.window.stats.full_waits
        self._submit(push)
        self.slots.flat.zero_grad()
        self._install()
        self.steps += 1
        self._count_window(waits_before)
        wall = time.perf_counter() - t0
        return StepInfo(versions=list(self.slots.versions), outcomes=[a.outcome for a in self._acks][-1:] or
                        ["in flight"], push_seconds=wall, pull_seconds=0.0, wait_seconds=0.0,
                        stale=sum(a.outcome == STALE for a in self._acks),
                        staleness=max((a.staleness for a in self._acks), default=0))

    def _slot_push(self, i: int, grad: torch.Tensor) -> SlotPush:
        s = self.client.parts[i]
        g = self.slots.slice(grad, i).detach().to("cpu", copy=True)
        return SlotPush(i, s.dense.take_sequence(), self.slots.versions[i], g, torch.empty_like(g))

    def _submit(self, push: WindowedPush) -> None:
        """Hand ``push`` to the window; a failure found on the way is recovered from (or raised) first."""
        sent = False
        while True:
            before = self.window.stats.submitted
            try:
                if not sent:
                    self._unacked.append(push)
                    self.window.submit(partial(self._send, push))
                elif self.window.size == 1:  # the plain step: its own push acknowledged before step() returns
                    self.window.drain()
                return
            except WindowFailed as e:
                sent = sent or self.window.stats.submitted > before
                if not sent:
                    self._unacked = [u for u in self._unacked if u is not push]
                self._recover(e)

    def _count_window(self, waits_before: int) -> None:
        self.client.count("window_full_waits", self.window.stats.full_waits - waits_before)
        with self.client.count_lock:
            c = self.client.counters
            c["window_pushes_in_flight_max"] = max(c["window_pushes_in_flight_max"], self.window.stats.max_in_flight)
            c["window_pushes_in_flight"] = self.window.in_flight
            c["window_pushes_sent"] = self.window.stats.submitted
            c["window_pushes_acknowledged"] = self.window.stats.acknowledged
            c["window_pushes_retried"] = self.window.stats.retried

    # ------------------------------------------------------------------ on the window's threads
    def _send(self, push: WindowedPush) -> WindowedPush:
        todo = [p for p in push.parts if p.slot not in push.done]
        futures = {p.slot: self._io.submit(self._send_slot, p, push.num_samples) for p in todo}
        failed = {}
        for slot, f in futures.items():
            try:
                push.done[slot] = f.result()
            except Exception as e:  # noqa: BLE001 -- reported by slot; the push stays in the window
                failed[slot] = e
        if failed:
            raise ShardCallsFailed(ShardCallsFailed.causes(failed, [s.address for s in self.client.parts],
                                                           [s.name for s in self.client.parts]), failed)
        return push

    def _send_slot(self, p: SlotPush, num_samples: int) -> PushOutcome:
        s = self.client.parts[p.slot]
        return s.dense.push_pull_numbered(p.grad, p.base, num_samples, self.client.wire, p.sequence,
                                          self.round_timeout, p.landing)

    # ------------------------------------------------------------------ acknowledgements (caller's thread)
    def _acked(self, number: int, push: WindowedPush) -> None:
        self._unacked = [u for u in self._unacked if u is not push]
        for p in push.parts:
            out = push.done.get(p.slot)
            if not isinstance(out, PushOutcome):
                continue  # LOST
            self._acks.append(out)
            newest = self._newest.get(p.slot)
            if newest is None or out.version > newest[0]:
                self._newest[p.slot] = (out.version, p.landing)

    def _install(self) -> None:
        """The newest weights each slot was answered, into the model (between steps: no forward runs)."""
        with torch.no_grad():
            for i, (v, weights) in list(self._newest.items()):
                if v > self.slots.versions[i]:
                    self.slots.slice(self.slots.flat.flat, i).copy_(weights)
                    self.slots.versions[i] = v
        self._newest.clear()

    # ------------------------------------------------------------------ failures
    def _recover(self, failure: WindowFailed) -> None:
        """Rejoin shards that restarted (their pushes lost there) and send the rest again; anything else fails
        the step (StepFailed; step() again retries under the same numbers)."""
        self.client.count("steps_failed")
        restarted: dict[int, grpc.RpcError] = {}
        other: dict[int, BaseException] = {}
        for number, error in failure.errors.items():
            for slot, e in getattr(error, "failed", {0: error}).items():
                if isinstance(e, grpc.RpcError) and rejoins_on(e):
                    restarted.setdefault(slot, e)
                else:
                    other[slot] = e
        if other or not restarted:
            done = [p.send.args[0].done for p in self.window.failed()]
            applied = sorted({slot for d in done for slot in d} - set(other)) if done else []
            error = StepFailed(self.steps + 1, applied, other or failure.errors, [s.address for s in self.client.parts],
                               [s.name for s in self.client.parts])
            log.warning("rank %d: %s", self.session.rank, error)
            raise error from next(iter(failure.errors.values()))
        self._settle()
        for slot, e in sorted(restarted.items()):
            self._lose_on(slot)
            self.session.rejoin(self.client.parts[slot], e)
            self._newest.pop(slot, None)
        self.window.retry_failed()

    def _settle(self) -> None:
        """Wait until every push in flight has been acknowledged or failed."""
        try:
            self.window.drain()
        except WindowFailed:
            pass

    def _lose_on(self, slot: int) -> None:
        """The unacknowledged pushes' parts for ``slot``: lost with its shard's restart, counted."""
        lost = 0
        for push in self._unacked:
            if slot not in push.done:
                push.done[slot] = LOST
                lost += 1
        self.client.count("steps_lost", lost)
        log.warning("rank %d: %d unacknowledged pushes to %s lost with its restart", self.session.rank, lost,
                    self.client.parts[slot].name)

    # ------------------------------------------------------------------ flush, abandon, close
    def flush(self) -> None:
        """Wait for every push in flight and put the newest weights in the model; StepFailed on a failure."""
        while True:
            try:
                self.window.drain()
                break
            except WindowFailed as e:
                self._recover(e)
        self._install()
        self._count_window(self.window.stats.full_waits)

    def pending(self) -> bool:
        return bool(self.window.failed())

    def abandon(self) -> list[int]:
        failed = {id(p.send.args[0]) for p in self.window.failed()}
        dropped = self.window.abandon_failed()
        self._unacked = [u for u in self._unacked if id(u) not in failed]
        self.client.count("window_pushes_abandoned", len(dropped))
        return dropped

    def close(self) -> None:
        self._sends.shutdown(wait=True)
        self._io.shutdown(wait=True)
