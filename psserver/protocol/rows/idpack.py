"""Ids packed for the wire: strictly ascending int64 ids as varint gaps (issue 21 item 4, "ids once").

Why: a step's rows cost 64 bytes an id each way at dim 16; raw ids add 8 bytes an id every time they cross.
Sent once (a push names its pull, psserver.sparse.pull_refs) that is still 1.06x the rows; the ids of one call
to one shard, sorted, are a few hundred thousand apart even over 10^9 possible ids, so their gaps take ~3 bytes
as unsigned LEB128 varints (7 bits a byte, the high bit set on every byte but a value's last).

Layout: the first id as the varint of its two's complement (uint64), then each id's gap to the one before
(mod 2^64, so the whole int64 range works).  Only strictly ascending ids pack: a gap of 0 cannot be written,
and ``unpack`` refuses one, so packed ids are unique by construction.  Vectorised (numpy), no per-id Python.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_VARINT_BYTES = 10  # 64 bits at 7 a byte


class PackError(ValueError):
    """Packed ids that do not decode (the shard answers INVALID_ARGUMENT naming what is wrong)."""


def packable(ids: torch.Tensor) -> bool:
    """Whether ``ids`` (int64, 1-D) are strictly ascending, so ``pack`` can write them."""
    return len(ids) < 2 or bool((ids[1:] > ids[:-1]).all())


def pack(ids: torch.Tensor) -> bytes:
    """Strictly ascending int64 ``ids`` as varint gaps (ValueError otherwise)."""
    if not len(ids):
        return b""
    if not packable(ids):
        raise ValueError("only strictly ascending ids pack")
    u = ids.contiguous().numpy().view(np.uint64)
    gaps = np.empty_like(u)
    gaps[0] = u[0]
    np.subtract(u[1:], u[:-1], out=gaps[1:])  # wraps mod 2^64: the true gap of ascending signed ids
    nbytes = np.ones(len(gaps), dtype=np.int64)
    for k in range(1, MAX_VARINT_BYTES):
        nbytes += gaps >= np.uint64(1 << (7 * k))
    starts = np.cumsum(nbytes) - nbytes
    at = np.arange(int(nbytes.sum())) - np.repeat(starts, nbytes)  # each byte's place in its value
    values = np.repeat(gaps, nbytes)
    out = ((values >> (7 * at).astype(np.uint64)) & np.uint64(0x7F)).astype(np.uint8)
    out |= (at < np.repeat(nbytes, nbytes) - 1).astype(np.uint8) << 7
    return out.tobytes()


def unpack(raw: bytes, max_ids: int) -> torch.Tensor:
    """The int64 ids of ``raw`` (PackError: a truncated or overlong varint, a gap of 0, past ``max_ids``)."""
    if not raw:
        return torch.empty(0, dtype=torch.int64)
    b = np.frombuffer(raw, dtype=np.uint8)
    ends = np.flatnonzero(b < 0x80)
    if not len(ends) or ends[-1] != len(b) - 1:
        raise PackError(f"packed ids end inside a varint (byte {len(b) - 1} of {len(b)} has its high bit set)")
    if len(ends) > max_ids:
        raise PackError(f"packed ids hold {len(ends)} ids, over the limit of {max_ids}")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if int(lengths.max()) > MAX_VARINT_BYTES or bool((b[ends[lengths == MAX_VARINT_BYTES]] > 1).any()):
        raise PackError(f"a packed id takes more than 64 bits (a varint of {int(lengths.max())} bytes)")
    at = (np.arange(len(b)) - np.repeat(starts, lengths)).astype(np.uint64)
    gaps = np.bitwise_or.reduceat((b & 0x7F).astype(np.uint64) << (np.uint64(7) * at), starts)
    if len(gaps) > 1 and bool((gaps[1:] == 0).any()):
        at0 = int(np.flatnonzero(gaps[1:] == 0)[0]) + 1
        raise PackError(f"packed id {at0} repeats id {at0 - 1} (a gap of 0): ids must be strictly ascending")
    ids = np.cumsum(gaps, dtype=np.uint64).view(np.int64)  # (wraps mod 2^64, as pack's gaps did)
    return torch.from_numpy(ids.copy())
