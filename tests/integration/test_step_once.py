"""The unary StepOnce RPC against real shards on loopback: it answers the bytes a Step packed into one message
answers; a retry under the same numbers applies nothing twice; every refusal of Step's battery is StepOnce's too
(the same checks: one status, the message naming the field and both values, the state digest unchanged, the shard
still serving), and a reply past the one-message bound is refused before any part runs.  A trainer on StepOnce
ends with the bits of one on Step; a StepOnce whose reply is lost (on shard 1, whose call runs on a pool thread) is
retried and applied once; against a shard without StepOnce the trainer falls back to Step once, counted, and ends
with the same bits."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stepwire import StepMessage, one_message, parse_step, serialize_step
from psserver.protocol.stubs import method
from tests.conftest import P
from tests.helpers import refused, wait_until
from tests.integration.switchproxy import SwitchProxy
from tests.integration.test_row_prefetch import B, STEPS, Rec, batch
from tests.integration.test_sparse_rpc import rows_chunks
from tests.integration.test_step_rpc import CASES, _cases, dense, rows, started, table_reply, weights
from trainer.stepping.api import connect


def once(raw, msgs: list[StepMessage]) -> dict[int, list]:
    """One StepOnce call: each part's reply chunks by part number (from its one reply message)."""
    call = raw.channel.unary_unary(method("StepOnce"), serialize_step, parse_step)
    reply = call(one_message(msgs), timeout=10)
    out: dict[int, list] = {}
    for m in reply.flat():
        out.setdefault(m.part, []).append(m.dense if m.dense is not None else m.rows)
    return out


def packed_step(raw, msgs: list[StepMessage]) -> dict[int, list]:
    """The same step as a Step asking one reply, read with a unary call (the trainer's way before StepOnce)."""
    call = raw.channel.unary_unary(method("Step"), serialize_step, parse_step)
    out: dict[int, list] = {}
    for m in call(one_message(msgs, True), timeout=10).flat():
        out.setdefault(m.part, []).append(m.dense if m.dense is not None else m.rows)
    return out


def _step(raw, grad, sequence=1):
    return dense(raw, grad, sequence=sequence) + rows(1, rows_chunks([1, 2], seq=sequence), [1, 2, 3])


def test_step_once_answers_the_bytes_of_a_step_packed_into_one_message(shard_server):
    a, b = started(shard_server), started(shard_server)
    grad = torch.linspace(-1, 1, P)
    got, expected = once(a, _step(a, grad)), packed_step(b, _step(b, grad))
    assert [bytes(c.data) for c in got[0]] == [bytes(c.data) for c in expected[0]]
    assert weights(got[0])[0].outcome == pb.APPLIED
    ra, rb = table_reply(got[1]), table_reply(expected[1])  # (each shard names its pull its own way: pull_ref)
    assert ra[0] == rb[0] and ra[1] == rb[1] and torch.equal(ra[2], rb[2])
    assert [c.rows for c in got[1]] == [c.rows for c in expected[1]]
    ca = a.stats().counters
    assert ca["step_calls_once"] == ca["step_calls"] == 1 and ca["step_replies_packed"] == 1
    assert b.stats().counters.get("step_calls_once", 0) == 0


def test_a_step_once_retried_under_the_same_numbers_applies_nothing_twice_and_answers_the_same(shard_server):
    raw = started(shard_server)
    grad = torch.linspace(-1, 1, P)
    first, again = once(raw, _step(raw, grad)), once(raw, _step(raw, grad))
    assert weights(first[0])[0].outcome == pb.APPLIED and weights(again[0])[0].outcome == pb.DUPLICATE
    assert torch.equal(weights(first[0])[1], weights(again[0])[1])
    assert table_reply(again[1])[0].outcome == pb.DUPLICATE and torch.equal(table_reply(first[1])[2],
                                                                             table_reply(again[1])[2])
    st = raw.stats()
    assert st.version == 1 and st.counters["table.emb.pushes_applied"] == 1


@pytest.mark.parametrize("case", [c for c in CASES if c != "empty stream"])  # (a unary call has its one message)
def test_a_step_once_is_refused_as_step_is_and_changes_no_state_and_the_shard_goes_on_serving(shard_server, case):
    raw = started(shard_server)
    msgs, code, *fragments = _cases(raw)[case]
    refused(lambda: once(raw, msgs), code, *fragments, unchanged=raw)
    assert raw.stats().counters.get("table.emb.pushes_applied", 0) == 0 and raw.stats().version == 0
    after = once(raw, dense(raw, torch.ones(P)) + rows(1, rows_chunks([1]), [1]))  # still serving
    assert weights(after[0])[0].outcome == pb.APPLIED and table_reply(after[1])[0].outcome == pb.APPLIED


