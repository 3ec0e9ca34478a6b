"""128 trainers against one real ps-server process: every round closes with all of them, health answers throughout.

The trainers are threads of the test process using the public API (``trainer.connect``); the shard is a
real ``ps-server`` (trainer.local.procs.start_shard).  A prober thread asks grpc.health.v1 Health.Check over a
channel of its own for as long as the trainers run and records every answer.

The shard runs with its default flags: each trainer has a connection of its own (the client asks gRPC not
to share one among the process's channels), so the per-connection limit never sees 128 calls at once.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.protocol.stubs import fetch_stat
from trainer.stepping.api import connect
from trainer.local.procs import start_shard

pytestmark = pytest.mark.cluster

NUM_TRAINERS = 128
STEPS = 3
BATCH = 8
DEADLINE = 100.0  # seconds for the whole job; the test fails naming the trainers still running


class Run:
    """What the trainer threads report: per-rank results; ``changed`` is notified as each one ends."""

    def __init__(self, address: str):
        self.address = address
        self.results: dict[int, tuple] = {}
        self.changed = threading.Condition()

    def report(self, rank: int, result: tuple) -> None:
        with self.changed:
            self.results[rank] = result
            self.changed.notify_all()

    def over(self) -> bool:
        """Every trainer ended, or one failed (the test then stops waiting for the rest)."""
        return len(self.results) == NUM_TRAINERS or any(r[0] == "error" for r in self.results.values())


def train(run: Run, rank: int) -> None:
    """One trainer: connect, STEPS sync steps on a tiny model, close; reports its versions and weights or its error."""
    g = torch.Generator().manual_seed(rank)
    model = torch.nn.Linear(4, 2)
    trainer_id = f"scale-rank{rank}"
    try:
        ps = connect(run.address, model, mode="sync", rank=rank, num_trainers=NUM_TRAINERS,
                     optimizer={"name": "sgd", "lr": 0.1}, trainer_id=trainer_id, connect_timeout=120.0,
                     round_timeout=120.0)
    except BaseException as e:  # noqa: BLE001 -- reported by the test, per rank (connect left the job itself)
        run.report(rank, ("error", f"connect: {e!r}"))
        return
    versions = []
    try:
        for _ in range(STEPS):
            x = torch.randn(BATCH, 4, generator=g)
            (model(x) - x[:, :2]).pow(2).mean().backward()
            versions.append(ps.step(num_samples=BATCH).versions)
        ps.close()
        run.report(rank, ("ok", versions, [p.detach().clone() for p in model.parameters()]))
    except BaseException as e:  # noqa: BLE001
        run.report(rank, ("error", f"step {len(versions) + 1}: {e!r}"))
        try:
            ps.close()  # leaves the job: the others' rounds stop waiting for this trainer
        except BaseException:  # noqa: BLE001
            pass


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


def test_128_trainer_threads_run_sync_rounds_on_one_default_shard_while_health_answers(tmp_path):
    shard = start_shard(0, tmp_path / "shard0.log")
    run = Run(shard.address)
    answers: list[str] = []
    stop = threading.Event()
    prober = threading.Thread(target=probe_health, args=(shard.address, stop, answers), name="health-prober",
                              daemon=True)
    trainers = [threading.Thread(target=train, args=(run, rank), name=f"trainer{rank}", daemon=True)
                for rank in range(NUM_TRAINERS)]
    t0 = time.monotonic()
    try:
        prober.start()
        for t in trainers:
            t.start()
        with run.changed:
            run.changed.wait_for(run.over, DEADLINE)
        errors = {r: v[1] for r, v in run.results.items() if v[0] == "error"}
        assert not errors, (f"{len(errors)} trainers failed, e.g. {sorted(errors.items())[:2]}; "
                            f"shard log:\n{shard.log_tail(10)}")
        running = [t.name for t in trainers if t.is_alive() and int(t.name[7:]) not in run.results]
        assert len(run.results) == NUM_TRAINERS, (f"{len(running)} trainers still running after {DEADLINE:.0f} s: "
                                                  f"{running[:10]}; shard log:\n{shard.log_tail(30)}")
        elapsed = time.monotonic() - t0
        stop.set()
        prober.join(30)
        assert not prober.is_alive(), "the health prober did not stop"
        stats = fetch_stat(shard.address)
    finally:
        stop.set()
        # On a failure the others wind down once the failed ones left; the shard goes only after them.
        give_up = time.monotonic() + 60
        for t in trainers:
            t.join(max(0.0, give_up - time.monotonic()))
        shard.kill()
        for t in trainers:  # any still waiting see the shard gone
            t.join(90)
        prober.join(30)

    for rank, (_, versions, _) in run.results.items():
        assert versions == [[step + 1] for step in range(STEPS)], (rank, versions)  # one sync round per step
    final = run.results[0][2]
    for rank, (_, _, params) in run.results.items():  # every trainer ends on the same weights
        assert all(torch.equal(a, b) for a, b in zip(params, final)), rank
    assert answers and all(a == "SERVING" for a in answers), [a for a in answers if a != "SERVING"][:5]
    assert stats.version == STEPS
    assert stats.counters["rounds_all_arrived"] == STEPS, dict(stats.counters)
    assert stats.counters["rounds_membership"] == 0 and stats.counters["lease_expired"] == 0
    print(f"{NUM_TRAINERS} trainers x {STEPS} steps in {elapsed:.1f} s; {len(answers)} health checks, all SERVING")
