"""Layout routing over real gRPC (stage 3 of docs/design/live-reshard.md): a one-shard sync job switched offline, at
round R = 2, to layout 1 -- two shards, this process shard 0 -- and the calls each layout refuses.  Each refusal:
its one status, its reason (and newest layout) in the trailers, a message naming the layout sent, the newest
one and the base or version, both layouts' state digests unchanged, and the shard still serving."""

import dataclasses

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.errors import LAYOUT_METADATA_KEY, REASON_METADATA_KEY
from psserver.protocol.layout import Layout
from psserver.protocol.layouts import moved_layout, new_job
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.rules import refused_layout_ahead, refused_layout_moved
from psserver.protocol.stepwire import StepMessage, parse_step, serialize_step
from psserver.protocol.stubs import method
from tests.conftest import P, make_spec
from tests.helpers import refused, wait_until
from tests.offline_switch import switch_layout_offline

OLD = make_spec()
OLD = dataclasses.replace(OLD, fingerprint=Layout.from_shapes(OLD.tensors, 1).fingerprint())
NEW = new_job(OLD, 2)  # layout 1: shard 0 of two holds [0, P/2)
R = 2  # the round layout 1 starts at
HALF = P // 2


def push(shard, layout, base, fingerprint, n, sequence=0, rank=0):
    h = shard.header(rank=rank, n=n, version=base, fingerprint=fingerprint, sequence=sequence)
    h.layout_epoch = layout
    return shard.stub.Push(encode(wire_tensor(torch.ones(n), pb.FLOAT32), h, 1024), timeout=10)


def init(shard, fingerprint=OLD.fingerprint):
    h = shard.header(fingerprint=fingerprint)
    assert shard.stub.Init(encode(wire_tensor(torch.zeros(P), pb.FLOAT32), h, 1024), timeout=10).accepted


def pull(shard, layout, version, fingerprint):
    chunks = list(shard.stub.Pull(pb.PullRequest(rank=0, trainer_id="t0", fingerprint=fingerprint, min_version=version,
                                                 dtype=pb.FLOAT32, layout_epoch=layout), timeout=10))
    return chunks[0].header, sum(len(c.data) for c in chunks) // 4


class BothLayouts:
    """What ``refused(unchanged=...)`` compares: layout 1's digest (GetStats, as a member) and the tombstone's,
    layout 0's (read in-process: GetStats serves the newest layout)."""

    def __init__(self, shard):
        self.shard = shard

    def digest(self):
        tombstone = self.shard.server.layouts.host(0).part(0).state_digest()
        return self.shard.digest(fingerprint=NEW.fingerprint), tombstone


@pytest.fixture
def switched(shard_server):
    """Layout 0 ran rounds 0 and 1 (pushes numbered 1 and 2); then layout 1 from round 2."""
    shard = shard_server()
    shard.register(spec=OLD)
    init(shard)
    for base in (0, 1):
        reply = push(shard, 0, base, OLD.fingerprint, P, sequence=base + 1)
        assert (reply.outcome, reply.layout_epoch) == (pb.APPLIED, 0)
    layout = switch_layout_offline(shard.server, 2, 0)
    assert (layout.number, layout.round, layout.num_shards, layout.fingerprint) == (1, R, 2, NEW.fingerprint)
    return shard


def still_serves(shard, base=R):
    reply = push(shard, 1, base, NEW.fingerprint, HALF)
    assert (reply.outcome, reply.version, reply.layout_epoch) == (pb.APPLIED, base + 1, 1)


def trailers(error):
    return dict(error.trailing_metadata() or ())


def test_a_push_in_the_old_layout_at_the_switch_round_is_layout_moved_naming_the_newest_layout(switched):
    error = refused(lambda: push(switched, 0, R, OLD.fingerprint, P), grpc.StatusCode.FAILED_PRECONDITION,
                    "layout_epoch is 0", "newest layout is 1", "base version 2 is at or after round 2",
                    unchanged=BothLayouts(switched))
    assert trailers(error)[REASON_METADATA_KEY] == "layout-moved" and trailers(error)[LAYOUT_METADATA_KEY] == "1"
    assert refused_layout_moved(error) == 1
    assert switched.stats(fingerprint=NEW.fingerprint).counters["refused_layout_moved"] == 1
    still_serves(switched)


