"""A Step is refused as a whole (issue 35 item 5), on a real shard on loopback.

The trigger met in practice: a sync table round that a trainer's push would take past the table's bounds.  Its
Step's table part passes every check of its own, but once its turn comes the round's union of ids is over the
table's ``max_rows``: the push is refused -- after the Step's dense part had been pushed (closing the dense round
with it), and on the streaming Step the refusal could not even be sent while the dense reply was being written
(the call hung to its deadline).  Now what a table push would be refused for at its turn is checked before the
dense push: the call is refused with its status at once, and the shard's state is unchanged.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stepwire import one_message, parse_step, serialize_step
from psserver.protocol.stubs import method
from tests.conftest import P
from tests.helpers import refused
from tests.integration.test_sparse_rpc import job, push_rows, rows_chunks
from tests.integration.test_step_rpc import dense, rows


def round_half_full(shard_server):
    """A 2-trainer sync job, table ``emb`` of max_rows 20: rank 0's dense push and rows 0..14 are in the open
    rounds; rank 1 has pushed nothing."""
    raw = shard_server()
    spec = job(num_trainers=2, mode="sync", max_rows=20)
    raw.register(rank=0, spec=spec)
    raw.register(rank=1, spec=spec)
    raw.init(torch.zeros(P))
    assert raw.push(torch.ones(P), rank=0, sequence=1).outcome == pb.ACCEPTED
    assert push_rows(raw, rows_chunks(list(range(15)), rank=0, seq=1)).outcome == pb.ACCEPTED
    return raw


def step(raw, ids, streamed: bool):
    msgs = dense(raw, torch.ones(P), rank=1, sequence=1) + rows(1, rows_chunks(ids, rank=1, seq=1))
    if streamed:
        call = raw.channel.stream_stream(method("Step"), serialize_step, parse_step)
        return list(call(iter(msgs), timeout=20))
    return raw.channel.unary_unary(method("StepOnce"), serialize_step, parse_step)(one_message(msgs), timeout=20)


@pytest.mark.parametrize("streamed", [False, True], ids=["StepOnce", "Step"])
def test_a_step_whose_table_push_would_pass_the_rounds_bounds_is_refused_before_its_dense_part_is_pushed(
        shard_server, streamed):
    raw = round_half_full(shard_server)
    refused(lambda: step(raw, list(range(10, 25)), streamed), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "25 unique ids", "max_rows", unchanged=raw)  # (a hang would end DEADLINE_EXCEEDED)
    st = raw.stats()
    assert st.version == 0 and st.counters.get("duplicates", 0) == 0
    step(raw, list(range(10, 20)), streamed)  # the same step with ids that fit: both rounds close
    st = raw.stats()
    assert st.version == 1 and st.counters["table.emb.version"] == 1 and st.counters["table.emb.live_rows"] == 20