def test_a_step_once_whose_reply_would_pass_the_one_message_bound_is_resource_exhausted_before_any_part_runs(
        shard_server):
    # a 8,192-byte message limit bounds one reply at 4,096 bytes: P float32 weights (4,000) and 99 rows of 4 (1,584)
    raw = started(shard_server, chunk_bytes=1024, max_message_bytes=8192)
    msgs = dense(raw, torch.ones(P)) + rows(1, rows_chunks([1]), list(range(1, 100)))
    refused(lambda: once(raw, msgs), grpc.StatusCode.RESOURCE_EXHAUSTED, "StepOnce's reply would carry 5584 bytes",
            "4000 of weights, 1584 of rows", "limit of 4096 bytes", "send it as a Step", unchanged=raw)
    assert raw.stats().version == 0 and raw.stats().counters["refused_RESOURCE_EXHAUSTED"] == 1
    assert weights(once(raw, dense(raw, torch.ones(P)))[0])[0].outcome == pb.APPLIED  # the weights alone fit


def _train(addresses: str, once_on: bool, during=None) -> tuple[dict, dict]:
    """One sync trainer with prefetch and one-call steps: (its final rows and weights, its counters)."""
    torch.manual_seed(0)
    model = Rec("adagrad")
    with connect(addresses, model, mode="sync", optimizer={"name": "sgd", "lr": 0.1}, retry_budget=60.0) as ps:
        ps.step_call.once = once_on
        batches = ps.prefetching([batch(0, k) for k in range(STEPS)], forward=lambda m, b: m(*b[:3]))
        for k, (users, items, regions, y) in enumerate(batches):
            ((model(users, items, regions) - y).pow(2).mean()).backward()
            (during or (lambda k, step: step()))(k, lambda: ps.step(num_samples=B))
        out = {n: ps.rows.pull(n, torch.arange(40)) for n in ("user", "item")}
        out.update({k: v.clone() for k, v in model.state_dict().items()})
        return out, dict(ps.counters)


def _same(got: dict, expected: dict) -> None:
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_a_trainer_on_step_once_ends_with_the_bits_of_one_on_step(shard_server):
    on_once = [shard_server(shard=i) for i in range(2)]
    on_step = [shard_server(shard=i) for i in range(2)]
    got, c = _train(",".join(s.server.address for s in on_once), True)
    expected, c_step = _train(",".join(s.server.address for s in on_step), False)
    _same(got, expected)
    assert c["step_calls_once"] == c["step_calls"] == c_step["step_calls"] > 0
    assert c.get("step_calls_fallen_back", 0) == 0 and c_step.get("step_calls_once", 0) == 0
    assert [s.stats().counters["step_calls_once"] for s in on_once] == [c["step_calls"] // 2] * 2


def test_a_step_once_whose_reply_was_lost_on_a_pool_threads_shard_is_retried_and_applied_once(shard_server):
    shards = [shard_server(shard=i) for i in range(2)]
    proxy = SwitchProxy(shards[1].server.address)  # shard 1: its call runs on a pool thread (map_settled)
    lossy = 3

    def during(k, step):
        if k != lossy:
            return step()
        proxy.swallow_replies()
        t = threading.Thread(target=step)
        t.start()
        wait_until(lambda: shards[1].stats().counters["step_calls"] == lossy + 1, "the lossy step to reach shard 1")
        proxy.forward()  # the connection that lost the reply is reset: the StepOnce is retried under its numbers
        t.join(timeout=120)
        assert not t.is_alive()

    try:
        got, counters = _train(f"{shards[0].server.address},{proxy.address}", True, during=during)
    finally:
        proxy.close()
    c1 = shards[1].stats().counters
    assert c1["duplicates"] == 1 and sum(c1[f"table.{t}.pushes_duplicate"] for t in ("user", "item", "region")) == 3
    for s in shards:
        st = s.stats()
        assert st.version == STEPS and all(st.counters[f"table.{t}.version"] == STEPS
                                           for t in ("user", "item", "region"))
    assert counters["retries"] >= 1 and counters.get("step_calls_fallen_back", 0) == 0
    expected, _ = _train(",".join(shard_server(shard=i).server.address for i in range(2)), True)
    _same(got, expected)
