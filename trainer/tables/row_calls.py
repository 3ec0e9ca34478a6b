"""One row call to one shard: PullRows, PushRows and PushPullRows on the shard's channel, retried.

``ShardedRows`` (trainer.tables.sparse_client) splits a table's ids among the shards, fans the calls out and keeps
the lanes' book (trainer.tables.row_lanes); this room makes one call to one shard through the shard client's retry
discipline (``ShardClient.calls``, trainer.channels.call_retry: backoff, budget, logging), its retries also counted
in the rows' counters.  A push's retry resends the
same chunks under the same number, so a shard that applied it answers DUPLICATE.
"""

from __future__ import annotations

from typing import Callable

import grpc

from psserver.protocol.fastwire import parse_rows_chunk, serialize_rows_chunk
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rows import idpack
from psserver.protocol.stubs import method
from trainer.channels.client import PUSH_RETRYABLE, ShardClient


class RowCalls:
    """The row methods of every shard's channel (``shards``: partition 0 of each); ``count(**amounts)`` adds
    to the rows' counters."""

    def __init__(self, shards: list[ShardClient], count: Callable[..., None]):
        self._count = count
        # RowsChunks read and written without protobuf objects for their rows (psserver.protocol.fastwire)
        self._pull = [s.channel.unary_stream(method("PullRows"), _pb.PullRowsRequest.SerializeToString,
                                             parse_rows_chunk) for s in shards]
        self._push = [s.channel.stream_unary(method("PushRows"), serialize_rows_chunk,
                                             _pb.PushRowsReply.FromString) for s in shards]
        self._push_pull = [s.channel.stream_stream(method("PushPullRows"), serialize_rows_chunk,
                                                   parse_rows_chunk) for s in shards]

    def call(self, shard: ShardClient, what: str, fn, retry_on=(grpc.StatusCode.UNAVAILABLE,)):
        """The shard client's retry loop (``calls.call``: policy, backoff, logging), with row retries also counted
        here."""
        attempts = 0

        def once():
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                self._count(retries=1)
            return fn()

        return shard.calls.call(what, once, retry_on=retry_on)

    def pull(self, s: ShardClient, table: str, min_version: int, ids) -> tuple[int, bytes, int, int]:
        """One PullRows call of ``ids`` (int64 CPU) at ``min_version`` or later, remembered by the shard (ids
        once): (the table's version, the rows' bytes, the pull's reference (0: not kept), the ids' bytes sent --
        packed when ascending, psserver.protocol.rows.idpack)."""
        c = s.caller
        req = _pb.PullRowsRequest(rank=c.rank, trainer_id=c.trainer_id, fingerprint=c.fingerprint, table=table,
                                  min_version=min_version, remember=True, layout_epoch=c.layout_epoch)
        if idpack.packable(ids):
            req.packed_ids = idpack.pack(ids)
        else:
            req.ids = ids.contiguous().numpy().tobytes()

        def once():
            chunks = iter(self._pull[s.index](req, timeout=s.call_timeout))
            first = next(chunks)
            s.calls.saw_layout(first.header.layout_epoch)  # as a dense reply teaches it (trainer.membership.relayout)
            raw = b"".join([first.rows, *(c.rows for c in chunks)])
            return first.header.version, raw, first.header.pull_ref, len(req.ids) + len(req.packed_ids)

        return self.call(s, "PullRows", once)

    def push(self, s: ShardClient, chunks: list, fused: bool) -> tuple[_pb.PushRowsReply, tuple | None, int]:
        """One push of ``chunks`` (``fused``: a PushPullRows, its header naming the ids to pull), retried after
        a lost reply: (the push's reply, (version, rows' bytes, the pull's reference) or None, how many times it
        was sent -- a DUPLICATE to the first send is not a lost reply's retry)."""
        sent = 0

        def send():
            nonlocal sent
            sent += 1
            if not fused:
                return self._push[s.index](iter(chunks), timeout=s.call_timeout), None
            replies = iter(self._push_pull[s.index](iter(chunks), timeout=s.call_timeout))
            first = next(replies)  # the whole reply is read here: a cut stream is retried as a lost reply
            return first.header.push, (first.header.version, b"".join([first.rows, *(c.rows for c in replies)]),
                                       first.header.pull_ref)

        reply, pulled = self.call(s, "PushPullRows" if fused else "PushRows", send, retry_on=PUSH_RETRYABLE)
        return reply, pulled, sent
