"""A live re-shard's Handoff stream (source -> destination): one payload per stream, tiled over chunks.

A payload is a ``torch.save`` of a dict of tensors and plain values (a COPY's range and optimizer state, a
FORWARD's averaged gradient and lr, a VOTE's digest and timeline), read back with ``weights_only`` so a peer
can send data, never code.  Kept apart from psserver.resharding.handoff.shard_ops so the io layer reads as the machines' actions.
"""

from __future__ import annotations

import io
import numbers
from typing import Iterable, Iterator

import torch

from psserver.protocol import limits
from psserver.protocol.errors import InvalidRequest, TooLarge
from psserver.protocol.job import JobSpec
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.resharding.handoff.rows import check_rows_payload
from psserver.resharding.handoff.moved_books import check_book

CHUNK_BYTES = 1 << 20  # under gRPC's default 4 MB message limit with room to spare
MAX_PAYLOAD_BYTES = 1 << 34  # a move is at most a slice: refuse a stream that claims more before reading it all
MAX_FORWARD_ROUNDS = 16  # rounds in one FORWARD payload (psserver.resharding.handoff.machine.MAX_FORWARD_LAG, the sender's batch)
MAX_TEXT_CHARS = 1 << 20  # a vote's digest and timeline text
COPY, FORWARD, VOTE = _pb.HandoffChunk.COPY, _pb.HandoffChunk.FORWARD, _pb.HandoffChunk.VOTE
ROW_KINDS = {_pb.HandoffChunk.ROWS_COPY: "copy", _pb.HandoffChunk.ROWS_FORWARD: "forward",
             _pb.HandoffChunk.ROWS_VOTE: "vote"}


