"""A dense push on a shard: its header checks, exactly-once by sequence number, the leave announced with it
(``_leaving_with``, psserver.partition.shard_members), the data-cursor claim it carries, and the checkpoints its step
made, held by the shard's checkpoints (ShardCheckpoints.hold_push) and taken once its books are written.

A room of ``Shard`` (psserver.partition.shard mixes it in), its own because the push path is the shard's busiest and most
careful code: the decision is psserver.state.modes', carrying it out psserver.state.executor's over ``Shard.hooks``; here is
the order around them (check, dedupe, decide, execute, book, checkpoint) and what a refused push puts back.
"""

from __future__ import annotations

import logging

import torch

from psserver.members.data_cursor import Grant
from psserver.protocol.errors import InvalidRequest, JobMismatch
from psserver.protocol.limits import check_num_samples
from psserver.protocol.rules import Mode
from psserver.state import modes
from psserver.state.executor import PushInfo, execute
from psserver.state.push_book import PushResult

log = logging.getLogger("psserver.partition.shard")  # the shard's lines, as before the split


class ShardPushes:
    """A dense push from its header to its books, and the data-cursor claim it may carry."""

    def check_push_header(self, rank: int, trainer_id: str, fingerprint: str, base: int, num_samples: int) -> None:
        """Refuse a push on its header alone, before its payload is read (the caller checks dtype and size)."""
        self.check_member(rank, trainer_id, fingerprint, need_params=True)
        check_num_samples(num_samples)
        if base > self.version:
            raise self.hooks.future(base)
        self.enrolment.check_base(self.job, rank, base)

    def push(self, rank: int, trainer_id: str, fingerprint: str, base: int, num_samples: int,
             grad: torch.Tensor, sequence: int = 0, finite: bool = True,
             leaving: bool = False, claim: tuple[int, int] | None = None) -> tuple[PushResult, torch.Tensor]:
        """Hand a validated gradient to the mode logic and carry out its decision (psserver.state.executor).

        Returns the result and the buffer the caller may reuse for its next receive: ``grad`` itself, or the
        round's previous sum when ``grad``'s memory became the new sum (see ``OpenRound.add``).

        A push whose (trainer id, sequence) was already acknowledged is a retry after a lost reply: it gets
        DUPLICATE, whatever the version is now (the round it was in may have closed since), and is not applied
        again.  ``leaving``: the trainer's last gradient (``_leaving_with``).  ``claim``: (claim number, batches
        per epoch) of the trainer's next batch, granted by the data cursor once this gradient is taken (read it
        from ``cursor.claims[rank]``); one the cursor would refuse is left out, not the push refused
        (``_claim_offer``).
        """
        with self._lock:
            self.check_push_header(rank, trainer_id, fingerprint, base, num_samples)
            if grad.numel() != self.end - self.start:
                raise InvalidRequest(f"length is {grad.numel()} elements but this shard's slice has "
                                     f"{self.end - self.start}")
            self.cursor.pushed(rank)  # a gradient: it backs one of the rank's claims (psserver.members.data_cursor)
            claim = self._claim_offer(rank, trainer_id, claim)
            if sequence and self.pushes.is_duplicate(rank, trainer_id, sequence):
                self.counters["duplicates"] += 1
                log.info("shard %d: push #%d from rank %d was already acknowledged (%s); not applied again",
                         self.shard_id, sequence, rank, self.pushes.outcome(rank))
                if claim is not None:
                    self.cursor.claim(rank, trainer_id, *claim)  # a retried claim: the same batch
                return PushResult("duplicate", self.version, 0), grad
            if self.push_gate is not None:  # after the book: a retry of an acknowledged push is still DUPLICATE
                refusal = self.push_gate(self, base)
                if refusal is not None:
                    raise refusal
            info = PushInfo(rank, base, num_samples, sequenced=bool(sequence), payload=grad)
            now = self._clock()
            d = modes.decide_push(self._cfg, self.rounds.view(), rank, base, now, finite=finite, sequenced=bool(sequence))
            if d.action is not modes.Action.DUPLICATE:
                self.metrics.staleness.observe(d.staleness)
            undo = self._leaving_with(rank, d) if leaving else None
            self.checkpoints.hold_push()
            try:
                result, spare = execute(self.hooks, d, info, now)
            except BaseException:
                if undo is not None:
                    self.enrolment.put_back(undo)  # a refused push changes nothing
                self.checkpoints.take_held(self.capture)
                raise
            if sequence:
                self.pushes.record(rank, trainer_id, sequence, result)
            if claim is not None:
                self.cursor.claim(rank, trainer_id, *claim)
            self.checkpoints.take_held(self.capture)
            return result, grad if spare is None else spare

    def checkpoints_after_trip(self):
        """A Step's trip: the checkpoints its dense push makes due wait for its table pushes (ShardCheckpoints)."""
        return self.checkpoints.after_trip(self.capture)

    def claim_batch(self, rank: int, trainer_id: str, fingerprint: str, number: int, per_epoch: int,
                    release: bool = False) -> Grant:
        """The job's data cursor (psserver.members.data_cursor): grant a member its next batch, async and stale-timeout
        only, here on shard 0 partition 0 only (the one cursor of the job)."""
        with self._lock:
            self.check_member(rank, trainer_id, fingerprint)
            self._check_claim(rank, trainer_id, number, per_epoch)
            return self.cursor.claim(rank, trainer_id, number, per_epoch, release)

    def _claim_offer(self, rank: int, trainer_id: str, claim: tuple[int, int] | None) -> tuple[int, int] | None:
        """A push's claim, or None if the cursor would refuse it: a push is never refused for its claim (a
        windowed push sent again after the trainer claimed on may carry an old number); the trainer asks with
        ClaimBatch instead, which refuses it properly.  Counted in ``push_claims_ignored``."""
        if claim is None:
            return None
        try:
            self._check_claim(rank, trainer_id, *claim)
        except (JobMismatch, InvalidRequest) as e:
            self.counters["push_claims_ignored"] += 1
            log.debug("shard %d: rank %d's push claims a batch that is not granted: %s", self.shard_id, rank, e)
            return None
        return claim

    def _check_claim(self, rank: int, trainer_id: str, number: int, per_epoch: int) -> None:
        if self.shard_id != 0 or self.partition != 0:
            raise JobMismatch(f"claim is {number} but this is {self.label}: claims go to shard 0 partition 0 (the "
                              "job's one data cursor)")
        if self.job.mode == Mode.SYNC:
            raise JobMismatch(f"claim is {number} but mode is {self.job.mode}: a sync round's batch is placed by "
                              "the membership timeline (trainer.workloads.data.round_batch), not claimed")
        self.cursor.check(rank, trainer_id, number, per_epoch)
