"""An async or stale-timeout trainer's claims on the job's data cursor (docs/elastic.md "Data follows membership").

The cursor is on shard 0 partition 0 (psserver.data_cursor): ``next()`` asks it for the global index of this
trainer's next batch, numbering the claims 1, 2, 3, ... so that a retry after a lost reply (same number) gets
the same batch and the next number says the previous batch was trained.  ``release()`` after the last step, before
the Leave, says that last batch was trained too; a trainer that leaves without it has its batch re-issued.
"""

from __future__ import annotations

from psserver.protocol.proto import ps_pb2 as _pb
from trainer.client import ShardClient

CLAIM_TIMEOUT_SECONDS = 30.0  # one attempt; a lost reply is retried under the same claim number


class BatchClaims:
    def __init__(self, cursor: ShardClient, batches_per_epoch: int):
        self._cursor, self.batches_per_epoch = cursor, batches_per_epoch
        self.number = 0  # the newest claim sent
        self.batch: int | None = None  # the batch it was granted
        self.reissued = 0  # batches granted that a trainer before this one claimed and did not train
        self.claimed: list[int] = []  # every batch granted, in order (the trainer's summary, tests)

    def _ask(self, release: bool) -> _pb.ClaimReply:
        reply = self._cursor.claim_batch(self.number + 1, self.batches_per_epoch, release, CLAIM_TIMEOUT_SECONDS)
        self.number += 1
        return reply

    def next(self) -> int:
        """The global index of this trainer's next batch; the previous one counts as trained."""
        reply = self._ask(release=False)
        if reply.reissued:
            self.reissued += 1
        self.batch = reply.batch
        self.claimed.append(reply.batch)
        return reply.batch

    def release(self) -> None:
        """The last batch was trained and no more is wanted (sent before the Leave)."""
        if self.number:
            self._ask(release=True)
            self.batch = None