def pack(payload: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def unpack(data: bytes, kind: int | None = None) -> dict:
    """The payload's dict; with ``kind``, its shape checked too (``check_payload``): a peer's payload is data
    the destination indexes, steps and installs, so a missing key or a wrong type is INVALID_ARGUMENT here,
    never a KeyError (UNKNOWN) half-way through a replay."""
    try:
        payload = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 -- any undecodable payload is the caller's bad input
        raise InvalidRequest(f"a Handoff payload of {len(data)} bytes could not be decoded: {str(e)[:120]}") from None
    if kind is not None:
        check_payload(kind, payload)
    return payload


def _want(ok: bool, field: str, value, expected: str) -> None:
    if not ok:
        shown = value if isinstance(value, int) else repr(str(value)[:80])
        raise InvalidRequest(f"a Handoff payload's {field} is {shown} but it must be {expected}")


def _tensor(field: str, value, n: int | None = None) -> None:
    _want(torch.is_tensor(value) and value.dtype == torch.float32 and value.dim() == 1, field,
          type(value).__name__ if not torch.is_tensor(value) else f"{value.dtype} of shape {tuple(value.shape)}",
          "a 1-D float32 tensor")
    if n is not None:
        _want(value.numel() == n, f"{field}'s length", value.numel(), f"{n}, the move's range")


def check_payload(kind: int, p) -> None:
    """A payload's keys and types for its kind (sizes against the move: ``check_move``)."""
    _want(isinstance(p, dict), "type", type(p).__name__, "a dict")
    if kind == COPY:
        for key in ("a", "b"):
            _want(isinstance(p.get(key), int), key, p.get(key), "an int")
        _tensor("params", p.get("params"))
        opt = p.get("optimizer")
        _want(isinstance(opt, dict) and isinstance(opt.get("state"), dict) and set(opt["state"]) <= {0}
              and isinstance(opt.get("param_groups"), list) and len(opt["param_groups"]) == 1
              and isinstance(opt["param_groups"][0], dict), "optimizer", opt, "one-tensor optimizer state")
        one = opt["state"].get(0, {})
        _want(isinstance(one, dict) and all(isinstance(k, str) and (torch.is_tensor(v) or isinstance(
            v, numbers.Number)) for k, v in one.items()), "optimizer state", one, "names of tensors or numbers")
        job_proto(p)
    elif kind == FORWARD:
        rounds = p.get("rounds")
        _want(isinstance(rounds, list) and 0 < len(rounds) <= MAX_FORWARD_ROUNDS, "rounds",
              type(rounds).__name__ if not isinstance(rounds, list) else f"{len(rounds)} rounds",
              f"a list of 1 to {MAX_FORWARD_ROUNDS} rounds")
        for i, one in enumerate(rounds):
            _want(isinstance(one, dict) and isinstance(one.get("version"), int) and one["version"] >= 0
                  and (one.get("grad") is None or isinstance(one.get("lr"), numbers.Real)), f"rounds[{i}]", one,
                  "a version, and a number lr with each gradient")
            if one.get("grad") is not None:
                _tensor(f"rounds[{i}].grad", one["grad"])
    elif kind == VOTE:
        for key in ("digest", "timeline"):
            _want(isinstance(p.get(key), str) and len(p[key]) <= MAX_TEXT_CHARS, key, p.get(key),
                  f"text of at most {MAX_TEXT_CHARS} characters")
        members, epochs = p.get("members"), p.get("epochs")
        _want(isinstance(members, dict) and all(isinstance(r, int) and isinstance(t, str)
                                                for r, t in members.items()), "members", members,
              "ranks to trainer ids")
        _want(isinstance(epochs, list) and all(
            isinstance(e, tuple) and len(e) == 3 and isinstance(e[0], int) and isinstance(e[1], int)
            and isinstance(e[2], list) and all(isinstance(r, int) for r in e[2]) for e in epochs), "epochs",
            epochs, "(number, round, ranks) triples")
        check_book(p.get("book"))
    elif kind in ROW_KINDS:  # a sync table's rows (psserver.resharding.handoff.rows); a ROWS_COPY carries the job too
        check_rows_payload(ROW_KINDS[kind], p, MAX_FORWARD_ROUNDS)
        if kind == _pb.HandoffChunk.ROWS_COPY:
            job_proto(p)
    else:
        raise InvalidRequest(f"a Handoff's kind is {kind} but it must be COPY, FORWARD, VOTE or ROWS_* (0 to 5)")


def check_move(kind: int, p: dict, a: int, b: int) -> None:
    """A checked payload's sizes against its move [a, b): a COPY of another range, or tensors of another length,
    would be replayed and assembled into the new piece (or fail there, after the piece changed)."""
    if kind == COPY:
        _want((p["a"], p["b"]) == (a, b), "range", f"[{p['a']}, {p['b']})", f"[{a}, {b}), the move's range")
        _tensor("params", p["params"], b - a)
        for key, value in p["optimizer"]["state"].get(0, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                _tensor(f"optimizer state {key}", value, b - a)
    elif kind == FORWARD:
        for i, one in enumerate(p["rounds"]):
            if one.get("grad") is not None:
                _tensor(f"rounds[{i}].grad", one["grad"], b - a)


def job_proto(p: dict) -> _pb.JobSpec:
    """A COPY's job, decoded and checked (JobSpec's own caps): INVALID_ARGUMENT naming what is wrong."""
    text = p.get("job")
    _want(isinstance(text, str), "job", type(text).__name__, "the job spec's bytes in hex")
    msg = _pb.JobSpec()
    try:
        msg.ParseFromString(bytes.fromhex(text))
        JobSpec.from_proto(msg)
    except Exception as e:  # noqa: BLE001 -- undecodable hex or protobuf, or a spec over a cap: bad input
        raise InvalidRequest(f"a Handoff payload's job could not be decoded: {str(e)[:160]}") from None
    return msg


def chunks(kind: int, plan: str, source: str, move: int, version: int, payload: dict) -> Iterator[_pb.HandoffChunk]:
    """The stream for one payload; the first chunk carries the header fields, every chunk a piece of the data."""
    data = pack(payload)
    for at in range(0, max(len(data), 1), CHUNK_BYTES):
        yield _pb.HandoffChunk(kind=kind, plan=plan, source=source, move=move, version=version,
                               data=data[at:at + CHUNK_BYTES])


class _Payload:
    """A Handoff stream's chunks gathered into one payload, bounded as they arrive by ``limit`` (the shard's
    memory budget, --max-memory; MAX_PAYLOAD_BYTES at most): bytes held before a word of it is checked."""

    def __init__(self, limit: int = MAX_PAYLOAD_BYTES):
        self.first, self.parts, self.size, self.limit = None, [], 0, min(limit, MAX_PAYLOAD_BYTES)

    def add(self, chunk: _pb.HandoffChunk) -> None:
        self.first = self.first or chunk
        if self.parts and len(self.parts[-1]) < limits.MIN_CHUNK_BYTES:  # (empty chunks would be kept unbounded)
            raise InvalidRequest(f"a Handoff's chunk {len(self.parts) - 1} carries {len(self.parts[-1])} bytes but "
                                 f"every chunk but the last carries at least {limits.MIN_CHUNK_BYTES}")
        self.size += len(chunk.data)
        if self.size > self.limit:
            raise TooLarge(f"a Handoff payload's size is {self.size} bytes so far "
                           f"but the limit is {self.limit} bytes (--max-memory): refused before the rest is read")
        self.parts.append(chunk.data)

    def started(self) -> _pb.HandoffChunk:
        if self.first is None:
            raise InvalidRequest("a Handoff stream ended before its first chunk")
        return self.first

    def whole(self) -> tuple[_pb.HandoffChunk, bytes]:
        return self.started(), b"".join(self.parts)


def read(request_iterator: Iterable[_pb.HandoffChunk]) -> tuple[_pb.HandoffChunk, bytes]:
    """(the first chunk, the whole payload's bytes) of a stream read to its end."""
    payload = _Payload()
    for chunk in request_iterator:
        payload.add(chunk)
    return payload.whole()


async def read_async(request_iterator, check=lambda first: None,
                     limit: int = MAX_PAYLOAD_BYTES) -> tuple[_pb.HandoffChunk, list[bytes]]:
    """``read`` for the servicer's async stream, its pieces not joined (``unpack_parts`` off the loop: joining
    100 MiB took ~0.2 s on a loaded 2-core machine); ``check(first)`` runs on the first chunk, before the rest."""
    payload = _Payload(limit)
    async for chunk in request_iterator:
        if payload.first is None:
            check(chunk)
        payload.add(chunk)
    return payload.started(), payload.parts


def unpack_parts(parts: list[bytes], kind: int) -> dict:
    """``unpack`` of a payload's pieces as ``read_async`` gathered them (for a thread other than the loop)."""
    return unpack(b"".join(parts), kind)
