"""The row streams of PullRows and PushRows (see ps.proto): one definition for the shard and the trainer."""

from __future__ import annotations

import torch

from psserver.protocol.fastwire import RawRowsChunk
from psserver.protocol.proto import ps_pb2 as _pb


def row_chunks(rows: torch.Tensor, header: _pb.RowsHeader, chunk_bytes: int, ids: torch.Tensor | None = None,
               raw: bool = False):
    """RowsChunk messages of whole rows, each but the last at least ``chunk_bytes`` and under ``chunk_bytes`` plus
    one row (so a shard's minimum chunk size holds); the header on the first.  With ``ids`` (a push), each chunk
    carries its ids too.  ``raw``: as RawRowsChunks (the same bytes on the wire, one copy fewer), for the calls
    whose serializer takes them (psserver.protocol.fastwire.serialize_rows_chunk, a Step's serialize_step); the
    generated stubs' serializer takes generated RowsChunks only."""
    n, dim = rows.shape
    row_bytes = dim * 4 + (8 if ids is not None else 0)
    per = max(1, -(-chunk_bytes // row_bytes))
    flat = rows.contiguous().view(-1).numpy()
    id_bytes = ids.contiguous().numpy() if ids is not None else None
    for start in range(0, max(n, 1), per):
        stop = min(n, start + per)
        chunk_ids = id_bytes[start:stop].tobytes() if id_bytes is not None else b""
        chunk_rows = flat[start * dim:stop * dim].tobytes()
        if raw:
            yield RawRowsChunk(header=header if start == 0 else None, offset=start, ids=chunk_ids, rows=chunk_rows)
            continue
        chunk = _pb.RowsChunk(offset=start, rows=chunk_rows, ids=chunk_ids)
        if start == 0:
            chunk.header.CopyFrom(header)
        yield chunk
