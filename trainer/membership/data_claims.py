"""An async or stale-timeout trainer's claims on the job's data cursor (docs/design/elastic-join.md, "The data cursor").

Each step's push claims the next batch (``arm``), so a claim costs no call of its own; ClaimBatch is the fallback.

The cursor is on shard 0 partition 0 (psserver.members.data_cursor): ``next()`` asks it for the global index of this
trainer's next batch, numbering the claims 1, 2, 3, ... so that a retry after a lost reply (same number) gets
the same batch and the next number says the previous batch was trained.  ``release()`` after the last step, before
the Leave, says that last batch was trained too; a trainer that leaves without it has its batch re-issued.
"""

from __future__ import annotations

from psserver.protocol.proto import ps_pb2 as _pb
from trainer.channels.client import ShardClient

CLAIM_TIMEOUT_SECONDS = 30.0  # one attempt; a lost reply is retried under the same claim number


class BatchClaims:
    def __init__(self, cursor: ShardClient, batches_per_epoch: int):
        self._cursor, self.batches_per_epoch = cursor, batches_per_epoch
        self.number = 0  # the newest claim sent
        self.batch: int | None = None  # the batch it was granted
        self.with_push = 0  # grants that came with a push's reply (no ClaimBatch call)
        self.reissued = 0  # batches granted that a trainer before this one claimed and did not train
        self.claimed: list[int] = []  # every batch granted, in order (the trainer's summary, tests)

    def _ask(self, release: bool) -> _pb.ClaimReply:
        reply = self._cursor.claim_batch(self.number + 1, self.batches_per_epoch, release, CLAIM_TIMEOUT_SECONDS)
        self.number += 1
        return reply

    def arm(self) -> None:
        """Let this step's push to shard 0 partition 0 claim the next batch too (ChunkHeader.claim): the grant comes
        with the PushPull reply, no call of its own, and the batch this step trains counts as trained exactly
        when its gradient is taken.  A push that does not bring it back (another exchange variant, a stale drop)
        leaves ``next()`` to ask with ClaimBatch under the same number, which the cursor answers alike."""
        self._cursor.dense.claim_answer = None
        self._cursor.dense.claim_ask = (self.number + 1, self.batches_per_epoch)

    def next(self) -> int:
        """The global index of this trainer's next batch; the previous one counts as trained."""
        dense = self._cursor.dense  # the claim rides on its pushes (trainer.channels.dense_calls)
        answer, dense.claim_ask, dense.claim_answer = dense.claim_answer, None, None
        if answer is not None and answer[0] == self.number + 1:
            self.number += 1
            batch, reissued = answer[1], answer[2]
            self.with_push += 1
        else:
            reply = self._ask(release=False)
            batch, reissued = reply.batch, reply.reissued
        self.reissued += int(reissued)
        self.batch = batch
        self.claimed.append(batch)
        return batch

    def release(self) -> None:
        """The last batch was trained and no more is wanted (sent before the Leave)."""
        self._cursor.dense.claim_ask = None
        if self.number:
            self._ask(release=True)
            self.batch = None