def test_a_pull_in_the_old_layout_past_the_switch_round_is_layout_moved_and_up_to_it_the_tombstone_answers(
        switched):
    error = refused(lambda: pull(switched, 0, R + 1, OLD.fingerprint), grpc.StatusCode.FAILED_PRECONDITION,
                    "layout_epoch is 0", "newest layout is 1", "version 3 is past round 2",
                    unchanged=BothLayouts(switched))
    assert refused_layout_moved(error) == 1
    header, n = pull(switched, 0, R, OLD.fingerprint)
    assert (header.version, n, header.layout_epoch) == (R, P, 1)  # the old slot whole, at version R
    still_serves(switched)


def test_a_layout_epoch_from_the_future_is_out_of_range_layout_ahead(switched):
    error = refused(lambda: push(switched, 5, R, NEW.fingerprint, HALF), grpc.StatusCode.OUT_OF_RANGE,
                    "layout_epoch is 5", "knows layouts 0 to 1", unchanged=BothLayouts(switched))
    assert trailers(error)[REASON_METADATA_KEY] == "layout-ahead" and refused_layout_ahead(error)
    refused(lambda: pull(switched, 5, R, NEW.fingerprint), grpc.StatusCode.OUT_OF_RANGE, "layout_epoch is 5",
            unchanged=BothLayouts(switched))
    still_serves(switched)


def test_a_push_in_the_new_layout_with_a_base_before_its_round_is_layout_moved(switched):
    error = refused(lambda: push(switched, 1, R - 1, NEW.fingerprint, HALF), grpc.StatusCode.FAILED_PRECONDITION,
                    "layout_epoch is 1", "newest layout is 1", "base version 1 is before round 2",
                    "where layout 1 starts", unchanged=BothLayouts(switched))
    assert refused_layout_moved(error) == 1
    still_serves(switched)


def test_the_fingerprint_is_checked_against_the_layout_the_call_names(switched):
    refused(lambda: push(switched, 1, R, OLD.fingerprint, HALF), grpc.StatusCode.FAILED_PRECONDITION,
            f"fingerprint is '{OLD.fingerprint}' but the job's is '{NEW.fingerprint}'", unchanged=BothLayouts(switched))
    refused(lambda: push(switched, 0, R - 1, NEW.fingerprint, P, sequence=2), grpc.StatusCode.FAILED_PRECONDITION,
            f"fingerprint is '{NEW.fingerprint}' but the job's is '{OLD.fingerprint}'", unchanged=BothLayouts(switched))
    still_serves(switched)


def test_a_retry_in_the_old_layout_of_an_acknowledged_push_is_answered_duplicate_by_the_tombstone(switched):
    before = BothLayouts(switched).digest()
    reply = push(switched, 0, R - 1, OLD.fingerprint, P, sequence=2)
    assert reply.outcome == pb.DUPLICATE and reply.layout_epoch == 1
    assert BothLayouts(switched).digest() == before
    still_serves(switched)


def test_a_register_in_the_old_layout_after_the_switch_is_layout_moved(switched):
    request = pb.RegisterRequest(rank=0, trainer_id="t0", job=OLD.to_proto(), layout_epoch=0)
    error = refused(lambda: switched.stub.Register(request, timeout=10), grpc.StatusCode.FAILED_PRECONDITION,
                    "layout_epoch is 0 but this shard's newest layout is 1, from round 2",
                    unchanged=BothLayouts(switched))
    assert refused_layout_moved(error) == 1
    reply = switched.stub.Register(pb.RegisterRequest(rank=0, trainer_id="t0", job=NEW.to_proto(), layout_epoch=1),
                                   timeout=10)
    assert (reply.layout_epoch, reply.start, reply.end) == (1, 0, HALF)
    still_serves(switched)


