"""A dense slice's calls to one shard partition: Init, Pull, Push, PushPull and the window's numbered PushPull,
with the headers they send and what a push's answer is counted as.

``DenseCalls`` is a collaborator of ``ShardClient`` (trainer.channels.client), its own because these are the step's
calls: the chunk streams (psserver.protocol.fastwire; a one-chunk push as a unary call) and the push under way
(trainer.channels.dense_push over trainer.channels.push_numbers) meet here, every one sent through
``RetriedCalls.call`` (trainer.channels.call_retry).  It makes its call objects on the channel it is handed and owns
what its pushes carry besides the gradient: the push under way (``outgoing``), the last push's answer, the
trainer's leave and the data-cursor claim.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from psserver.protocol.codec import ChunkReader, encode_raw, wire_tensor
from psserver.protocol.fastwire import parse_chunk, serialize_chunk
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rules import STALE, stale_version
from psserver.protocol.stubs import method
from trainer.channels.call_retry import PUSH_RETRYABLE, Caller, RetriedCalls
from trainer.channels.compress import TopK
from trainer.channels.dense_push import OutgoingPush

log = logging.getLogger("trainer.channels.client")  # the client's lines, as before the split (trainer.running.cli sets its level)


def claim_fields(ask: tuple[int, int] | None) -> dict:
    return {} if ask is None else dict(claim=ask[0], batches_per_epoch=ask[1])


@dataclass(frozen=True)
class PushOutcome:
    outcome: str  # "applied" | "accepted" | "duplicate" | "scaled" | "stale"
    version: int  # the shard's version after the push
    staleness: int


class DenseCalls:
    """The dense slice's data calls and the push numbering they go through (``outgoing``).

    Handed the ``channel`` it calls on, the ``Caller`` its requests name, the ``RetriedCalls`` every call goes
    through, and ``lock``: the counters' one lock, which also hands out a windowed push's number."""

    def __init__(self, channel: grpc.Channel, caller: Caller, calls: RetriedCalls, lock: threading.Lock,
                 chunk_bytes: int, call_timeout: float, compressor: TopK | None = None):
        self.caller, self.calls, self.lock = caller, calls, lock
        self.chunk_bytes, self.call_timeout = chunk_bytes, call_timeout
        self.outgoing = OutgoingPush(chunk_bytes, compressor)  # the next push's number and kept pairs
        self.last_answer: tuple[int, PushOutcome] | None = None  # (sequence, outcome) of the last answered push
        self.leaving = False  # pushes from now on say this trainer's last gradient (ChunkHeader.leaving)
        # shard 0 partition 0 of an async elastic job (trainer.membership.data_claims): (claim number, batches per
        # epoch) the next push also claims, and (claim number, batch, re-issued) a PushPull reply granted
        self.claim_ask: tuple[int, int] | None = None
        self.claim_answer: tuple[int, int, bool] | None = None
        # Chunk streams bypass the generated classes (psserver.protocol.fastwire: same bytes, fewer copies).
        self._init = channel.stream_unary(method("Init"), serialize_chunk, _pb.InitReply.FromString)
        self._push = channel.stream_unary(method("Push"), serialize_chunk, _pb.PushReply.FromString)
        # A one-chunk push sent as a unary call on the same method: the bytes on the wire are those of a
        # client stream with one message, but gRPC Python starts no request-consuming thread for it.
        self._push_one = channel.unary_unary(method("Push"), serialize_chunk, _pb.PushReply.FromString)
        self._pull = channel.unary_stream(method("Pull"), _pb.PullRequest.SerializeToString, parse_chunk)
        self._push_pull = channel.stream_stream(method("PushPull"), serialize_chunk, parse_chunk)
        self._push_pull_one = channel.unary_stream(method("PushPull"), serialize_chunk, parse_chunk)

    def _header(self, wire: int, length: int, version: int = 0, num_samples: int = 0,
                sequence: int = 0) -> _pb.ChunkHeader:
        c = self.caller
        return _pb.ChunkHeader(rank=c.rank, trainer_id=c.trainer_id, fingerprint=c.fingerprint,
                               dtype=wire, length=length, version=version, num_samples=num_samples,
                               sequence=sequence, partition=c.partition, leaving=self.leaving,
                               layout_epoch=c.layout_epoch,
                               **claim_fields(self.claim_ask))

    def init(self, values: torch.Tensor, wire: int) -> _pb.InitReply:
        payload = wire_tensor(values, wire)
        header = self._header(wire, values.numel())
        reply = self.calls.call("Init", lambda: self._init(encode_raw(payload, header, self.chunk_bytes),
                                                           timeout=self.call_timeout))
        self.calls.count("bytes_out", payload.numel() * payload.element_size())
        return reply

    def pull(self, min_version: int, wire: int, length: int, timeout: float,
             out: torch.Tensor | None = None) -> tuple[int, torch.Tensor, float]:
        """(version, fp32 parameters, seconds the shard waited) at a version >= min_version.

        Waits up to ``timeout`` for the round; the shard reports how much of the
        call was waiting, so the trainer can split wait from transfer.  With
        ``out`` (the model's flat CPU parameters) the weights land there directly.
        """
        c = self.caller
        req = _pb.PullRequest(rank=c.rank, trainer_id=c.trainer_id, fingerprint=c.fingerprint,
                              min_version=min_version, dtype=wire, partition=c.partition,
                              layout_epoch=c.layout_epoch)

        def once():
            reader = ChunkReader(self._pull(req, timeout=timeout))
            values = reader.read(length, wire, max_bytes=1 << 40, require_finite=False, out=out)
            self.calls.count("bytes_in", reader.bytes_read)
            self.calls.saw_epoch(reader.header)
            self.calls.saw_layout(reader.header.layout_epoch)
            return reader.header.version, values, reader.header.wait_seconds

        return self.calls.call("Pull", once)

    def gradient_chunks(self, grad: torch.Tensor, base: int, num_samples: int,
                        wire: int) -> tuple[int, int, list]:
        """(bytes, dense-equivalent bytes, chunks) of a push under the next number (trainer.channels.dense_push;
        a Step's dense part too: trainer.stepping.step_call)."""
        return self.outgoing.chunks(grad, self._header(wire, grad.numel(), base, num_samples), wire)

    @property
    def unanswered(self) -> bool:
        """Whether the last push has had no answer (the next push reuses its number)."""
        return self.outgoing.numbers.unanswered

    def acknowledged(self, outcome: str, version: int, staleness: int, base: int, nbytes: int,
                     dense_bytes: int) -> PushOutcome:
        """Count and log what became of a push (the gradient crossed the wire whatever the outcome); a Step's
        dense part is answered here too (trainer.stepping.step_call)."""
        self.outgoing.answered()
        result = PushOutcome(outcome, version, staleness)
        self.last_answer = (self.outgoing.numbers.sequence, result)
        self.calls.count("bytes_out", nbytes)
        self.calls.count("push_bytes_sent", nbytes)
        self.calls.count("push_bytes_dense", dense_bytes)  # what the same pushes would have sent uncompressed
        if outcome == STALE:
            self.calls.count("stale_pushes")
            log.info("%s dropped a stale gradient (base %d, now %d): catching up", self.caller.name, base,
                     version)
        elif outcome in ("duplicate", "skipped"):
            self.calls.count(f"{outcome}_pushes")
        return result

    def push(self, grad: torch.Tensor, base: int, num_samples: int, wire: int) -> PushOutcome:
        nbytes, dense_bytes, chunks = self.gradient_chunks(grad, base, num_samples, wire)
        send = (lambda: self._push_one(chunks[0], timeout=self.call_timeout)) if len(chunks) == 1 else (
            lambda: self._push(iter(chunks), timeout=self.call_timeout))
        try:
            reply = self.calls.call("Push", send, retry_on=PUSH_RETRYABLE)
        except grpc.RpcError as e:
            version = stale_version(e, base)
            if version is None:
                raise
            return self.acknowledged(STALE, version, version - base, base, nbytes, dense_bytes)
        self.calls.saw_layout(reply.layout_epoch)
        return self.acknowledged(_pb.PushOutcome.Name(reply.outcome).lower(), reply.version, reply.staleness, base,
                                 nbytes, dense_bytes)

    def push_pull(self, grad: torch.Tensor, base: int, num_samples: int, wire: int, timeout: float,
                  out: torch.Tensor | None = None) -> tuple[PushOutcome, torch.Tensor, float, float]:
        """Push, and receive the weights of the version to go on from, in one call.

        Returns (outcome, fp32 weights, seconds until the reply began less the shard's
        wait -- push and apply --, seconds the shard waited for the round).  With
        ``out`` the weights land there directly.  Retried like a push: the sequence
        number makes a retry after a lost reply a DUPLICATE, which still returns weights.
        """
        nbytes, dense_bytes, chunks = self.gradient_chunks(grad, base, num_samples, wire)

        def once():
            t0 = time.perf_counter()
            replies = (self._push_pull_one(chunks[0], timeout=timeout) if len(chunks) == 1 else
                       self._push_pull(iter(chunks), timeout=timeout))
            reader = ChunkReader(replies)  # returns once the first reply chunk is here
            t_first = time.perf_counter()
            values = reader.read(grad.numel(), wire, max_bytes=1 << 40, require_finite=False, out=out)
            self.calls.count("bytes_in", reader.bytes_read)
            return reader.header, values, t_first - t0

        h, values, until_reply = self.calls.call("PushPull", once, retry_on=PUSH_RETRYABLE)
        self.calls.saw_epoch(h)
        self.calls.saw_layout(h.layout_epoch)
        self.take_grant(h)
        outcome = self.acknowledged(_pb.PushOutcome.Name(h.outcome).lower(), h.version, h.staleness, base, nbytes,
                                    dense_bytes)
        return outcome, values, max(0.0, until_reply - h.wait_seconds), h.wait_seconds

    def ask_moved(self, old_slot: int, sequence: int, base: int, wire: int, length: int, timeout: float,
                  out: torch.Tensor) -> PushOutcome:
        """Ask this new owner whether the old layout's slot ``old_slot`` -- lost after its vote -- applied this
        trainer's push of base ``base`` numbered ``sequence`` there (psserver.resharding.handoff.moved_books): "duplicate" (it did)
        or "stale" (its round closed without it), with this slot's weights to go on from in ``out``.  No gradient
        is sent and this slot's own push numbers are not touched; retried like a push (it changes nothing)."""
        header = self._header(wire, 0, base, 0, sequence)
        header.moved_from = old_slot + 1

        def once():
            try:
                reader = ChunkReader(self._push_pull_one(_pb.Chunk(header=header), timeout=timeout))
            except grpc.RpcError as e:
                version = stale_version(e, base)
                if version is None:
                    raise
                return None, version
            reader.read(length, wire, max_bytes=1 << 40, require_finite=False, out=out)
            self.calls.count("bytes_in", reader.bytes_read)
            return reader.header, reader.header.version

        h, version = self.calls.call("PushPull", once, retry_on=PUSH_RETRYABLE)
        outcome = "stale" if h is None else _pb.PushOutcome.Name(h.outcome).lower()
        if h is not None:
            self.calls.saw_layout(h.layout_epoch)
        self.calls.count("stale_pushes" if outcome == STALE else f"{outcome}_pushes")
        return PushOutcome(outcome, version, version - base)

    def take_grant(self, h) -> None:
        """A dense reply's grant of the data-cursor claim its push carried (trainer.membership.data_claims): kept for
        ``BatchClaims.next``, which then needs no ClaimBatch call (PushPull's reply, or a Step's dense part)."""
        if h.batch_granted and self.claim_ask is not None:
            self.claim_answer = (self.claim_ask[0], h.batch, h.batch_reissued)

    def take_sequence(self) -> int:
        """A number of its own for a windowed push (trainer.stepping.windowed): never reused, whatever became of it."""
        with self.lock:
            return self.outgoing.take()  # a plain push's unanswered number is not taken over

    def push_pull_numbered(self, grad: torch.Tensor, base: int, num_samples: int, wire: int, sequence: int,
                           timeout: float, out: torch.Tensor) -> PushOutcome:
        """A windowed push under ``sequence`` (already taken), whose reply's weights land in ``out``.  Retried
        like any push; sent again later by the window under the same number, a shard that applied it answers
        DUPLICATE.  Touches none of the plain push's state, so several may be in flight at once."""
        payload = wire_tensor(grad, wire)
        chunks = list(encode_raw(payload, self._header(wire, grad.numel(), base, num_samples, sequence),
                                 self.chunk_bytes))

        def once():
            replies = (self._push_pull_one(chunks[0], timeout=timeout) if len(chunks) == 1 else
                       self._push_pull(iter(chunks), timeout=timeout))
            reader = ChunkReader(replies)
            reader.read(grad.numel(), wire, max_bytes=1 << 40, require_finite=False, out=out)
            self.calls.count("bytes_in", reader.bytes_read)
            return reader.header

        h = self.calls.call("PushPull", once, retry_on=PUSH_RETRYABLE)
        self.calls.saw_layout(h.layout_epoch)
        nbytes = payload.numel() * payload.element_size()
        for name in ("bytes_out", "push_bytes_sent", "push_bytes_dense"):
            self.calls.count(name, nbytes)
        outcome = _pb.PushOutcome.Name(h.outcome).lower()
        if outcome in ("stale", "duplicate", "skipped"):
            self.calls.count("stale_pushes" if outcome == "stale" else f"{outcome}_pushes")
        return PushOutcome(outcome, h.version, h.staleness)

    def next_sequence(self) -> int:
        """The number the next push will carry (the unanswered one again, if there is one)."""
        return self.outgoing.numbers.upcoming()

    def resend_after_restart(self) -> bool:
        """The shard restarted and forgot the last push: True if the next push sends it again under a new
        number, False if it was abandoned (trainer.channels.dense_push.OutgoingPush.after_restart)."""
        return self.outgoing.after_restart()

    def abandon_push(self) -> None:
        """Give up on the unanswered push (the shard restarted and forgot it): the next push gets a new number."""
        self.outgoing.abandon()
