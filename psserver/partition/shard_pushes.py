"""A dense push on a shard: its header checks, exactly-once by sequence number, the leave announced with it
(``Admission.leaving_with``, psserver.partition.shard_members), the data-cursor claim it carries, and the checkpoints its
step made, taken once its books are written.

``DensePushes`` is a room of ``Shard`` (psserver.partition.shard makes it), its own because the push path is the shard's
busiest and most careful code: the decision is psserver.state.modes', carrying it out psserver.state.executor's over
``Shard.hooks``; here is the order around them (check, dedupe, decide, execute, book, checkpoint) and what a
refused push puts back.  The books, the cursor and the job are the shard's, read at each call; the checkpoints a
step makes due during a push are held by the shard's ``checkpoints`` (ShardCheckpoints.hold_push).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from psserver.members.data_cursor import Grant
from psserver.protocol.errors import InvalidRequest, JobMismatch
from psserver.protocol.limits import check_num_samples
from psserver.protocol.rules import Mode
from psserver.state import modes
from psserver.state.executor import PushInfo, execute
from psserver.state.push_book import PushResult

log = logging.getLogger("psserver.partition.shard")  # the shard's lines, as before the split


class DensePushes:
    """A dense push from its header to its books, and the data-cursor claim it may carry."""

    def __init__(self, shard, lock: threading.RLock, clock: Callable[[], float], admission, rounds, hooks):
        """``shard``: the psserver.partition.shard.Shard pushed to (not imported: it imports this); ``admission`` and
        ``rounds``: its psserver.partition.shard_members.Admission and psserver.partition.shard_rounds.Rounds;
        ``hooks``: its executor hooks (psserver.state.dense_hooks.DenseHooks)."""
        self.shard = shard
        self._lock, self._clock = lock, clock
        self._admission, self._rounds, self._hooks = admission, rounds, hooks
        self._enrolment, self._counters = shard.enrolment, shard.counters

    def check_push_header(self, rank: int, trainer_id: str, fingerprint: str, base: int, num_samples: int) -> None:
        """Refuse a push on its header alone, before its payload is read (the caller checks dtype and size)."""
        s = self.shard
        self._admission.check_member(rank, trainer_id, fingerprint, need_params=True)
        check_num_samples(num_samples)
        if base > s.version:
            raise self._hooks.future(base)
        self._enrolment.checks.check_base(s.job, rank, base)

    def push(self, rank: int, trainer_id: str, fingerprint: str, base: int, num_samples: int,
             grad: torch.Tensor, sequence: int = 0, finite: bool = True,
             leaving: bool = False, claim: tuple[int, int] | None = None) -> tuple[PushResult, torch.Tensor]:
        """Hand a validated gradient to the mode logic and carry out its decision (psserver.state.executor).

        Returns the result and the buffer the caller may reuse for its next receive: ``grad`` itself, or the
        round's previous sum when ``grad``'s memory became the new sum (see ``OpenRound.add``).

        A push whose (trainer id, sequence) was already acknowledged is a retry after a lost reply: it gets
        DUPLICATE, whatever the version is now (the round it was in may have closed since), and is not applied
        again.  ``leaving``: the trainer's last gradient (``Admission.leaving_with``).  ``claim``: (claim number,
        batches per epoch) of the trainer's next batch, granted by the data cursor once this gradient is taken
        (read it from ``cursor.claims[rank]``); one the cursor would refuse is left out, not the push refused
        (``_claim_offer``).
        """
        s = self.shard
        with self._lock:
            self.check_push_header(rank, trainer_id, fingerprint, base, num_samples)
            if grad.numel() != s.end - s.start:
                raise InvalidRequest(f"length is {grad.numel()} elements but this shard's slice has "
                                     f"{s.end - s.start}")
            s.cursor.pushed(rank)  # a gradient: it backs one of the rank's claims (psserver.members.data_cursor)
            claim = self._claim_offer(rank, trainer_id, claim)
            if sequence and s.pushes.is_duplicate(rank, trainer_id, sequence):
                self._counters["duplicates"] += 1
                log.info("shard %d: push #%d from rank %d was already acknowledged (%s); not applied again",
                         s.shard_id, sequence, rank, s.pushes.outcome(rank))
                if claim is not None:
                    s.cursor.claim(rank, trainer_id, *claim)  # a retried claim: the same batch
                return PushResult("duplicate", s.version, 0), grad
            if s.push_gate is not None:  # after the book: a retry of an acknowledged push is still DUPLICATE
                refusal = s.push_gate(s, base)
                if refusal is not None:
                    raise refusal
            info = PushInfo(rank, base, num_samples, sequenced=bool(sequence), payload=grad)
            now = self._clock()
            d = modes.decide_push(s.mode_config(), self._rounds.view(), rank, base, now, finite=finite,
                                  sequenced=bool(sequence))
            if d.action is not modes.Action.DUPLICATE:
                s.metrics.staleness.observe(d.staleness)
            undo = self._admission.leaving_with(rank, d) if leaving else None
            s.checkpoints.hold_push()
            try:
                result, spare = execute(self._hooks, d, info, now)
            except BaseException:
                if undo is not None:
                    self._enrolment.put_back(undo)  # a refused push changes nothing
                s.checkpoints.take_held(s.capture)
                raise
            if sequence:
                s.pushes.record(rank, trainer_id, sequence, result)
            if claim is not None:
                s.cursor.claim(rank, trainer_id, *claim)
            s.checkpoints.take_held(s.capture)
            return result, grad if spare is None else spare

    def claim_batch(self, rank: int, trainer_id: str, fingerprint: str, number: int, per_epoch: int,
                    release: bool = False) -> Grant:
        """The job's data cursor (psserver.members.data_cursor): grant a member its next batch, async and stale-timeout
        only, here on shard 0 partition 0 only (the one cursor of the job)."""
        with self._lock:
            self._admission.check_member(rank, trainer_id, fingerprint)
            self._check_claim(rank, trainer_id, number, per_epoch)
            return self.shard.cursor.claim(rank, trainer_id, number, per_epoch, release)

    def _claim_offer(self, rank: int, trainer_id: str, claim: tuple[int, int] | None) -> tuple[int, int] | None:
        """A push's claim, or None if the cursor would refuse it: a push is never refused for its claim (a
        windowed push sent again after the trainer claimed on may carry an old number); the trainer asks with
        ClaimBatch instead, which refuses it properly.  Counted in ``push_claims_ignored``."""
        if claim is None:
            return None
        try:
            self._check_claim(rank, trainer_id, *claim)
        except (JobMismatch, InvalidRequest) as e:
            self._counters["push_claims_ignored"] += 1
            log.debug("shard %d: rank %d's push claims a batch that is not granted: %s", self.shard.shard_id, rank, e)
            return None
        return claim

    def _check_claim(self, rank: int, trainer_id: str, number: int, per_epoch: int) -> None:
        s = self.shard
        if s.shard_id != 0 or s.partition != 0:
            raise JobMismatch(f"claim is {number} but this is {s.label}: claims go to shard 0 partition 0 (the "
                              "job's one data cursor)")
        if s.job.mode == Mode.SYNC:
            raise JobMismatch(f"claim is {number} but mode is {s.job.mode}: a sync round's batch is placed by "
                              "the membership timeline (trainer.workloads.data.round_batch), not claimed")
        s.cursor.check(rank, trainer_id, number, per_epoch)