def test_replies_name_the_newest_layout_and_stats_carry_the_timeline(switched):
    beat = switched.stub.Heartbeat(pb.HeartbeatRequest(rank=0, trainer_id="t0", fingerprint=NEW.fingerprint),
                                   timeout=10)
    assert beat.layout_epoch == 1
    expected = [(0, 0, 1, OLD.fingerprint), (1, R, 2, NEW.fingerprint)]
    for fingerprint in (NEW.fingerprint, OLD.fingerprint):  # a trainer one layout behind reads it too
        layouts = switched.stats(fingerprint=fingerprint).layouts
        assert [(e.number, e.round, e.num_shards, e.fingerprint) for e in layouts] == expected
    assert not switched.stats(fingerprint="0" * 16).layouts  # fingerprints are the job's identity: members only


def test_a_shard_that_never_switched_serves_layout_zero_as_before_and_refuses_others_as_ahead(shard_server):
    shard = shard_server()
    shard.register(spec=OLD)
    init(shard)
    reply = push(shard, 0, 0, OLD.fingerprint, P)
    assert (reply.outcome, reply.layout_epoch) == (pb.APPLIED, 0)
    assert [(e.number, e.round, e.num_shards) for e in shard.stats(fingerprint=OLD.fingerprint).layouts] == [(0, 0, 1)]
    unchanged = type("Digest", (), {"digest": lambda self: shard.digest(fingerprint=OLD.fingerprint)})()
    refused(lambda: push(shard, 1, 1, OLD.fingerprint, P), grpc.StatusCode.OUT_OF_RANGE,
            "layout_epoch is 1 but this shard knows layouts 0 to 0", unchanged=unchanged)
    rows = pb.PullRowsRequest(rank=0, trainer_id="t0", fingerprint=OLD.fingerprint, table="emb", layout_epoch=3)
    refused(lambda: list(shard.stub.PullRows(rows, timeout=10)), grpc.StatusCode.OUT_OF_RANGE,
            "layout_epoch is 3", unchanged=unchanged)
    assert push(shard, 0, 1, OLD.fingerprint, P).outcome == pb.APPLIED


def test_a_layout_switch_is_refused_while_a_round_is_open_and_changes_nothing(shard_server):
    shard = shard_server(lease_timeout=0)
    job = dataclasses.replace(OLD, num_trainers=2)
    for rank in (0, 1):
        shard.register(rank=rank, spec=job)
    init(shard)
    for rank in (0, 1):
        push(shard, 0, 0, OLD.fingerprint, P, rank=rank)
    assert push(shard, 0, 1, OLD.fingerprint, P).outcome == pb.ACCEPTED  # round 1 open: rank 1 has not pushed
    before = shard.digest(fingerprint=OLD.fingerprint)
    with pytest.raises(ValueError, match="starts at round 1 but partition 0 is at version 1 with a round open"):
        switch_layout_offline(shard.server, 2, 0)
    assert shard.digest(fingerprint=OLD.fingerprint) == before
    assert [e.number for e in shard.stats(fingerprint=OLD.fingerprint).layouts] == [0]


def test_the_round_timer_runs_the_leases_of_a_later_layout(shard_server):
    """A member of layout 1 that goes silent is dropped there, as in layout 0: the round timer ticks every layout's
    host (else a dead trainer would hold every sync round of the new layout forever)."""
    shard = shard_server(lease_timeout=1.0)
    shard.register(spec=OLD)
    init(shard)
    push(shard, 0, 0, OLD.fingerprint, P)
    switch_layout_offline(shard.server, 2, 0)
    still_serves(shard, base=1)  # heard from in layout 1
    wait_until(lambda: not shard.stats(fingerprint=NEW.fingerprint).live_ranks, "rank 0's lease in layout 1 to expire")
    assert shard.stats(fingerprint=NEW.fingerprint).counters["lease_expired"] >= 1


def step(shard, layout, base, fingerprint, n):
    """One Step call with a dense part only: its reply chunks."""
    h = shard.header(n=n, version=base, fingerprint=fingerprint, sequence=3)
    h.layout_epoch = layout
    msgs = [StepMessage(0, dense=c) for c in encode(wire_tensor(torch.ones(n), pb.FLOAT32), h, 1024)]
    call = shard.channel.stream_stream(method("Step"), serialize_step, parse_step)
    return [m.dense for m in call(iter(msgs), timeout=10)]


