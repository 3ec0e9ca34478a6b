"""A step's whole exchange with each shard in one call (the Step RPC): the dense gradient slice, every table's
gradient rows and, with prefetch on, the next batch's ids out; the weights and those rows back.

Why: a step used to make a call a shard for each table and one for the dense slice (PushRows then PushPull
without prefetch; PushPull beside a table's PushPullRows on the tables' thread with it,
trainer.stepping.table_push); each crossed gRPC Python's fixed costs on both ends.  Here one
stream carries both as parts (psserver.protocol.stepwire), the shard runs each part through the handler of its
own RPC, and the replies come back on the same stream.

Nothing here decides anything new.  The numbers are the parts' own (the dense slot's sequence, each table
lane's), taken exactly as the two-call path takes them, and each reply is taken in by the same code
(DenseCalls.acknowledged, ShardedRows.part_answered).  A lost reply is retried as a Step under the same
numbers (the shard answers DUPLICATE to each part and still streams the weights and rows).  Whatever else fails
on a shard -- a restart, a refusal, a stale table push -- leaves that shard's parts unanswered under their
numbers, and step() goes on with the two-call path, which retries just those parts and handles each case as it
always has (trainer.stepping.step).  Used only unpartitioned, without the overlap, early-push, pipelined or windowed dense
variants, with the async tables' window (trainer.tables.table_window) idle, and while a step's payload to a shard stays
under MAX_STEP_BYTES.
While it is used, an async table's next batch rides on the step too (trainer.tables.row_prefetch ``fold_async``): its
part carries the ids and the shard answers at once, so sync dense + async tables also make one call a shard a step.
A small step (one request message, a reply sure to be packed) goes on the unary StepOnce RPC, the same parts served
by a unary handler on the shard (docs/prefetch.md).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc
import torch

from psserver.protocol import limits
from psserver.protocol.codec import TORCH_DTYPES, ChunkReader
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.stepwire import StepMessage, one_message, parse_step, serialize_step
from psserver.protocol.stubs import method
from trainer.stepping.attempt import StepAttempt, moved_everywhere, rejoins_on
from trainer.channels.client import PUSH_RETRYABLE, ShardClient
from trainer.stepping.clipping import clip_local_
from trainer.stepping.exchange import DenseExchange
from trainer.stepping.stepper import StepInfo
from trainer.stepping.table_push import TablePush
from trainer.tables.sparse_client import ShardedRows

log = logging.getLogger("trainer.stepping.step_call")

# A step's payload to one shard above this goes the two-call way: a Step's request is held whole by the shard
# before any part runs (psserver.serving.service.Step), which suits a step's rows and a small dense slice, not a big one.
MAX_STEP_BYTES = 64 << 20


class StepReplyBroken(Exception):
    """A Step reply the trainer could not take in (a part missing or malformed): the two-call path retries."""


class StepCall:
    """The one-call step over ``exchange``'s slots and ``table_push``'s tables; ``rows()``: the ShardedRows
    (bound after joining), ``enabled`` False: always two calls."""

    def __init__(self, exchange: DenseExchange, table_push: TablePush, rows: Callable[[], object]):
        self.exchange, self.table_push, self._rows = exchange, table_push, rows
        self.client = exchange.client
        self.enabled = True
        self.one_reply = True  # ask for the reply in one message (StepChunk.one_reply); False: the reply streams
        self.unary = True  # read a reply sure to be packed with a unary call; False: as a one-message stream
        self.once = True  # ... on the unary StepOnce RPC; False: as a unary call on Step
        self.moved: int | None = None  # the last step's newest layout when every shard refused it layout-moved
        self.relaid()

    def relaid(self) -> None:
        """The Step stubs over the client's shards' channels (again after a layout switch, trainer.membership.relayout)."""
        self._stubs = [s.channel.stream_stream(method("Step"), serialize_step, parse_step) for s in self.client.shards]
        # A step of at most one chunk's bytes goes as one message (StepChunk.more) on the same method: the bytes
        # are those of a one-message stream, but gRPC Python starts no request-consuming thread for it.
        self._one = [s.channel.unary_stream(method("Step"), serialize_step, parse_step) for s in self.client.shards]
        # ... and a small step whose reply is sure to come as one message (one_reply, under the protocol's bound)
        # as a unary call: no reply-stream machinery (a thread hop and a wake-up a message) on this side.
        self._unary = [s.channel.unary_unary(method("Step"), serialize_step, parse_step) for s in self.client.shards]
        # ... and served by the shard's unary StepOnce handler: no request-stream reads or reply-stream writes there
        self._once = [s.channel.unary_unary(method("StepOnce"), serialize_step, parse_step)
                      for s in self.client.shards]

    def usable(self, variants_off: bool) -> bool:
        """Whether this step can go as one call a shard: nothing half done from a failed step, one slot a shard."""
        ex, rows = self.exchange, self._rows()
        # (an async table's push window is passed by, not waited on, while it is idle: in a sync job the dense
        # reply is waited for anyway, and the table's acknowledgement rides on it -- docs/push-window.md)
        usable = (self.enabled and variants_off and isinstance(rows, ShardedRows)
                  and (rows.window is None or rows.window.idle())
                  and ex.prefetch is None
                  and ex.early is None and ex.slots.job.partitions == 1 and ex.attempt is None
                  and not self.table_push.pending() and not self.table_push.any_pushed()
                  and not ex.session.resume_dense
                  and ex.slots.num_parts and max(e - s for s, e in ex.slots.ranges) * 4 <= MAX_STEP_BYTES // 2)
        if isinstance(rows, ShardedRows):  # the next batches' async rows ride on the steps' pushes while steps go as one call
            rows.ahead.fold_async = bool(usable)
        return usable

    def step(self, num_samples: int) -> StepInfo | None:
        """One Step call a shard, side by side.  Returns the dense part's info once every slot answered, else
        None; a table some shard did not answer keeps its push (``table_push.pending()``).  Either way the
        caller goes on with the two-call path for what is left."""
        rows, ex = self._rows(), self.exchange
        plans = []
        for t in self.table_push.tables:
            ids, grads = t.take_outgoing()
            plans.append((t, rows.begin_push(t.name, ids, grads, num_samples)))
        grad = ex.slots.flat.gather_grads()
        clip_local_(ex.slots.flat.params, ex.clip_grad_norm)
        attempt = ex.attempt = StepAttempt(todo=set(range(ex.slots.num_parts)))
        attempt.produced = ex.slots.produced()
        t0 = time.perf_counter()
        refusals: dict[int, Exception] = {}
        try:
            results = self.client.map_settled(lambda s: self._shard(s, grad, num_samples, attempt, plans, refusals),
                                              None, attempt.inflight)
        finally:  # (also on an interrupt: a claimed batch's rows are then pulled by the prefetch itself)
            for _, plan in plans:
                rows.unclaim_rest(plan)
            ex.slots.staging.settle()
        tables_left = False
        for j, (t, plan) in enumerate(plans):
            try:
                rows.end_push(plan, [results[s][j] for s in plan.todo])
            except Exception:  # noqa: BLE001 -- kept for the two-call retry (trainer.stepping.table_push), which raises it
                tables_left = True
                continue
            t.outgoing_pushed()
            self.table_push.mark_pushed(t.name)
        # every shard refused the whole call layout-moved: nothing applied anywhere (trainer.stepping.step re-routes it)
        self.moved = (moved_everywhere(refusals, attempt.applied())
                      if len(refusals) == len(self.client.shards) else None)
        if attempt.todo or tables_left:
            self.client.count("step_calls_fallen_back")
        return None if attempt.todo else ex.finished(attempt, time.perf_counter() - t0)

    def _shard(self, s: ShardClient, grad: torch.Tensor, num_samples: int, attempt: StepAttempt,
               plans: list, refusals: dict) -> list:
        """One shard's Step: each table's outcome there, or the Exception that left its part to do (kept in
        ``refusals`` by shard)."""
        try:
            return self._shard_call(s, grad, num_samples, attempt, plans)
        except Exception as e:  # noqa: BLE001 -- before or after the call: this shard's parts stay to do
            if isinstance(e, grpc.RpcError) and rejoins_on(e):
                return self._restarted_shard(s, grad, num_samples, attempt, plans, refusals, e)
            refusals[s.index] = e
            return [e] * len(plans)

    def _restarted_shard(self, s: ShardClient, grad: torch.Tensor, num_samples: int, attempt: StepAttempt,
                         plans: list, refusals: dict, cause: grpc.RpcError) -> list:
        """A shard whose Step found it restarted is caught up at once, on its own thread, the two-call way: each
        table's push, then the dense slot's (trainer.stepping.exchange.exchange_slot) -- the first to find the restart
        rejoins the shard, and the dense slot's gradient goes again from the version it came back at.  Left
        until every shard's part settled, it could wait for ever: this trainer's part on another shard may wait
        for a peer's next step there, while the peer's resend here waits for this trainer's push (a trainer a
        step ahead when the shard died).  What still fails stays to do, as before."""
        self.client.count("step_calls_restarted")
        log.info("rank %d: shard %d answered the Step %s (%s): its parts go the two-call way now", s.caller.rank,
                 s.index, cause.code().name, cause.details())
        rows, outcomes = self._rows(), []
        for _, plan in plans:
            try:
                outcomes.append(rows.push_alone(s, plan))
            except Exception as e:  # noqa: BLE001 -- left to do (kept by end_push for the two-call retry)
                outcomes.append(e)
        try:
            self.exchange.exchange_slot(s, grad, num_samples, attempt)
        except Exception as e:  # noqa: BLE001 -- the slot stays in attempt.todo
            refusals[s.index] = e
        return outcomes

    def _unary_call(self, s: ShardClient, request: StepMessage, timeout: float) -> StepMessage:
        """A small Step as StepOnce (``once`` False: as a unary call on Step -- the same parts through the stream
        handler, for diagnosis and the tests that compare the two)."""
        if not self.once:
            return self._unary[s.index](request, timeout=timeout)
        reply = self._once[s.index](request, timeout=timeout)
        s.calls.count("step_calls_once")
        return reply

    def _shard_call(self, s: ShardClient, grad: torch.Tensor, num_samples: int, attempt: StepAttempt,
                    plans: list) -> list:
        slots, i = self.exchange.slots, s.slot
        attempt.sequences.setdefault(i, s.dense.next_sequence())
        base = slots.versions[i]
        nbytes, dense_bytes, chunks = s.dense.gradient_chunks(
            slots.staging.to_host(i, slots.slice(grad, i), attempt.produced), base, num_samples, slots.client.wire)
        rows = self._rows()
        parts = [rows.part_request(s, plan) for _, plan in plans]
        msgs = [StepMessage(0, dense=c) for c in chunks]
        for k, part in enumerate(parts, 1):
            msgs += [StepMessage(k, rows=c) for c in part.chunks]
        msgs[0].one_reply = self.one_reply
        tries = []
        timeout = max(self.exchange.round_timeout, s.call_timeout)
        small = nbytes + sum(len(c.ids) + len(c.rows) for p in parts for c in p.chunks) <= s.chunk_bytes
        unary = (small and self.one_reply and self.unary
                 and _reply_bytes(slots, i, parts) <= limits.ONE_REPLY_UNARY_BYTES)

        def once() -> dict[int, list]:
            tries.append(1)
            replies: dict[int, list] = {k: [] for k in range(len(parts) + 1)}
            if unary:
                call = [self._unary_call(s, one_message(msgs, True), timeout)]
            else:
                call = (self._one[s.index](one_message(msgs, self.one_reply), timeout=timeout) if small else
                        self._stubs[s.index](iter(msgs), timeout=timeout))
            for message in call:  # one message when one_reply was asked for and the reply fit (psserver.serving.step_reply)
                if message.malformed:
                    raise StepReplyBroken(message.malformed)
                for m in message.flat():
                    if m.part not in replies:
                        raise StepReplyBroken(f"a reply part {m.part} that was not asked for")
                    replies[m.part].append(m.dense if m.dense is not None else m.rows)
            return replies

        t0 = time.perf_counter()
        replies = s.calls.call("Step", once, retry_on=PUSH_RETRYABLE)  # raised: this shard's parts stay to do
        s.calls.count("step_calls")
        if unary:
            s.calls.count("step_calls_unary")
        try:
            self._dense_answer(s, replies[0], nbytes, dense_bytes, base, attempt, t0)
        except Exception:  # noqa: BLE001 -- left to do: the retry is answered DUPLICATE, with the weights
            self.client.count("step_replies_broken")
        return [self._table_answer(s, part, replies[k], len(tries)) for k, part in enumerate(parts, 1)]

    def _dense_answer(self, s: ShardClient, chunks: list, nbytes: int, dense_bytes: int, base: int,
                      attempt: StepAttempt, t0: float) -> None:
        """The dense part's reply taken in as PushPull's (trainer.stepping.exchange._push_pull)."""
        slots, i = self.exchange.slots, s.slot
        if not chunks:
            raise StepReplyBroken("the reply has no dense part")
        target = slots.slice(slots.flat.flat, i)
        reader = ChunkReader(iter(chunks))
        reader.read(target.numel(), slots.client.wire, max_bytes=1 << 40, require_finite=False,
                    out=slots.staging.weights_buffer(i, target))
        s.calls.count("bytes_in", reader.bytes_read)
        h = reader.header
        s.calls.saw_epoch(h)
        s.calls.saw_layout(h.layout_epoch)  # as PushPull's reply teaches it (trainer.membership.relayout)
        s.dense.take_grant(h)  # the claim its dense part carried: the next batch needs no ClaimBatch
        out = s.dense.acknowledged(_pb.PushOutcome.Name(h.outcome).lower(), h.version, h.staleness, base, nbytes,
                                   dense_bytes)
        with torch.no_grad():
            slots.staging.weights_to_device(i, target)
        slots.versions[i] = out.version
        attempt.staleness[i] = out.staleness
        attempt.timings[i] = (0.0, time.perf_counter() - t0 - h.wait_seconds, h.wait_seconds)
        attempt.record(i, out.outcome)

    def _table_answer(self, s: ShardClient, part, chunks: list, tries: int) -> str | Exception:
        """A table part's reply taken in as PushPullRows' (or PushRows'); a missing one leaves it to do."""
        if not chunks or not chunks[0].HasField("header"):
            self.client.count("step_replies_broken")
            return StepReplyBroken(f"the reply of table {part.table!r} is missing")
        first = chunks[0]
        pulled = None if part.pull_ids is None else (first.header.version, b"".join(c.rows for c in chunks),
                                                     first.header.pull_ref)
        return self._rows().part_answered(s, part, first.header.push, pulled, tries)


def _reply_bytes(slots, i: int, parts: list) -> int:
    """The weights and rows a Step's reply from slot ``i`` carries, headers aside: known before the call, so a
    reply sure to be packed (psserver.serving.step_reply) can be read with a unary call."""
    start, end = slots.ranges[i]
    rows = sum(len(p.pull_ids) * p.dim * 4 for p in parts if p.pull_ids is not None)
    return (end - start) * TORCH_DTYPES[slots.client.wire].itemsize + rows
