"""Ids packed for the wire: strictly ascending int64 ids as varint gaps (issue 21 item 4, "ids once").

Why: a step's rows cost 64 bytes an id each way at dim 16; raw ids add 8 bytes an id every time they cross.
Sent once (a push names its pull, psserver.sparse.pull_refs) that is still 1.06x the rows; the ids of one call
to one shard, sorted, are a few hundred thousand apart even over 10^9 possible ids, so their gaps take ~3 bytes
as unsigned LEB128 varints (7 bits a byte, the high bit set on every byte but a value's last).

Layout: the first id as the varint of its two's complement (uint64), then each id's gap to the one before
(mod 2^64, so the whole int64 range works).  Only strictly ascending ids pack: a gap of 0 cannot be written,
and ``unpack`` refuses one, so packed ids are unique by construction.  Vectorised (numpy), no per-id Python; one
loop each in the C table kernel where it was built (psserver.protocol.rows.kernel), the same bytes and ids, with
anything malformed left to numpy's path to name.
"""

from __future__ import annotations

import numpy as np
import torch

from psserver.protocol.rows import kernel

MAX_VARINT_BYTES = 10  # 64 bits at 7 a byte


class PackError(ValueError):
    """Packed ids that do not decode (the shard answers INVALID_ARGUMENT naming what is wrong)."""


def packable(ids: torch.Tensor) -> bool:
    """Whether ``ids`` (int64, 1-D) are strictly ascending, so ``pack`` can write them (numpy: ~10x torch's
    compare on a few hundred ids)."""
    a = ids.numpy()
    return len(a) < 2 or bool((a[1:] > a[:-1]).all())


def pack(ids: torch.Tensor) -> bytes:
    """Strictly ascending int64 ``ids`` as varint gaps (ValueError otherwise).

    By byte planes: the gaps shifted by 0, 7, 14, ... bits as an (ids x planes) matrix, only as many planes as
    the largest gap needs, each value's bytes kept by a mask (row-major, so in wire order) -- a dozen numpy calls
    whatever the number of ids (~8x the byte-at-a-time version on 700 ids over 10^9)."""
    if not len(ids):
        return b""
    a = ids.contiguous().numpy()
    if kernel.native is not None and a.dtype == np.int64:  # (the C loop reads int64; anything else is refused below)
        packed = kernel.native.pack_ids(a)
        if packed is not None:  # (None: not ascending, refused below)
            return packed
    if len(a) > 1 and not bool((a[1:] > a[:-1]).all()):
        raise ValueError("only strictly ascending ids pack")
    u = a.view(np.uint64)
    head = _varint(int(u[0]))  # the first id alone: a large one does not widen every gap's planes
    if len(u) == 1:
        return head
    gaps = np.subtract(u[1:], u[:-1])  # wraps mod 2^64: the true gap of ascending signed ids
    planes = _planes(int(gaps.max()))
    if planes == 1:  # every gap under 128 (renumbered ids): one byte each, the high bit clear
        return head + gaps.astype(np.uint8).tobytes()
    return head + _varints(gaps, planes)


def _varint(value: int) -> bytes:
    """One uint64 as LEB128."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _varints(gaps: np.ndarray, planes: int) -> bytes:
    """``gaps`` as LEB128 varints, by byte planes: an (ids x planes) matrix of each gap's 7-bit groups, plane
    k+1 nonzero marking plane k's continuation bit and plane k kept (row-major, so in wire order)."""
    out = np.empty((len(gaps), planes), dtype=np.uint8)
    kept = np.empty((len(gaps), planes), dtype=bool)
    kept[:, 0] = True
    g = gaps
    for k in range(planes):
        if k:
            g = g >> np.uint64(7)
            np.not_equal(g, 0, out=kept[:, k])
        out[:, k] = g & np.uint64(0x7F)
    out[:, :-1] |= kept[:, 1:].view(np.uint8) << 7
    return out[kept].tobytes()


def _planes(top: int) -> int:
    """The 7-bit planes a gap of ``top`` takes (1..10)."""
    return max(1, -(-top.bit_length() // 7))


def unpack(raw: bytes, max_ids: int) -> torch.Tensor:
    """The int64 ids of ``raw`` (PackError: a truncated or overlong varint, a gap of 0, past ``max_ids``)."""
    if not raw:
        return torch.empty(0, dtype=torch.int64)
    if kernel.native is not None:
        ids = kernel.native.unpack_ids(raw, max_ids)
        if ids is not None:  # (None: malformed, refused below with what is wrong)
            return torch.frombuffer(ids, dtype=torch.int64) if ids else torch.empty(0, dtype=torch.int64)
    b = np.frombuffer(raw, dtype=np.uint8)
    if b[-1] >= 0x80:
        raise PackError(f"packed ids end inside a varint (byte {len(b) - 1} of {len(b)} has its high bit set)")
    ends = np.flatnonzero(b < 0x80)
    if len(ends) > max_ids:
        raise PackError(f"packed ids hold {len(ends)} ids, over the limit of {max_ids}")
    first = int(ends[0]) + 1  # the first id's bytes
    if len(ends) == len(b) - first + 1:  # one byte a gap after the first id (renumbered ids): the bytes are them
        gaps = np.concatenate((_gaps(b[:first], ends[:1]), b[first:].astype(np.uint64)))
    else:
        gaps = _gaps(b, ends)
    if len(gaps) > 1 and not bool(gaps[1:].all()):
        at0 = int(np.flatnonzero(gaps[1:] == 0)[0]) + 1
        raise PackError(f"packed id {at0} repeats id {at0 - 1} (a gap of 0): ids must be strictly ascending")
    return torch.from_numpy(np.cumsum(gaps, dtype=np.uint64).view(np.int64))  # (wraps mod 2^64, as pack's did)


def _gaps(b: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The values of the varints ``b`` ending at ``ends``, plane by plane: byte k of every value (where it has
    one) shifted by 7k bits and or-ed in -- a few numpy calls a plane, none a byte."""
    starts = np.empty_like(ends)
    starts[0] = 0
    np.add(ends[:-1], 1, out=starts[1:])
    lengths = ends - starts + 1
    planes = int(lengths.max())
    if planes > MAX_VARINT_BYTES or bool((b[ends[lengths == MAX_VARINT_BYTES]] > 1).any()):
        raise PackError(f"a packed id takes more than 64 bits (a varint of {planes} bytes)")
    low = b & 0x7F
    gaps = low[starts].astype(np.uint64)
    for k in range(1, planes):
        byte = low[np.minimum(starts + k, ends)]  # a value shorter than k+1 bytes reads its last byte ...
        byte[lengths <= k] = 0  # ... and adds nothing
        gaps |= byte.astype(np.uint64) << np.uint64(7 * k)
    return gaps
