"""What a slice partition's next push sends: its number and, for a compressed push, its encoded pairs.

``ShardClient`` (trainer.channels.client) owns the channel and the calls; this room owns the push under way between
them: the number it carries (trainer.channels.push_numbers) and the chunks it is sent as.  A push retried while
unanswered is sent again as it was -- for top-k compression the same pairs: compressing the gradient again
would add it to the residual twice (trainer.channels.compress).
"""

from __future__ import annotations

import torch

from psserver.protocol.codec import encode_raw, encode_topk_raw, wire_tensor
from psserver.protocol.proto import ps_pb2 as _pb
from trainer.channels.compress import TopK
from trainer.channels.push_numbers import PushNumbers


class OutgoingPush:
    """The numbering and the unanswered compressed push of one slice partition (None: nothing kept)."""

    def __init__(self, chunk_bytes: int, compressor: TopK | None = None):
        self.chunk_bytes, self.compressor = chunk_bytes, compressor
        self.numbers = PushNumbers()
        self._encoded: tuple[int, int, list] | None = None  # the unanswered compressed push, resent as it was
        self.sent: tuple[torch.Tensor, torch.Tensor] | None = None  # its (indices, values): a layout switch gives
        # them back to the residual (trainer.membership.relayout.give_back_topk)

    def chunks(self, grad: torch.Tensor, header: _pb.ChunkHeader, wire: int) -> tuple[int, int, list]:
        """(bytes, dense-equivalent bytes, chunks) of a push under the next number (``header`` is given its
        number here); the chunks are views into the gradient (the slice itself when fp32 on the CPU), and a
        retry resends the same list."""
        if self.compressor is not None and grad.numel() and (
                self._encoded is not None if self.numbers.unanswered else not self.compressor.take_warmup_push()):
            return self._compressed(grad, header, wire)  # (a retry resends a dense warm-up push)
        payload = wire_tensor(grad, wire)
        header.sequence = self.numbers.number()
        nbytes = payload.numel() * payload.element_size()
        return nbytes, nbytes, list(encode_raw(payload, header, self.chunk_bytes))

    def _compressed(self, grad: torch.Tensor, header: _pb.ChunkHeader, wire: int) -> tuple[int, int, list]:
        """A top-k push of ``grad``; while it is unanswered (a retried step) the same encoded push is resent."""
        if self.numbers.unanswered and self._encoded is not None:
            sent = self._encoded[2][0].header  # the same values on a retry; new ones when sent again (resend)
            sent.sequence, sent.version = self.numbers.sequence, header.version
            return self._encoded
        indices, values = self.compressor.compress(grad, wire)
        self.sent = (indices, values)
        header.sequence, header.topk = self.numbers.number(), values.numel()
        nbytes = indices.numel() * indices.element_size() + values.numel() * values.element_size()
        self._encoded = (nbytes, grad.numel() * values.element_size(),
                         encode_topk_raw(indices, values, header, self.chunk_bytes))
        return self._encoded

    def answered(self) -> None:
        """The push was answered: the next one is a new push, under a new number."""
        self.numbers.answered()
        self._encoded = self.sent = None

    def abandon(self) -> None:
        """Give up on the unanswered push: the next push gets a new number.  A compressed push is dropped with
        it, as a dense one would be; the residual keeps what it did not send."""
        self.numbers.abandon()
        self._encoded = self.sent = None

    def take(self) -> int:
        """A number of its own for a windowed push: never reused, whatever became of it."""
        self._encoded = self.sent = None
        return self.numbers.take()

    def after_restart(self) -> bool:
        """The shard restarted and forgot the last push: the next one carries the same gradient again, under a
        new number (a compressed push its same pairs).  False when that cannot be done exactly -- a compressed
        push already answered, whose pairs are gone -- and the push is abandoned instead."""
        if self.compressor is not None and not self.numbers.unanswered:
            self.abandon()
            return False
        self.numbers.renumber()  # stays unanswered: the next push sends it under the new number
        return True
