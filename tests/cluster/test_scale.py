"""128 trainers against one real ps-server process: every round closes with all of them, health answers throughout.

The trainers are threads of the test process using the public API (``trainer.connect``); the shard is a
real ``ps-server`` started with its default flags.  A prober thread asks grpc.health.v1 Health.Check
over a channel of its own for as long as the trainers run and records every answer.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.admin import fetch_stat
from trainer.api import connect
from trainer.procs import start_shard

pytestmark = pytest.mark.cluster

NUM_TRAINERS = 128
STEPS = 3
BATCH = 8
DEADLINE = 100.0  # seconds for the whole job; the test fails naming the trainers still running


def train(address: str, rank: int, results: dict) -> None:
    """One trainer: connect, STEPS sync steps on a tiny model, close; records (versions per step) or the error."""
    try:
        g = torch.Generator().manual_seed(rank)
        model = torch.nn.Linear(4, 2)
        ps = connect(address, model, mode="sync", rank=rank, num_trainers=NUM_TRAINERS,
                     optimizer={"name": "sgd", "lr": 0.1}, connect_timeout=120.0, round_timeout=120.0)
        versions = []
        try:
            for _ in range(STEPS):
                x = torch.randn(BATCH, 4, generator=g)
                loss = (model(x) - x[:, :2]).pow(2).mean()
                loss.backward()
                versions.append(ps.step(num_samples=BATCH).versions)
        finally:
            ps.close()
        results[rank] = ("ok", versions, [p.detach().clone() for p in model.parameters()])
    except BaseException as e:  # noqa: BLE001 -- reported by the test, per rank
        results[rank] = ("error", repr(e), None)


def probe_health(address: str, stop: threading.Event, answers: list) -> None:
    """Health.Check until ``stop``; every answer (a status name, or the error's code) goes into ``answers``."""
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                answers.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            except grpc.RpcError as e:
                answers.append(f"error {e.code().name}: {e.details()}")
            if stop.wait(0.05):  # paces the probes; the prober ends once the trainers are done
                return


def test_128_trainer_threads_run_sync_rounds_on_one_shard_while_health_answers(tmp_path):
    shard = start_shard(0, tmp_path / "shard0.log")
    results: dict[int, tuple] = {}
    answers: list[str] = []
    stop = threading.Event()
    prober = threading.Thread(target=probe_health, args=(shard.address, stop, answers), name="health-prober",
                              daemon=True)
    trainers = [threading.Thread(target=train, args=(shard.address, rank, results), name=f"trainer{rank}",
                                 daemon=True) for rank in range(NUM_TRAINERS)]
    t0 = time.monotonic()
    try:
        prober.start()
        for t in trainers:
            t.start()
        deadline = t0 + DEADLINE
        for t in trainers:
            t.join(max(0.0, deadline - time.monotonic()))
        running = [t.name for t in trainers if t.is_alive()]
        assert not running, (f"{len(running)} trainers still running after {DEADLINE:.0f} s: {running[:10]}; "
                             f"shard log:\n{shard.log_tail(30)}")
        elapsed = time.monotonic() - t0
        stop.set()
        prober.join(30)
        assert not prober.is_alive(), "the health prober did not stop"
        stats = fetch_stat(shard.address)
    finally:
        stop.set()
        shard.kill()  # trainers still running (a failure) see the shard gone and end within their retry budget
        for t in trainers:
            t.join(90)
        prober.join(30)

    errors = {r: v[1] for r, v in results.items() if v[0] != "ok"}
    assert not errors, f"{len(errors)} trainers failed, e.g. {list(errors.items())[:3]}"
    assert sorted(results) == list(range(NUM_TRAINERS))
    for rank, (_, versions, _) in results.items():
        assert versions == [[step + 1] for step in range(STEPS)], (rank, versions)  # one sync round per step
    final = results[0][2]
    for rank, (_, _, params) in results.items():  # every trainer ends on the same weights
        assert all(torch.equal(a, b) for a, b in zip(params, final)), rank
    assert answers and all(a == "SERVING" for a in answers), [a for a in answers if a != "SERVING"][:5]
    assert stats.version == STEPS
    assert stats.counters["rounds_all_arrived"] == STEPS, dict(stats.counters)
    assert stats.counters["rounds_membership"] == 0 and stats.counters["lease_expired"] == 0
    print(f"{NUM_TRAINERS} trainers x {STEPS} steps in {elapsed:.1f} s; {len(answers)} health checks, all SERVING")
