"""The job's data cursor for async and stale-timeout elastic jobs (docs/design/elastic-join.md, "The data cursor").

In sync mode a round's global batch is placed by the membership timeline (trainer.workloads.data.round_batch) and every
trainer agrees on the round.  In async and stale-timeout each trainer runs at its own pace, so no round number
is shared: instead one cursor, kept by shard 0 partition 0 (the one that hands out ranks), grants each trainer
the global index of its next batch (dynamic data sharding, as ElasticDL's and tf.data's dispatchers do).  Batch
k is samples ``[(k mod P)·b, (k mod P + 1)·b)`` of data epoch ``k div P``'s order, P = samples // b, so the
union of granted batches covers each data epoch's samples once, whoever trains them and however fast.

Exactly-once is decided here, pure (no clock, no network; tests/unit/test_data_cursor.py):

* claim c + 1 from the same process says the batch of claim c was trained; a retry of claim c (a lost reply)
  is answered the same batch, so a retry never skips a batch;
* a trainer that leaves (Leave) or is replaced by a new process on its rank (a claim with another trainer id)
  with a batch claimed and not released has that batch **re-issued**: the next claim by anyone gets it first;
* a release (``ClaimRequest.release``, sent after a trainer's last step, before its Leave) closes its claim;
* a cursor restored from a checkpoint (shard 0 restarted) is behind its trainers: each rank's first claim
  after the restore is taken as it comes, whatever its number (a resume), and the batches granted after the
  checkpoint are granted again -- trained twice, as a restored shard's versions since its checkpoint are lost
  (docs/failure.md) -- counted in ``claims_resumed_after_restore`` and logged.

A claim says the batch before was trained, so the shard also asks for evidence: a rank's gradients.  Each push
it gets from a rank backs one claim; a rank may run ``MAX_UNBACKED_CLAIMS`` claims ahead of its pushes (a
trainer's push window keeps that many in flight while it claims on), and one more is refused
(FAILED_PRECONDITION, counted in ``claims_refused_unbacked``) -- a member can no longer claim thousands of
batches in a second and train none of them (issue 35 item 8).

State is bounded by the job's ranks: one claim per rank, and a re-issued batch per rank at most (a claim takes
re-issued batches first), freed when the rank leaves.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from psserver.protocol.errors import InvalidRequest, JobMismatch
from psserver.protocol.limits import MAX_PUSH_WINDOW

log = logging.getLogger("psserver.partition.shard")
MAX_BATCHES_PER_EPOCH = 1 << 40  # a trainer's samples // batch size; past this it is not a real data set
MAX_UNBACKED_CLAIMS = MAX_PUSH_WINDOW  # claims a rank may run ahead of the pushes it sent (its push window)


@dataclass(frozen=True)
class Claim:
    """A rank's newest claim: its process, the claim number, the batch granted (None: released)."""

    trainer_id: str
    number: int
    batch: int | None
    reissued: bool = False


@dataclass(frozen=True)
class Grant:
    batch: int | None  # None answers a release
    reissued: bool = False