def test_a_step_call_in_the_old_layout_at_the_switch_round_is_layout_moved_and_in_the_new_one_is_answered(switched):
    error = refused(lambda: step(switched, 0, R, OLD.fingerprint, P), grpc.StatusCode.FAILED_PRECONDITION,
                    "layout_epoch is 0", "base version 2 is at or after round 2", unchanged=BothLayouts(switched))
    assert refused_layout_moved(error) == 1
    chunks = step(switched, 1, R, NEW.fingerprint, HALF)
    h = chunks[0].header
    assert (h.outcome, h.version, h.length, h.layout_epoch) == (pb.APPLIED, R + 1, HALF, 1)


def test_a_register_in_the_old_layout_carries_the_newest_layout_whole_only_to_a_caller_that_named_the_job(switched):
    """A trainer started after the switch with the old --ps list learns where to go (trainer.membership.relayout.at_register);
    a caller naming another job learns no fingerprint of this one, only the refusal."""
    request = pb.RegisterRequest(rank=1, trainer_id="t1", job=OLD.to_proto(), layout_epoch=0)
    error = refused(lambda: switched.stub.Register(request, timeout=10), grpc.StatusCode.FAILED_PRECONDITION,
                    "layout_epoch is 0", unchanged=BothLayouts(switched))
    layout = moved_layout(error.trailing_metadata())
    assert (layout.number, layout.round, layout.num_shards, layout.fingerprint) == (1, R, 2, NEW.fingerprint)
    other = dataclasses.replace(OLD, fingerprint="0" * 16)
    request = pb.RegisterRequest(rank=1, trainer_id="t1", job=other.to_proto(), layout_epoch=0)
    error = refused(lambda: switched.stub.Register(request, timeout=10), grpc.StatusCode.FAILED_PRECONDITION,
                    "layout_epoch is 0", unchanged=BothLayouts(switched))
    assert refused_layout_moved(error) == 1 and moved_layout(error.trailing_metadata()) is None
    still_serves(switched)


def test_refusals_and_bytes_counted_before_a_switch_are_still_in_get_stats_and_metrics_after_it(shard_server):
    """The servicer's counts are shard-wide (psserver.state.stats.WideCounts): GetStats and the metrics read the newest
    layout's host, and once counted on layout 0's partition 0 they vanished from both at the switch."""
    shard = shard_server()
    shard.register(spec=OLD)
    init(shard)
    unchanged = type("Digest", (), {"digest": lambda self: shard.digest(fingerprint=OLD.fingerprint)})()
    refused(lambda: push(shard, 0, 0, OLD.fingerprint, P + 1), grpc.StatusCode.INVALID_ARGUMENT,
            f"length is {P + 1} elements but this shard's slice has {P}", unchanged=unchanged)
    for base in (0, 1):
        push(shard, 0, base, OLD.fingerprint, P, sequence=base + 1)
    before = shard.stats(fingerprint=OLD.fingerprint).counters
    assert before["refused_INVALID_ARGUMENT"] == 1 and before["bytes_in"] > 0
    switch_layout_offline(shard.server, 2, 0)
    after = shard.stats(fingerprint=NEW.fingerprint).counters
    assert (after["refused_INVALID_ARGUMENT"], after["bytes_in"]) == (1, before["bytes_in"])
    still_serves(shard)  # layout 1 at R + 1; the tombstone stays at R
    assert shard.stats(fingerprint=NEW.fingerprint).counters["bytes_in"] == before["bytes_in"] + 4 * HALF
    registry = shard.server.shard.metrics.registry
    assert registry.get_sample_value("psgrpc_refused_total", {"shard": "0", "code": "INVALID_ARGUMENT"}) == 1
    assert registry.get_sample_value("psgrpc_version", {"shard": "0"}) == R + 1  # the newest layout's, scraped
