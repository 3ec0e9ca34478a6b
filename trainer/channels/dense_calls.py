"""A dense slice's calls to one shard partition: Init, Pull, Push, PushPull and the window's numbered PushPull,
with the headers they send and what a push's answer is counted as.

A room of ``ShardClient`` (trainer.channels.client mixes ``DenseCalls`` in), its own because these are the step's calls:
the chunk streams (psserver.protocol.fastwire; a one-chunk push as a unary call) and the push under way
(trainer.channels.dense_push over trainer.channels.push_numbers) meet here, every one sent through ``RetriedCalls._call``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc
import torch

from psserver.protocol.codec import ChunkReader, encode_raw, wire_tensor
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rules import STALE, stale_version
from trainer.channels.call_retry import PUSH_RETRYABLE

log = logging.getLogger("trainer.channels.client")  # the client's lines, as before the split (trainer.running.cli sets its level)


def claim_fields(ask: tuple[int, int] | None) -> dict:
    return {} if ask is None else dict(claim=ask[0], batches_per_epoch=ask[1])


@dataclass(frozen=True)
class PushOutcome:
    outcome: str  # "applied" | "accepted" | "duplicate" | "scaled" | "stale"
    version: int  # the shard's version after the push
    staleness: int


class DenseCalls:
    """The dense slice's data calls and the push numbering they go through (``outgoing``)."""

    def _header(self, wire: int, length: int, version: int = 0, num_samples: int = 0,
                sequence: int = 0) -> _pb.ChunkHeader:
        return _pb.ChunkHeader(rank=self.rank, trainer_id=self.trainer_id, fingerprint=self.fingerprint,
                               dtype=wire, length=length, version=version, num_samples=num_samples,
                               sequence=sequence, partition=self.partition, leaving=self.leaving,
                               layout_epoch=self.layout_epoch,
                               **claim_fields(self.claim_ask))

    def init(self, values: torch.Tensor, wire: int) -> _pb.InitReply:
        payload = wire_tensor(values, wire)
        header = self._header(wire, values.numel())
        reply = self._call("Init", lambda: self._init(encode_raw(payload, header, self.chunk_bytes),
                                                      timeout=self.call_timeout))
        self._count("bytes_out", payload.numel() * payload.element_size())
        return reply

    def pull(self, min_version: int, wire: int, length: int, timeout: float,
             out: torch.Tensor | None = None) -> tuple[int, torch.Tensor, float]:
        """(version, fp32 parameters, seconds the shard waited) at a version >= min_version.

        Waits up to ``timeout`` for the round; the shard reports how much of the
        call was waiting, so the trainer can split wait from transfer.  With
        ``out`` (the model's flat CPU parameters) the weights land there directly.
        """
        req = _pb.PullRequest(rank=self.rank, trainer_id=self.trainer_id, fingerprint=self.fingerprint,
                              min_version=min_version, dtype=wire, partition=self.partition,
                              layout_epoch=self.layout_epoch)

        def once():
            reader = ChunkReader(self._pull(req, timeout=timeout))
            values = reader.read(length, wire, max_bytes=1 << 40, require_finite=False, out=out)
            self._count("bytes_in", reader.bytes_read)
            self.saw_epoch(reader.header)
            self.saw_layout(reader.header.layout_epoch)
            return reader.header.version, values, reader.header.wait_seconds

        return self._call("Pull", once)

    def _gradient_chunks(self, grad: torch.Tensor, base: int, num_samples: int,
                         wire: int) -> tuple[int, int, list]:
        """(bytes, dense-equivalent bytes, chunks) of a push under the next number (trainer.channels.dense_push)."""
        return self.outgoing.chunks(grad, self._header(wire, grad.numel(), base, num_samples), wire)

    @property
    def unanswered(self) -> bool:
        """Whether the last push has had no answer (the next push reuses its number)."""
        return self.outgoing.numbers.unanswered

    def _acknowledged(self, outcome: str, version: int, staleness: int, base: int, nbytes: int,
                      dense_bytes: int) -> PushOutcome:
        """Count and log what became of a push (the gradient crossed the wire whatever the outcome)."""
        self.outgoing.answered()
        result = PushOutcome(outcome, version, staleness)
        self.last_answer = (self.outgoing.numbers.sequence, result)
        self._count("bytes_out", nbytes)
        self._count("push_bytes_sent", nbytes)
        self._count("push_bytes_dense", dense_bytes)  # what the same pushes would have sent uncompressed
        if outcome == STALE:
            self._count("stale_pushes")
            log.info("%s dropped a stale gradient (base %d, now %d): catching up", self.name, base, version)
        elif outcome in ("duplicate", "skipped"):
            self._count(f"{outcome}_pushes")
        return result

    def push(self, grad: torch.Tensor, base: int, num_samples: int, wire: int) -> PushOutcome:
        nbytes, dense_bytes, chunks = self._gradient_chunks(grad, base, num_samples, wire)
        send = (lambda: self._push_one(chunks[0], timeout=self.call_timeout)) if len(chunks) == 1 else (
            lambda: self._push(iter(chunks), timeout=self.call_timeout))
        try:
            reply = self._call("Push", send, retry_on=PUSH_RETRYABLE)
        except grpc.RpcError as e:
            version = stale_version(e, base)
            if version is None:
                raise
            return self._acknowledged(STALE, version, version - base, base, nbytes, dense_bytes)
        self.saw_layout(reply.layout_epoch)
        return self._acknowledged(_pb.PushOutcome.Name(reply.outcome).lower(), reply.version, reply.staleness, base,
                                  nbytes, dense_bytes)

    def push_pull(self, grad: torch.Tensor, base: int, num_samples: int, wire: int, timeout: float,
                  out: torch.Tensor | None = None) -> tuple[PushOutcome, torch.Tensor, float, float]:
        """Push, and receive the weights of the version to go on from, in one call.

        Returns (outcome, fp32 weights, seconds until the reply began less the shard's
        wait -- push and apply --, seconds the shard waited for the round).  With
        ``out`` the weights land there directly.  Retried like a push: the sequence
        number makes a retry after a lost reply a DUPLICATE, which still returns weights.
        """
        nbytes, dense_bytes, chunks = self._gradient_chunks(grad, base, num_samples, wire)

        def once():
            t0 = time.perf_counter()
            replies = (self._push_pull_one(chunks[0], timeout=timeout) if len(chunks) == 1 else
                       self._push_pull(iter(chunks), timeout=timeout))
            reader = ChunkReader(replies)  # returns once the first reply chunk is here
            t_first = time.perf_counter()
            values = reader.read(grad.numel(), wire, max_bytes=1 << 40, require_finite=False, out=out)
            self._count("bytes_in", reader.bytes_read)
            return reader.header, values, t_first - t0

        h, values, until_reply = self._call("PushPull", once, retry_on=PUSH_RETRYABLE)
        self.saw_epoch(h)
        self.saw_layout(h.layout_epoch)
        self.take_grant(h)
        outcome = self._acknowledged(_pb.PushOutcome.Name(h.outcome).lower(), h.version, h.staleness, base, nbytes,
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
            self._count("bytes_in", reader.bytes_read)
            return reader.header, reader.header.version

        h, version = self._call("PushPull", once, retry_on=PUSH_RETRYABLE)
        outcome = "stale" if h is None else _pb.PushOutcome.Name(h.outcome).lower()
        if h is not None:
            self.saw_layout(h.layout_epoch)
        self._count("stale_pushes" if outcome == STALE else f"{outcome}_pushes")
        return PushOutcome(outcome, version, version - base)

    def take_grant(self, h) -> None:
        """A dense reply's grant of the data-cursor claim its push carried (trainer.membership.data_claims): kept for
        ``BatchClaims.next``, which then needs no ClaimBatch call (PushPull's reply, or a Step's dense part)."""
        if h.batch_granted and self.claim_ask is not None:
            self.claim_answer = (self.claim_ask[0], h.batch, h.batch_reissued)

    def take_sequence(self) -> int:
        """A number of its own for a windowed push (trainer.stepping.windowed): never reused, whatever became of it."""
        with self._lock:
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
            self._count("bytes_in", reader.bytes_read)
            return reader.header

        h = self._call("PushPull", once, retry_on=PUSH_RETRYABLE)
        self.saw_layout(h.layout_epoch)
        nbytes = payload.numel() * payload.element_size()
        for name in ("bytes_out", "push_bytes_sent", "push_bytes_dense"):
            self._count(name, nbytes)
        outcome = _pb.PushOutcome.Name(h.outcome).lower()
        if outcome in ("stale", "duplicate", "skipped"):
            self._count("stale_pushes" if outcome == "stale" else f"{outcome}_pushes")
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
