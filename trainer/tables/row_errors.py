"""A table call that failed for good on some shards: what ``ShardedRows.pull`` and ``push`` raise (and a table
window re-raises), in a room of its own so that the window (trainer.tables.table_window) and the client
(trainer.tables.sparse_client) both import it and not each other."""

from __future__ import annotations

from trainer.channels.client import ShardCallsFailed


class RowsCallFailed(ShardCallsFailed):
    """A row call that failed for good on some shards (after retries); ``code()`` is the first failing shard's.

    ``failed``: shard -> error, each named with its address in the message; ``done``: shards that answered.
    """

    what = "pull"
    advice = "the rows of the other shards were read; call pull() again"

    def __init__(self, table: str, done: list[int], failed: dict, addresses: list[str]):
        self.done, self.table = done, table
        super().__init__(f"{self.what} of table {table!r} failed ({self.causes(failed, addresses)}); shards {done} "
                         f"answered; {self.advice}", failed)


class RowsPushFailed(RowsCallFailed):
    """A row push that did not complete on every shard.  The gradients are kept: ``push`` again for the
    same table retries the failed shards under the same sequence numbers (a shard that did apply it
    answers DUPLICATE)."""

    what = "push"
    advice = "call push() again to retry the others with the same gradients"
