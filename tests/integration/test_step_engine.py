"""The step engine (psserver/serving/step_engine.py) against the general path it stands in for, on real shards on loopback.

Differential: the same jobs and the same hand-made step sequences run on shards with the engine and on shards
without it (``ServiceLimits(step_engine=False)``, what ``ps-server --no-step-engine`` sets) and must give the same
trainers' results, the same shard state digests, the same counters (but the engine's own) and, step by step, the
same reply bytes -- retries, a stale push, refusals and a new job included.  And the engine must have run the
steady state (``step_engine_steps``), or the comparison would be of the general path with itself.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stepwire import StepMessage, one_message, parse_step, serialize_step
from psserver.protocol.stubs import method
from psserver.serving.service import ServiceLimits
from tests.conftest import P
from tests.helpers import refused, run_ranks
from tests.integration.test_row_prefetch import B, STEPS, Rec, batch
from tests.integration.test_sparse_rpc import DIM, job, rows_chunks
from tests.integration.test_step_rpc import dense, rows, started
from trainer.stepping.api import connect

ENGINE_OWN = ("step_engine_steps", "step_engine_misses")


def limits(engine: bool) -> ServiceLimits:
    return ServiceLimits(min_chunk_bytes=256, step_engine=engine)


def state_digest(raw) -> str:
    """The shard's state digest, read in the process (the job's trainers have left: no member to ask as)."""
    return raw.server.layouts.host(0).part(0).state_digest()


# Gauges of time and of the machine's free memory at the shard's start, and where a call's table work ran (on the
# loop or the state worker: whether the worker was busy at that moment, with several trainers): not the same in
# any two runs of one path.
MEASURED = ("seconds", "row_limit", "memory_rss_bytes", "memory_heap", "memory_budget_bytes", "memory_tables_budget_bytes", "memory_reserved_bytes",
            "row_work_inline", "row_work_offloaded")


def counters(raw) -> dict:
    return {k: v for k, v in raw.stats().counters.items()
            if k not in ENGINE_OWN and not any(m in k for m in MEASURED)}


# ---------------------------------------------------------------------------------------- trainers as users run them
def train(addresses: str, rank: int, trainers: int, model: Rec, out: dict) -> None:
    """A sync trainer looping over ``ps.prefetching`` (one StepOnce a shard a step); rank 0 reads the rows."""
    with connect(addresses, model, mode="sync", rank=rank, num_trainers=trainers,
                 optimizer={"name": "sgd", "lr": 0.1}) as ps:
        batches = ps.prefetching([batch(rank, k) for k in range(STEPS)], forward=lambda m, b: m(*b[:3]))
        for users, items, regions, y in batches:
            loss = (model(users, items, regions) - y).pow(2).mean() + 0.1 * model.user(users).pow(2).mean()
            loss.backward()
            ps.step(num_samples=B)
        if rank == 0:
            out["rows"] = {name: ps.rows.pull(name, torch.arange(40)) for name in ("user", "item")}
            out["dense"] = {k: v.clone() for k, v in model.state_dict().items()}


def run_job(shard_server, engine: bool, optimizer: str, trainers: int) -> tuple[dict, list]:
    """``trainers`` sync trainers with prefetch and one-call steps over 2 shards: (rank 0's rows and weights, the
    shards)."""
    shards = [shard_server(shard=i, limits=limits(engine)) for i in range(2)]
    out, models = {}, []
    for _ in range(trainers):
        torch.manual_seed(0)
        models.append(Rec(optimizer))
    addresses = ",".join(s.server.address for s in shards)
    run_ranks(lambda rank: train(addresses, rank, trainers, models[rank], out), trainers, timeout=120)
    return out, shards


@pytest.mark.parametrize("optimizer,trainers", [("adagrad", 1), ("adam", 2), ("sgd", 3)])
def test_a_job_on_shards_with_the_engine_ends_with_the_bits_digests_and_counters_of_one_without(
        shard_server, optimizer, trainers):
    got, fast = run_job(shard_server, True, optimizer, trainers)
    expected, general = run_job(shard_server, False, optimizer, trainers)
    for kind in ("rows", "dense"):
        for name, value in expected[kind].items():
            assert torch.equal(got[kind][name], value), f"{kind} {name}"
    for f, g in zip(fast, general):
        assert state_digest(f) == state_digest(g)
        assert counters(f) == counters(g)
        assert f.stats().counters["step_engine_steps"] > 0  # the engine ran the steady state
        assert g.stats().counters.get("step_engine_steps", 0) == 0


# ---------------------------------------------------------------------------------------- hand-made step sequences
def raw_step(raw, seq: int, version: int, push_ids: list[int], pull_ids: list[int], trainer_id=None) -> StepMessage:
    """One StepOnce of rank 0 as a trainer sends it: the dense gradient in one chunk, a table part pushing
    ``push_ids``' rows and pulling ``pull_ids``'."""
    h = raw.header(n=P, version=version, sequence=seq, trainer_id=trainer_id)
    grad = torch.linspace(-1, 1, P) * seq
    msgs = [StepMessage(0, dense=c) for c in encode(wire_tensor(grad, h.dtype), h, 1 << 20)]
    chunks = rows_chunks(push_ids, torch.full((len(push_ids), DIM), 0.1 * seq), seq=seq, base=version,
                         chunk_bytes=1 << 20)
    if trainer_id is not None:
        chunks[0].header.trainer_id = trainer_id
    return one_message(msgs + rows(1, chunks, pull_ids))


def answer(call, msg) -> tuple:
    """A StepOnce's reply as comparable bytes (what a reply measures, wait_seconds, and names at random, pull_ref,
    zeroed), or its refusal."""
    try:
        reply = call(msg, timeout=20)
    except grpc.RpcError as e:
        return ("refused", e.code(), e.details())
    out = []
    for m in reply.flat():
        if m.dense is not None:
            h = pb.ChunkHeader()
            h.CopyFrom(m.dense.header)
            h.wait_seconds = 0
            out.append((m.part, h.SerializeToString(), bytes(m.dense.data)))
        else:
            h = pb.RowsHeader()
            h.CopyFrom(m.rows.header)
            h.wait_seconds = h.pull_ref = 0  # (a pull's reference is each shard's own random name)
            out.append((m.part, h.SerializeToString(), bytes(m.rows.rows)))
    return ("reply", out)


STEPS_AND_FAULTS = [  # (sequence, base version, pushed ids, pulled ids, trainer id)
    (1, 0, [1, 2], [2, 3], None), (2, 1, [2, 3], [3, 4, 5], None), (3, 2, [3, 4, 5], [5], None),
    (3, 2, [3, 4, 5], [5], None),  # a retry after a lost reply: DUPLICATE, the same rows
    (9_000_000, 3, [5], [6], None),  # a sequence far ahead: refused, nothing changes
    (4, 3, [5], [6], "stranger"),  # another process in rank 0's name: refused
    (4, 9, [5], [6], None),  # a base from the future: refused
    (4, 3, [5], [6, 7], None), (5, 4, [6, 7], [1, 2], None), (6, 5, [1, 2], [], None),
]


def test_hand_made_steps_with_retries_and_refusals_answer_the_same_bytes_with_the_engine_and_without(shard_server):
    fast, general = (started(shard_server, limits=limits(engine)) for engine in (True, False))
    answers = []
    for raw in (fast, general):
        call = raw.channel.unary_unary(method("StepOnce"), serialize_step, parse_step)
        answers.append([answer(call, raw_step(raw, *step)) for step in STEPS_AND_FAULTS])
    for k, (a, b) in enumerate(zip(*answers)):
        assert a == b, f"step {k} {STEPS_AND_FAULTS[k]}: {a!r:.300} != {b!r:.300}"
    assert [a[0] for a in answers[0]] == ["reply"] * 4 + ["refused"] * 3 + ["reply"] * 3
    assert fast.digest() == general.digest() and counters(fast) == counters(general)
    assert fast.stats().counters["step_engine_steps"] >= 5  # every step after the first that went through it
