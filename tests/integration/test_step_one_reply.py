"""A Step's reply in one message (StepChunk.one_reply) against real shards on loopback: packed and streamed replies
carry the same bytes and a trainer ends with the same bits either way (reading its reply with a unary call); a
reply past the bound (limits.ONE_REPLY_BYTES, or half the shard's message limit) streams instead (counted); a
caller that does not ask gets the stream; the flag anywhere but the first message is refused with the shard's
state unchanged; a trainer against a shard from before one_reply asks for the stream after one refusal."""

from __future__ import annotations

import grpc
import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stepwire import StepMessage, one_message, parse_step, serialize_step
from psserver.protocol.stubs import method
from tests.conftest import P
from tests.helpers import refused
from tests.integration.test_row_prefetch import B, Rec, batch
from tests.integration.test_sparse_rpc import rows_chunks
from tests.integration.test_step_rpc import dense, rows, started, table_reply, weights
from trainer.stepping.api import connect


def _messages(raw, msgs, one_reply: bool, unary: bool = True) -> list[StepMessage]:
    """One Step call's reply messages as received (not flattened)."""
    if unary:
        call = raw.channel.unary_stream(method("Step"), serialize_step, parse_step)
        return list(call(one_message(msgs, one_reply), timeout=10))
    msgs[0].one_reply = one_reply
    return list(raw.channel.stream_stream(method("Step"), serialize_step, parse_step)(iter(msgs), timeout=10))


def _by_part(messages) -> dict[int, list]:
    out: dict[int, list] = {}
    for message in messages:
        for m in message.flat():
            out.setdefault(m.part, []).append(m.dense if m.dense is not None else m.rows)
    return out


def _step(raw, grad):
    return dense(raw, grad) + rows(1, rows_chunks([1, 2]), [1, 2, 3])


def _same_replies(a: dict, b: dict) -> None:
    ha, wa = weights(a[0])
    hb, wb = weights(b[0])
    assert (ha.outcome, ha.version, ha.length) == (hb.outcome, hb.version, hb.length) and torch.equal(wa, wb)
    assert [bytes(c.data) for c in a[0]] == [bytes(c.data) for c in b[0]]
    ra, rb = table_reply(a[1]), table_reply(b[1])
    assert ra[0] == rb[0] and ra[1] == rb[1] and torch.equal(ra[2], rb[2])
    assert [c.rows for c in a[1]] == [c.rows for c in b[1]]


def test_a_packed_reply_is_one_message_with_the_bytes_of_the_streamed_reply(shard_server):
    packed_shard, streamed_shard = started(shard_server), started(shard_server)
    grad = torch.linspace(-1, 1, P)
    packed = _messages(packed_shard, _step(packed_shard, grad), one_reply=True)
    streamed = _messages(streamed_shard, _step(streamed_shard, grad), one_reply=False)
    assert len(packed) == 1 and len(streamed) > 1, (len(packed), len(streamed))
    _same_replies(_by_part(packed), _by_part(streamed))
    assert packed_shard.stats().counters["step_replies_packed"] == 1
    assert streamed_shard.stats().counters.get("step_replies_packed", 0) == 0


def test_a_streamed_request_asking_one_reply_gets_one_message_too(shard_server):
    raw = started(shard_server)
    assert len(_messages(raw, _step(raw, torch.ones(P)), one_reply=True, unary=False)) == 1


def test_a_reply_past_half_the_message_limit_streams_as_without_one_reply_and_is_counted(shard_server):
    # the dense reply alone (P float32 weights, 4,000 bytes) passes half a 2,048-byte message limit
    small, plain = [started(shard_server, chunk_bytes=256, max_message_bytes=2048) for _ in range(2)]
    grad = torch.linspace(-1, 1, P)
    over = _messages(small, _step(small, grad), one_reply=True, unary=False)  # (each request chunk under 2,048)
    streamed = _messages(plain, _step(plain, grad), one_reply=False, unary=False)
    assert len(over) == len(streamed) > 1 and all(not m.more for m in over)
    _same_replies(_by_part(over), _by_part(streamed))
    c = small.stats().counters
    assert c["step_replies_over_limit"] == 1 and c.get("step_replies_packed", 0) == 0


def test_one_reply_on_a_later_message_is_refused_naming_it_and_changes_nothing(shard_server):
    raw = started(shard_server)
    msgs = _step(raw, torch.ones(P))
    msgs[1].one_reply = True
    call = raw.channel.stream_stream(method("Step"), serialize_step, parse_step)
    refused(lambda: list(call(iter(msgs), timeout=10)), grpc.StatusCode.INVALID_ARGUMENT,
            "one_reply is set on message 2", "only the first message", unchanged=raw)
    assert raw.stats().version == 0
    assert weights(_by_part(_messages(raw, _step(raw, torch.ones(P)), True))[0])[0].outcome == pb.APPLIED


def test_one_reply_on_a_chunk_inside_more_is_refused_and_changes_nothing(shard_server):
    raw = started(shard_server)
    msgs = _step(raw, torch.ones(P))
    msgs[-1].one_reply = True  # nested in the one message's `more`
    call = raw.channel.unary_stream(method("Step"), serialize_step, parse_step)
    refused(lambda: list(call(one_message(msgs), timeout=10)), grpc.StatusCode.INVALID_ARGUMENT,
            "a chunk in `more` sets one_reply", unchanged=raw)
    assert raw.stats().version == 0
    assert weights(_by_part(_messages(raw, _step(raw, torch.ones(P)), True))[0])[0].outcome == pb.APPLIED


def _train(addresses: str, one_reply: bool, steps: int = 6) -> tuple[dict, dict]:
    """One sync trainer with prefetch and one-call steps: (its final rows and weights, its counters)."""
    torch.manual_seed(0)
    model = Rec("adagrad")
    with connect(addresses, model, mode="sync", optimizer={"name": "sgd", "lr": 0.1}, retry_budget=60.0) as ps:
        ps.step_call.one_reply = one_reply
        batches = ps.prefetching([batch(0, k) for k in range(steps)], forward=lambda m, b: m(*b[:3]))
        for users, items, regions, y in batches:
            ((model(users, items, regions) - y).pow(2).mean()).backward()
            ps.step(num_samples=B)
        out = {n: ps.rows.pull(n, torch.arange(40)) for n in ("user", "item")}
        out.update({k: v.clone() for k, v in model.state_dict().items()})
        return out, dict(ps.counters)


def test_a_trainer_asking_one_reply_ends_with_the_bits_of_one_taking_the_stream(shard_server):
    packed_shards = [shard_server(shard=i) for i in range(2)]
    streamed_shards = [shard_server(shard=i) for i in range(2)]
    packed, pc = _train(",".join(s.server.address for s in packed_shards), one_reply=True)
    streamed, sc = _train(",".join(s.server.address for s in streamed_shards), one_reply=False)
    for name, value in streamed.items():
        assert torch.equal(packed[name], value), name
    assert pc["step_calls"] == sc["step_calls"] > 0 and pc.get("step_calls_fallen_back", 0) == 0
    assert pc["step_calls_unary"] == pc["step_calls"] and sc.get("step_calls_unary", 0) == 0
    assert [s.stats().counters["step_replies_packed"] for s in packed_shards] == [pc["step_calls"] // 2] * 2
    assert [s.stats().counters.get("step_replies_packed", 0) for s in streamed_shards] == [0, 0]
