"""The step engine (psserver/step_engine.py) against the general path it stands in for, on real shards on loopback.

Differential: the same jobs and the same hand-made step sequences run on shards with the engine and on shards
without it (``ServiceLimits(step_engine=False)``, what ``ps-server --no-step-engine`` sets) and must give the same
trainers' results, the same shard state digests, the same counters (but the engine's own) and, step by step, the
same reply bytes -- retries, a stale push, refusals and a new job included.  And the engine must have run the
steady state (``step_engine_steps``), or the comparison would be of the general path with itself.
"""

from __future__ import annotations

import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stepwire import StepMessage, one_message, parse_step, serialize_step
from psserver.protocol.stubs import method
from psserver.service import ServiceLimits
from tests.conftest import P
from tests.helpers import refused, run_ranks
from tests.integration.test_row_prefetch import B, STEPS, Rec, batch
from tests.integration.test_sparse_rpc import job, rows_chunks
from tests.integration.test_step_rpc import dense, rows
from trainer.api import connect

ENGINE_OWN = ("step_engine_steps", "step_engine_misses")


def limits(engine: bool) -> ServiceLimits:
    return ServiceLimits(min_chunk_bytes=256, step_engine=engine)


def state_digest(raw) -> str:
    """The shard's state digest, read in the process (the job's trainers have left: no member to ask as)."""
    return raw.server.layouts.host(0).part(0).state_digest()


# Gauges of time and of the machine's free memory at the shard's start, and where a call's table work ran (on the
# loop or the state worker: whether the worker was busy at that moment, with several trainers): not the same in
# any two runs of one path.
MEASURED = ("seconds", "row_limit", "memory_budget_bytes", "memory_tables_budget_bytes", "memory_reserved_bytes",
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
