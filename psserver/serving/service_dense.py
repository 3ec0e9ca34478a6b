"""The dense RPCs' halves (Init, Push, PushPull, Pull): a gradient stream bounded, identified, read into a receive
buffer and handed to the shard; the weights of a version streamed back.  A room of the servicer
(psserver.serving.service.ParameterServerService makes one and hands it what it calls; its handlers call these and
map errors), whose halves Step's dense part reuses (psserver.serving.service_step).
"""

from __future__ import annotations

import asyncio

import torch

from psserver.partition.shard import PushResult, Shard
from psserver.protocol.codec import (
    ChunkAssembler,
    TopKAssembler,
    check_finite,
    check_stream_header,
    encode_raw,
)
from psserver.protocol.errors import InvalidRequest, ShuttingDown, StaleGradient, WaitTimeout
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rules import STALE
from psserver.serving.replies import ReplyStream
from psserver.serving.service_common import (
    _OUTCOMES,
    StreamEndedEarly,
    _check_header_fields,
    _check_identity,
    _claim_answer,
    _decoded,
    _no_slot,
    _StreamReader,
    require_handoffs,
)
from psserver.state import modes


class DenseRpcs:
    """Init, Push, PushPull and Pull's work, and the dense halves Step reuses (``check_push_first``,
    ``read_tensor``, ``check_and_push``, ``pull_pushed``).  Handed the servicer's layouts, runtime, limits,
    shard-wide count, call slots (psserver.serving.call_slots) and live re-shard calls; ``shard_id`` names the
    shard in its refusals."""

    def __init__(self, layouts, runtime, cfg, count, slots, handoffs, shard_id: int):
        self.layouts, self.runtime, self.cfg, self.count = layouts, runtime, cfg, count
        self.slots, self.handoffs, self.shard_id = slots, handoffs, shard_id

    async def init(self, request_iterator, context):
        with self.slots.peer_slot(context):
            reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self.slots.deadline(context))
            first, h = await reader.first_header()
            _check_header_fields(h)
            part = self.layouts.part(h.layout_epoch, h.partition)
            # who is asking, before a byte of the payload is read
            if not part.pulls.check_init_header(h.rank, h.trainer_id, h.fingerprint):
                return _pb.InitReply(version=part.version, accepted=False)
            values = await self.read_tensor(part, reader, first, h)
            accepted, version = await self.runtime.run_state(self._check_and_init, part, h, values)
            return _pb.InitReply(version=version, accepted=accepted)

    async def push(self, request_iterator, context):
        with self.slots.peer_slot(context):
            h, r = await self._receive_push(request_iterator, context, stale_as_result=False)
            part = self.layouts.part(h.layout_epoch, h.partition)
            if self.runtime.holds.held(part, r.version) is not None:  # a reply naming R waits for DECIDE
                await self.runtime.holds.wait(part, r.version, self.slots.deadline(context) - 0.25)
            return _pb.PushReply(outcome=_OUTCOMES[r.outcome], version=r.version, staleness=r.staleness,
                                 layout_epoch=self.layouts.newest)

    async def push_pull(self, request_iterator, context, slot: bool = True) -> None:
        """PushPull's work (also a Step's dense part, whose call holds the rank's slot: ``slot`` False)."""
        h, r = await self._receive_push(request_iterator, context, stale_as_result=True, slot=slot)
        await self.pull_pushed(h, r, context)

    async def _receive_push(self, request_iterator, context, stale_as_result: bool, slot: bool = True):
        """Bound, identify, read and hand one pushed gradient to the shard: (header, PushResult)."""
        reader = _StreamReader(request_iterator, self.cfg.stream_idle_timeout, self.slots.deadline(context))
        first, h = await reader.first_header()
        _check_header_fields(h)  # (a question for an old slot too: its ids and numbers bounded as every push's)
        if h.moved_from:  # a question for an old slot that could not be reached (psserver.resharding.handoff.moved_books)
            return h, await self._moved_push(h, stale_as_result)
        part = self.check_push_first(h)
        length = part.slice_length()
        async with (self.slots.rank_slot(h.rank, h.partition) if slot else _no_slot()), \
                self.runtime.buffers.take(length) as held:
            grad = await self.read_tensor(part, reader, first, h, out=held.buffer, sparse=True)
            try:
                result, spare = await held.hand_over(self.runtime.run_state(self.check_and_push, part, h, grad))
            except StaleGradient as e:
                if not stale_as_result:
                    raise
                result = PushResult(STALE, e.version, e.staleness)  # counted by the shard; the reply catches up
            else:
                held.buffer = spare
        return h, result

    def check_push_first(self, h: _pb.ChunkHeader) -> Shard:
        """A dense push's header, checked before a byte of its payload is read: the partition it names."""
        _check_header_fields(h)
        part = self.layouts.push_part(h.layout_epoch, h.partition, h.version)  # the layout first, then its fingerprint
        part.dense_pushes.check_push_header(h.rank, h.trainer_id, h.fingerprint, h.version, h.num_samples)
        check_stream_header(h, part.slice_length(), part.wire_dtype(), self.cfg.max_push_bytes)  # before allocating
        return part

    async def _moved_push(self, h: _pb.ChunkHeader, stale_as_result: bool) -> PushResult:
        try:
            return await self.runtime.run_state(require_handoffs(self.handoffs).moved_push, h)
        except StaleGradient as e:
            if not stale_as_result:
                raise
            return PushResult(STALE, e.version, e.staleness)

    async def read_tensor(self, part: Shard, reader: _StreamReader, first, h: _pb.ChunkHeader,
                           out: torch.Tensor | None = None, sparse: bool = False) -> torch.Tensor:
        """The stream's chunks, checked and copied (into ``out`` if given) as they arrive; finite-checked later.

        ``sparse`` (pushes): a header with topk > 0 is read as top-k pairs, bounded, and scattered into ``out``
        as a dense slice; elsewhere (Init) such a header is refused."""
        assembler = TopKAssembler if sparse and h.topk else ChunkAssembler
        asm = assembler(h, part.slice_length(), part.wire_dtype(), self.cfg.max_push_bytes,
                        out=out, min_chunk_bytes=self.cfg.min_chunk_bytes)
        chunk = first
        while chunk is not None:
            asm.add(chunk)
            chunk = await reader.next()
        if isinstance(asm, ChunkAssembler) and asm.pos < asm.length:  # the stream ended before its chunks were whole
            raise StreamEndedEarly(f"the chunks cover [0, {asm.pos}) but the slice is [0, {asm.length})")
        values = asm.finish(require_finite=False)
        self.count("bytes_in", asm.bytes_read)
        if h.topk and sparse:
            self.count("topk_pushes")
        return values

    @staticmethod
    def _check_and_init(part: Shard, h: _pb.ChunkHeader, values: torch.Tensor):
        check_finite(values)
        return part.init(h.rank, h.trainer_id, h.fingerprint, values, True)

    def check_and_push(self, part: Shard, h: _pb.ChunkHeader, grad: torch.Tensor):
        """On the state worker, in one hop: refuse NaN/Inf (--nonfinite refuse) or note them (skip), then push.

        One thread for all of a shard's tensor work: a second pool for the finite check cost a second hop per
        push and a second set of OpenMP threads spinning on the trainers' cores (ps-bench: -5 to -15% CNN).
        """
        if self.cfg.nonfinite == "refuse":
            check_finite(grad)
            finite = True
        else:
            finite = bool(torch.isfinite(grad).all())
        return part.push(h.rank, h.trainer_id, h.fingerprint, h.version, h.num_samples, grad, h.sequence, finite,
                         leaving=h.leaving, claim=(h.claim, h.batches_per_epoch) if h.claim else None)

    # ------------------------------------------------------------------ streams out
    async def pull(self, request, context: ReplyStream):
        request = _decoded(request)
        _check_identity(request)
        part = self.layouts.pull_part(request.layout_epoch, request.partition, request.min_version)
        wire = request.dtype or part.wire_dtype()
        if wire not in (_pb.FLOAT32, part.wire_dtype()):
            raise InvalidRequest(
                f"pull dtype is {wire} but this job sends {part.wire_dtype()} (or FLOAT32)")
        await self._stream_weights(part, request.rank, request.trainer_id, request.fingerprint,
                                   request.min_version, wire, context, partition=request.partition)

    async def _stream_weights(self, part: Shard, rank: int, trainer_id: str, fingerprint: str, min_version: int,
                              wire: int, context: ReplyStream, **reply_fields) -> None:
        """Wait (an awaited future, no thread) for ``min_version``, then stream the weights in chunks."""
        part.check_member(rank, trainer_id, fingerprint)
        loop = asyncio.get_running_loop()
        remaining = self.slots.deadline(context) - loop.time()
        # Give up a little before the caller's deadline so it gets our reason, not a bare DEADLINE_EXCEEDED.
        timeout = min(max(0.0, remaining - 0.25), self.cfg.max_pull_wait)
        t0 = loop.time()
        if not await self.runtime.part_waiters(part).wait(min_version, timeout):
            raise WaitTimeout(part.pulls.pull_wait_message(min_version, timeout))
        if self.runtime.holds.held(part, part.version) is not None:  # version R waits for DECIDE (reply_holds)
            await self.runtime.holds.wait(part, part.version, t0 + timeout)
        waited = loop.time() - t0
        if self.runtime.stopping:
            raise ShuttingDown(f"shard {self.shard_id} is shutting down")
        version, snapshot = await self.runtime.acquire_snapshot(part, rank, trainer_id, fingerprint, wire)
        try:
            nbytes = snapshot.numel() * snapshot.element_size()
            # One buffer however many pulls stream it: counted once for the shard (and once per connection).
            context.hold(("snapshot", snapshot.data_ptr(), nbytes), nbytes)
            self.count("bytes_out", nbytes)
            header = _pb.ChunkHeader(dtype=wire, length=snapshot.numel(), version=version, wait_seconds=waited,
                                     membership_epoch=part.admission.epoch_number(version), layout_epoch=self.layouts.newest,
                                     **reply_fields)
            for chunk in encode_raw(snapshot, header, self.cfg.chunk_bytes):
                await context.write(chunk, self.cfg.chunk_bytes)
        finally:
            part.pulls.release_snapshot(snapshot)

    async def pull_pushed(self, h: _pb.ChunkHeader, r, context) -> None:
        """A pushed dense gradient's reply: the weights of the version to go on from (PushPull's second half)."""
        part = self.layouts.part(h.layout_epoch, h.partition)
        wanted = modes.reply_version(part.mode_config(), r.outcome, h.version, r.version)
        await self._stream_weights(part, h.rank, h.trainer_id, h.fingerprint, wanted, part.wire_dtype(),
                                   context, outcome=_OUTCOMES[r.outcome], staleness=r.staleness,
                                   partition=h.partition, **_claim_answer(part, h))
