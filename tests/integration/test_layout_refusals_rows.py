"""Row calls routed by layout over real gRPC (stage 6 of docs/design/live-reshard.md, offline): a one-shard sync job with a
table switched, at dense round R = 2 and table round T = 3, to layout 1 -- two shards, this process shard 0 -- and
the row calls each layout refuses.  Each refusal: its one status, its reason and newest layout in the trailers, a
message naming the layout sent and the table's round, both layouts' state digests unchanged, and the shard still
serving the table in layout 1."""

import dataclasses

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.layout import Layout
from psserver.protocol.layouts import new_job
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rows.placement import shard_of
from psserver.protocol.stepwire import StepMessage, parse_step, serialize_step
from psserver.protocol.stubs import method
from tests.conftest import P
from tests.helpers import refused
from tests.integration.test_sparse_rpc import job, push_rows, rows_chunks
from tests.offline_switch import switch_layout_offline

OLD = job()
OLD = dataclasses.replace(OLD, fingerprint=Layout.from_shapes(OLD.tensors, 1).fingerprint())
NEW = new_job(OLD, 2)
R, T = 2, 3  # layout 1 takes the dense slice over from round 2, table emb from its round 3
MINE = [i for i in range(40) if int(shard_of(torch.tensor([i]), 2)[0]) == 0][:5]  # ids shard 0 of two holds


def rows(layout, base, seq, fingerprint, ids=MINE):
    chunks = rows_chunks(ids, seq=seq, base=base, fingerprint=fingerprint)
    chunks[0].header.layout_epoch = layout
    return chunks


def pull(shard, layout, version, fingerprint, ids=MINE):
    req = pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=fingerprint, table="emb", min_version=version,
                             ids=torch.tensor(ids).numpy().tobytes(), layout_epoch=layout)
    return list(shard.stub.PullRows(req, timeout=10))[0].header


class BothLayouts:
    """Layout 1's digest (GetStats, as a member) and the tombstone's, layout 0's (read in-process)."""

    def __init__(self, shard):
        self.shard = shard

    def digest(self):
        return self.shard.digest(fingerprint=NEW.fingerprint), self.shard.server.layouts.host(0).part(0).state_digest()


@pytest.fixture
def switched(shard_server):
    """Layout 0 ran dense rounds 0, 1 and table rounds 0, 1, 2 (rows pushes numbered 1..3); then layout 1."""
    shard = shard_server()
    shard.register(spec=OLD)
    h = shard.header(fingerprint=OLD.fingerprint)
    assert shard.stub.Init(encode(wire_tensor(torch.zeros(P), pb.FLOAT32), h, 1024), timeout=10).accepted
    for base in (0, 1):
        h = shard.header(version=base, fingerprint=OLD.fingerprint, sequence=base + 1)
        assert shard.stub.Push(encode(wire_tensor(torch.ones(P), pb.FLOAT32), h, 1024), timeout=10).outcome == \
            pb.APPLIED
    for base in range(T):
        assert push_rows(shard, rows(0, base, base + 1, OLD.fingerprint, ids=list(range(40)))).outcome == pb.APPLIED
    layout = switch_layout_offline(shard.server, 2, 0)
    assert (layout.number, layout.round, layout.table_rounds) == (1, R, (("emb", T),))
    return shard


def still_serves(shard):
    reply = push_rows(shard, rows(1, T, 4, NEW.fingerprint))
    assert (reply.outcome, reply.version) == (pb.APPLIED, T + 1)


def test_a_row_push_in_the_old_layout_at_the_tables_round_is_layout_moved_naming_the_newest_layout(switched):
    error = refused(lambda: push_rows(switched, rows(0, T, 4, OLD.fingerprint)), grpc.StatusCode.FAILED_PRECONDITION,
                    "layout_epoch is 0", "base version 3 is at or after table 'emb''s round 3",
                    unchanged=BothLayouts(switched))
    trailers = dict(error.trailing_metadata())
    assert (trailers["ps-reason"], trailers["ps-layout"]) == ("layout-moved", "1")
    still_serves(switched)


def test_a_row_push_in_the_new_layout_before_the_tables_round_is_layout_moved(switched):
    refused(lambda: push_rows(switched, rows(1, T - 1, 4, NEW.fingerprint)), grpc.StatusCode.FAILED_PRECONDITION,
            "layout_epoch is 1", "base version 2 is before table 'emb''s round 3, where layout 1 starts",
            unchanged=BothLayouts(switched))
    still_serves(switched)


def test_a_row_pull_in_the_old_layout_is_answered_up_to_the_tables_round_and_layout_moved_past_it(switched):
    assert pull(switched, 0, T, OLD.fingerprint).version == T  # the state both layouts hold: the tombstone's
    still_serves(switched)
    refused(lambda: pull(switched, 0, T + 1, OLD.fingerprint), grpc.StatusCode.FAILED_PRECONDITION,
            "layout_epoch is 0", "version 4 is past table 'emb''s round 3", unchanged=BothLayouts(switched))
    assert pull(switched, 1, T + 1, NEW.fingerprint).version == T + 1


def test_a_step_whose_parts_name_two_layouts_is_refused_invalid_argument_naming_both(switched):
    h = switched.header(n=P // 2, version=R, fingerprint=NEW.fingerprint, sequence=3)
    h.layout_epoch = 1
    msgs = [StepMessage(0, dense=c) for c in encode(wire_tensor(torch.ones(P // 2), pb.FLOAT32), h, 1024)]
    msgs += [StepMessage(1, rows=c) for c in rows(0, T, 4, NEW.fingerprint)]
    call = switched.channel.stream_stream(method("Step"), serialize_step, parse_step)
    refused(lambda: list(call(iter(msgs), timeout=10)), grpc.StatusCode.INVALID_ARGUMENT,
            "part 1 names layout_epoch 0 but part 0 names 1: one layout a Step", unchanged=BothLayouts(switched))
    still_serves(switched)
