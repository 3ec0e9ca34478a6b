"""A Step part's chunks are bounded by their bytes on the wire against their header's declared payload, on a real
shard (docs/design/attacks-2026-11-25.md, review follow-up; the bound itself: tests/unit/test_step_part_wire_bound.py)."""

from __future__ import annotations

import grpc
import torch

from psserver.protocol.fastwire import _varint, serialize_chunk
from tests.conftest import P
from tests.helpers import refused
from tests.integration.test_step_attacks import held_open, patient, step_call, still_serves  # noqa: F401
from tests.integration.test_step_rpc import dense


def test_a_dense_part_padded_with_an_unknown_field_is_invalid_argument_before_the_stream_ends(shard_server,
                                                                                              held_open):
    """Before: the part's 4,000 bytes of payload were within its header's 4,000, and the 4 MiB of an unknown field
    beside them -- kept alive by the chunk's data, a view into the message -- counted nowhere: accepted, the stream
    held open with everything kept."""
    raw = patient(shard_server)
    first, *rest = dense(raw, torch.ones(P), sequence=1)
    pad = b"\0" * (4 << 20)
    inner = serialize_chunk(first.dense) + bytes(((15 << 3) | 2,)) + _varint(len(pad)) + pad  # field 15: unknown
    message = bytes((0x12,)) + _varint(len(inner)) + inner  # StepChunk.dense of part 0
    refused(lambda: step_call(raw, held_open([message, *rest])), grpc.StatusCode.INVALID_ARGUMENT,
            f"part 0's chunks take {len(inner)} bytes on the wire so far but its header declares {P * 4} bytes of "
            "payload", unchanged=raw)
    assert raw.stats().counters.get("step_calls", 0) == 0
    still_serves(raw)