class DataCursor:
    """The next batch index, the batches to re-issue, and each rank's newest claim."""

    def __init__(self, counters: Counter):
        self._counters = counters
        self.reset()

    def reset(self) -> None:
        self.next = 0  # the first batch index never granted
        self.per_epoch = 0  # batches per data epoch, set by the job's first claim
        self.reissue: list[int] = []  # granted to trainers that left before training them; sorted
        self.claims: dict[int, Claim] = {}
        self.restored = False  # restored from a checkpoint: each rank's first claim since then resumes
        self.resumed: set[int] = set()
        self.ahead: dict[int, int] = {}  # rank -> claims granted minus pushes received (never below 0)

    # ------------------------------------------------------------------ decisions
    def check(self, rank: int, trainer_id: str, number: int, per_epoch: int) -> None:
        """Refuse a claim on what it says, before anything changes."""
        if not 1 <= per_epoch <= MAX_BATCHES_PER_EPOCH:
            raise InvalidRequest(f"batches_per_epoch is {per_epoch} but must be 1..{MAX_BATCHES_PER_EPOCH}")
        if self.per_epoch and per_epoch != self.per_epoch:
            raise JobMismatch(f"batches_per_epoch is {per_epoch} but the job's is {self.per_epoch}: every trainer "
                              "of the job needs the same data set and --batch-size")
        if self._resumes(rank, number):
            return
        held = self.claims.get(rank)
        expected = (held.number, held.number + 1) if held and held.trainer_id == trainer_id else (1, 1)
        if number not in expected:
            want = f"{expected[1]} (or {expected[0]}, a retry)" if expected[0] != expected[1] else "1 (a new process)"
            raise InvalidRequest(f"claim is {number} but rank {rank}'s next claim is {want}")
        if held and held.trainer_id == trainer_id and number == held.number + 1 and \
                self.ahead.get(rank, 0) >= MAX_UNBACKED_CLAIMS:
            self._counters["claims_refused_unbacked"] += 1
            raise JobMismatch(f"claim is {number} but rank {rank} has claimed {self.ahead[rank]} batches more than "
                              f"it pushed gradients for (at most {MAX_UNBACKED_CLAIMS}, a push window's): push the "
                              "batches claimed before claiming more")

    def pushed(self, rank: int) -> None:
        """A gradient from ``rank`` arrived (applied, accepted, dropped as stale or a retry): it backs a claim."""
        if self.ahead.get(rank):
            self.ahead[rank] -= 1

    def claim(self, rank: int, trainer_id: str, number: int, per_epoch: int, release: bool = False) -> Grant:
        """Grant ``rank``'s claim ``number`` (or answer its retry); ``release``: want nothing more."""
        self.check(rank, trainer_id, number, per_epoch)
        if self._resumes(rank, number):
            self.resumed.add(rank)
            self._counters["claims_resumed_after_restore"] += 1
            log.info("data cursor: rank %d resumes at claim %d after the shard's restore; batches granted since "
                     "the checkpoint are granted again", rank, number)
            self.claims.pop(rank, None)  # its claim of the checkpoint was trained, or re-issued, since
        held = self.claims.get(rank)
        if held is not None and held.trainer_id == trainer_id and held.number == number:
            self._counters["claim_retries"] += 1
            return Grant(held.batch, held.reissued)
        if held is not None and held.trainer_id != trainer_id:
            self._drop(held, rank, "was replaced by a new process")
            self.ahead.pop(rank, None)
        self.per_epoch = per_epoch
        if release:
            self._counters["claims_released"] += 1
            self.claims[rank] = Claim(trainer_id, number, None)
            return Grant(None)
        reissued = bool(self.reissue)
        if reissued:
            batch = self.reissue.pop(0)
            self._counters["batches_reissued"] += 1
        else:
            batch, self.next = self.next, self.next + 1
        self._counters["batches_claimed"] += 1
        if held is not None and held.trainer_id == trainer_id and held.batch is not None:
            self.ahead[rank] = self.ahead.get(rank, 0) + 1  # says the batch before was trained
        self.claims[rank] = Claim(trainer_id, number, batch, reissued)
        return Grant(batch, reissued)

    def _resumes(self, rank: int, number: int) -> bool:
        """Whether ``rank``'s claim ``number`` is its first since a restore, ahead of what the checkpoint held."""
        if not self.restored or rank in self.resumed:
            return False
        held = self.claims.get(rank)
        return number > (held.number + 1 if held else 1)

    def leave(self, rank: int) -> int | None:
        """``rank`` left: its batch claimed and not released is re-issued.  Returns that batch, if any."""
        held = self.claims.pop(rank, None)
        self.ahead.pop(rank, None)
        return self._drop(held, rank, "left") if held is not None else None

    def _drop(self, held: Claim, rank: int, why: str) -> int | None:
        if held.batch is None:
            return None
        self.reissue.append(held.batch)
        self.reissue.sort()
        self._counters["batches_to_reissue"] += 1
        log.info("data cursor: rank %d %s with batch %d claimed and not trained: it is re-issued", rank, why,
                 held.batch)
        return held.batch

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        return dict(next=self.next, per_epoch=self.per_epoch, reissue=list(self.reissue),
                    claims={r: (c.trainer_id, c.number, c.batch, c.reissued) for r, c in self.claims.items()})

    def restore(self, state: dict | None) -> None:
        self.reset()
        if state:
            self.next, self.per_epoch, self.reissue = state["next"], state["per_epoch"], list(state["reissue"])
            self.claims = {r: Claim(*c) for r, c in state["claims"].items()}
            self.restored = True

    def digest_text(self) -> str:
        return repr(sorted(self.state().items(), key=lambda kv: kv[0]))

