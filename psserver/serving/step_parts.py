"""A Step call's request, split into its parts and checked as an envelope before any part is looked at.

Why a room of its own: the Step RPC (ps.proto) carries a step's dense PushPull and each table's PushPullRows in
one stream, so the shard can answer a trainer's whole step in one round trip.  What makes such a stream well
formed -- parts numbered from 0 in order, each of one kind, every chunk bounded, at most one dense part and one
part a table, one caller -- is pure and checked here, without a network; psserver.serving.service then hands each part
to the handler its own RPC uses, so the shard's decisions (exactly-once, rounds, modes) are the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from psserver.common.logsafe import shorten
from psserver.protocol import limits
from psserver.protocol.errors import InvalidRequest, TooLarge
from psserver.protocol.stepwire import StepMessage

DENSE, ROWS = "dense", "rows"


@dataclass
class StepPart:
    """One part: its number, kind (DENSE or ROWS) and chunks (the RPC's own messages), in order."""

    index: int
    kind: str
    chunks: list = field(default_factory=list)
    nbytes: int = 0  # payload bytes of its chunks so far (data; ids and rows)
    wire: int = 0  # bytes of its chunks on the wire so far: what they keep in memory (StepParts.declare)
    declared: int | None = None  # what its header declares it carries, once the header was checked (StepParts.declare)
    header_bytes: int = 0  # its header's sized fields (a table part's pull ids, extra ids, pull refs)

    @property
    def header(self):
        first = self.chunks[0]
        return first.header if first.HasField("header") else None


class StepParts:
    """Collects a Step stream's messages into parts, refusing a malformed envelope as each arrives.

    ``max_bytes``: the stream's bytes at most (the shard's --max-push-bytes); ``max_parts``: a dense part and
    one part a table at most (1 + limits.MAX_TABLES); ``min_chunk_bytes``: every chunk of a part but its last
    carries at least this (--min-chunk-bytes' rule, checked as the next chunk arrives: the chunks are kept until
    the stream ends, and a part of 4-byte chunks cost two Python objects every 4 bytes before its own RPC's
    reader refused it)."""

    def __init__(self, max_bytes: int, max_parts: int = 1 + limits.MAX_TABLES,
                 min_chunk_bytes: int = limits.MIN_CHUNK_BYTES):
        self.max_bytes, self.max_parts, self.min_chunk_bytes = max_bytes, max_parts, min_chunk_bytes
        self.parts: list[StepPart] = []
        self.nbytes = 0
        self.one_reply = False  # the first message asked for the reply in one message (StepChunk.one_reply)
        self._messages = 0

    def add(self, msg: StepMessage) -> None:
        """One received message: its chunk, then those it carries (``more``)."""
        if msg.malformed:
            raise InvalidRequest(msg.malformed)
        self._messages += 1
        if msg.one_reply:
            if self._messages > 1:
                raise InvalidRequest(f"one_reply is set on message {self._messages} of the Step stream but "
                                     "only the first message may set it")
            self.one_reply = True
        self.nbytes += msg.nbytes
        if self.nbytes > self.max_bytes:
            raise TooLarge(f"the Step stream holds {self.nbytes} bytes so far, over this shard's limit of "
                           f"{self.max_bytes} bytes (--max-push-bytes)")
        for chunk in msg.flat():
            self._add_chunk(chunk)

    def _add_chunk(self, msg: StepMessage) -> None:
        kind = DENSE if msg.dense is not None else ROWS if msg.rows is not None else None
        if kind is None:
            raise InvalidRequest(f"a chunk of part {msg.part} carries neither dense nor rows")
        current = self.parts[-1].index if self.parts else -1
        if msg.part == current + 1:
            if len(self.parts) >= self.max_parts:
                raise TooLarge(f"part is {msg.part}, past the limit of {self.max_parts} parts (one dense part and "
                               f"one a table)")
            self.parts.append(StepPart(msg.part, kind))
        elif msg.part != current:
            raise InvalidRequest(f"part is {msg.part} but {current} or {current + 1} was expected: parts are "
                                 "numbered from 0 in order and each one's chunks are contiguous")
        last = self.parts[-1]
        if kind != last.kind:
            raise InvalidRequest(f"part {msg.part} is {last.kind} but a chunk of it carries {kind}")
        if last.chunks:
            _check_not_short(last, self.min_chunk_bytes)
        chunk = msg.dense if kind == DENSE else msg.rows
        last.chunks.append(chunk)
        last.nbytes += _payload_bytes(chunk, kind)
        last.wire += msg.wire or _payload_bytes(chunk, kind)  # (a message made here, not parsed: its payload)
        _check_declared(last)

    def declare(self, part: StepPart, nbytes: int) -> None:
        """``part``'s header, checked, declares ``nbytes`` of payload: refused as soon as its chunks carry more,
        or take more bytes on the wire than that plus their framing (``_check_declared``).  Without it a part was
        bounded only by the stream's --max-push-bytes (4 GiB by default), whatever its header said: a dense part
        declaring a 4 KB slice could bring gigabytes, all kept until the stream ended."""
        part.declared = nbytes
        h = part.header
        if part.kind == ROWS and h is not None:  # sized by their own checks later (pull bytes, num_ids)
            part.header_bytes = len(h.pull_ids) + len(h.packed_pull_ids) + len(h.extra_ids) + 10 * len(h.pull_refs)
        _check_declared(part)

    def finish(self) -> list[StepPart]:
        """The parts, once the stream ended: each opening with a header, one caller, one dense part and one
        part a table at most."""
        if not self.parts:
            raise InvalidRequest("the Step stream is empty: it must carry at least one part")
        dense, tables = 0, {}
        for p in self.parts:
            h = check_caller(p, self.parts[0])
            if p.kind == DENSE:
                dense += 1
                if dense > 1:
                    raise InvalidRequest(f"part {p.index} is a second dense part: a Step carries one at most")
            elif h.table in tables:
                raise InvalidRequest(f"part {p.index} names table {shorten(h.table)}, as part {tables[h.table]} "
                                     "did: one part a table")
            else:
                tables[h.table] = p.index
        return self.parts


def check_caller(p: StepPart, first: StepPart):
    """``p``'s header, refused if it has none or names another caller than part 0 (``first``): one caller a Step."""
    h = p.header
    if h is None:
        raise InvalidRequest(f"part {p.index}'s first chunk has no header")
    f = first.header
    if (h.rank, h.trainer_id, h.fingerprint) != (f.rank, f.trainer_id, f.fingerprint):
        raise InvalidRequest(f"part {p.index} names rank {h.rank} trainer_id {shorten(h.trainer_id)} but part 0 "
                             f"names rank {f.rank} trainer_id {shorten(f.trainer_id)}: one caller a Step")
    if h.layout_epoch != f.layout_epoch:  # its tables' trip runs on one layout's (psserver.serving.service_step)
        raise InvalidRequest(f"part {p.index} names layout_epoch {h.layout_epoch} but part 0 names "
                             f"{f.layout_epoch}: one layout a Step")
    return h


def _payload_bytes(chunk, kind: str) -> int:
    return len(chunk.data) if kind == DENSE else len(chunk.ids) + len(chunk.rows)


def wire_allowance(part: StepPart) -> int:
    """The bytes ``part``'s chunks may take on the wire: its declared payload, its header's sized fields, a
    header's ids and numbers (limits.STEP_PART_HEADER_BYTES) and each chunk's framing
    (limits.STEP_CHUNK_FRAMING_BYTES)."""
    return (part.declared + part.header_bytes + limits.STEP_PART_HEADER_BYTES +
            limits.STEP_CHUNK_FRAMING_BYTES * len(part.chunks))


def _check_declared(part: StepPart) -> None:
    """Payload against the declared size, then bytes kept: a dense chunk's data is a view into its whole received
    message, so bytes the parsers skip (an unknown field, a header's field a dense part has no use for) would
    stay in memory uncounted -- a part declaring 4,000 bytes kept 8 MiB messages."""
    if part.declared is None:
        return
    if part.nbytes > part.declared:
        raise InvalidRequest(f"part {part.index} carries {part.nbytes} bytes so far but its header declares "
                             f"{part.declared} bytes")
    allowed = wire_allowance(part)
    if part.wire > allowed:
        raise InvalidRequest(f"part {part.index}'s chunks take {part.wire} bytes on the wire so far but its header "
                             f"declares {part.declared} bytes of payload: at most {allowed} with its header and "
                             f"{len(part.chunks)} chunks' framing")


def _check_not_short(part: StepPart, min_chunk_bytes: int) -> None:
    """Refuse a part whose chunk so far, now followed by another, carries fewer bytes than the minimum."""
    prev = part.chunks[-1]
    n = _payload_bytes(prev, part.kind)
    if n < min_chunk_bytes:
        raise InvalidRequest(f"part {part.index}'s chunk at offset {prev.offset} carries {n} bytes, under the "
                             f"minimum of {min_chunk_bytes} for every chunk but the last")
