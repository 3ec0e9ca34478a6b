"""Faults and restarts of a partitioned job (issue 11): each partition of a shard keeps its own round,
version, sequence numbers and checkpoint, so a crash or a restart must come out right per partition.

* kill -9 mid step: two trainers (threads on the Python API, as in test_accounting_soak) push integer
  gradients through fault-injecting proxies to two real ps-server processes, every shard cut in 4
  partitions; rank 0's 13th step is held just before one partition of shard 1 until the test has killed
  shard 1 and restarted it with ``--restore`` from its version-10 checkpoints.  Plain SGD with lr 1 keeps
  every update exact, so each partition must end at exactly minus the sum of what survived: every
  acknowledged round that the checkpoint held, and every round of the restarted process -- not the
  rounds the crash rolled back, and nothing twice.
* the same crash where one trainer's retry reopens the restored round while the other, a step ahead,
  re-registers: a deadlock until the trainer pushed its step again on the restored version.
* SIGTERM with a round open: real ps-trainer processes and a gate trainer in the test (a third rank whose
  zero gradients it pushes itself) that holds every round open; shard 1 is stopped, each partition writes
  its final checkpoint, ``--restore`` brings every partition back with the same state digest, and the
  trainers finish without losing a step.
"""

from __future__ import annotations

import functools
import json
import signal
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest
import torch

from psserver.protocol.job import JobSpec
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.protocol.security import TOKEN_ENV, ClientSecurity
from psserver.state.checkpoint import list_checkpoints, load_newest
from tests.cluster.faultproxy import FaultProxy
from tests.cluster.helpers import pull_params, restart_on_its_port
from tests.helpers import wait_until
from tests.integration.switchproxy import SwitchProxy
from trainer import connect
from trainer.stepping.api import make_job
from trainer.channels.client import ShardedClient
from trainer.local.procs import start_shard, start_trainer, wait_all

ACKED = {"applied", "accepted", "duplicate"}


def part_stats(address: str, partition: int, digest_as: "Gate | None" = None,
               security: ClientSecurity = ClientSecurity()) -> pb.StatsReply:
    """GetStats of one partition (its version, range, round; counters summed over partitions), with its digest
    when ``digest_as`` names the member that asks for it (the shard refuses digests to strangers)."""
    request = pb.StatsRequest(partition=partition)
    if digest_as is not None:
        request.with_digest, request.rank, request.trainer_id = True, digest_as.rank, digest_as.trainer_id
        request.fingerprint = digest_as.job.fingerprint
    with security.channel(address) as ch:
        return pb_grpc.ParameterServerStub(ch).GetStats(request, timeout=30)


def checkpoint_dir(root, partition: int):
    """Where a partition's checkpoints go (psserver.partition.host): the root for partition 0, partition-K below it."""
    return root if partition == 0 else root / f"partition-{partition}"


def newest_version(root, shard: int, partition: int) -> int:
    directory = checkpoint_dir(root, partition)
    files = list_checkpoints(directory, shard) if directory.is_dir() else []
    return int(files[0].name.split("-v")[1].split(".")[0]) if files else -1


# -- kill -9 mid step: exact accounting per partition --------------------------------------------------------------

PIECES, PIECE, TRAINERS, STEPS = 4, 5_000, 2, 30
P = PIECES * PIECE  # 10,000 elements a shard: 40 units of 256
PARTITION_BYTES = 12_000  # 4 partitions a shard (2,560, 2,560, 2,560, 2,320 elements)
PARTS = 4
EVERY, HOLD_STEP = 5, 12  # the kill comes while shard 1 is at version 12 or 13; its newest checkpoints are at 10
HELD_SLOT = PARTS + 1  # rank 0's exchange waits before shard 1 partition 1: the step is half done when it dies


class Pieces(torch.nn.Module):
    """Four parameter tensors (four modules: the pipelined forward waits for each one's own partitions);
    ``forward(c)`` is ``sum(w * c)``, so backward leaves the integers ``c`` in the gradient, exactly."""

    def __init__(self):
        super().__init__()
        self.pieces = torch.nn.ModuleList(Piece() for _ in range(PIECES))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return sum(p(chunk) for p, chunk in zip(self.pieces, c.split(PIECE)))


class Piece(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(PIECE))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


@dataclass(frozen=True)
class Record:
    """One slot's answered exchange: what was pushed on which version, what the shard said, and how many
    times this trainer had re-registered with that slot's shard when it did."""

    slot: int
    base: int
    outcome: str
    grad: torch.Tensor
    rejoins: int


class SlotLog:
    """Wraps one trainer's per-slot exchange and re-registration (trainer.stepping.exchange, trainer.membership.session) to record every slot's outcome;
    ``hold(slot, step)`` runs before a slot's exchange starts (``step``: the dense steps completed before it)."""

    def __init__(self, ps, records: list, hold=None):
        self.rejoins = Counter()
        exchange, register_again = ps.exchange.exchange_slot, ps.session.rejoins.register_again

        def recorded(s, grad, num_samples, attempt):
            start, end = ps.ranges[s.slot]
            before, sent, rejoins = ps.versions[s.slot], grad[start:end].clone(), self.rejoins[s.slot]
            if hold is not None:
                hold(s.slot, ps.steps)
            outcome = exchange(s, grad, num_samples, attempt)
            # The base the answered push carried: a sync reply streams the close of its round (base + 1) -- after
            # a re-registration that is the version the shard resumed at, not the one the step began on.
            base = ps.versions[s.slot] - 1
            assert base == before or self.rejoins[s.slot] > rejoins or outcome not in ACKED, (s.slot, before, base)
            records.append(Record(s.slot, base, outcome, sent, self.rejoins[s.slot]))
            return outcome

        def counted(s, cause):
            self.rejoins[s.slot] += 1
            register_again(s, cause)

        ps.exchange.exchange_slot, ps.session.rejoins.register_again = recorded, counted


def run_trainer(rank, addresses, pipeline, out, errors, hold):
    try:
        model = Pieces()
        ps = connect(addresses, model, mode="sync", rank=rank, num_trainers=TRAINERS, trainer_id=f"soak-{rank}",
                     optimizer={"name": "sgd", "lr": 1.0}, partition_bytes=PARTITION_BYTES, pipeline=pipeline,
                     connect_timeout=60, round_timeout=120)
        assert ps.job.partitions == PARTS
        log = SlotLog(ps, out["records"], hold if rank == 0 else None)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            model(torch.randint(-8, 9, (P,), generator=gen).float()).backward()
            ps.step(num_samples=1)
        ps.flush()  # pipelined: the last exchange
        out.update(counters=dict(ps.counters), rejoins=dict(log.rejoins), ranges=list(ps.ranges))
        # Rank 0 stays registered (a left rank is forgotten) so the test can pull the final weights as it.
        ps.close(leave=rank != 0)
    except BaseException as e:  # noqa: BLE001 -- reported by the test thread
        errors.append(e)


def survived(record: Record, restored: int | None, final_rejoins: int) -> bool:
    """Whether an acknowledged push is in the shard's final state.  A shard restored at version ``restored``
    kept the rounds before it; a push acknowledged on a version at or past it, before its trainer re-registered
    with the restarted process, was in a round the crash rolled back (the trainer's next push there finds the
    shard behind it and re-registers: steps_lost).  None: the shard never restarted."""
    return restored is None or record.base < restored or record.rejoins == final_rejoins


def check_partitions(address: str, shard: int, outs: list[dict], restored: list[int] | None) -> None:
    """Each partition of ``shard`` holds exactly minus the sum, round by round, of the mean of the acknowledged
    gradients that survived, one step per such round; its counters add up over the partitions."""
    counters = part_stats(address, 0).counters  # every partition's, summed
    versions, pushes = [], 0
    for k in range(PARTS):
        slot = shard * PARTS + k
        back = None if restored is None else restored[k]
        by_base = defaultdict(list)  # base version -> (rank, gradient) of each surviving acknowledged push
        for rank, o in enumerate(outs):
            final = o["rejoins"].get(slot, 0)
            for r in o["records"]:
                if r.slot == slot and r.outcome in ACKED and survived(r, back, final):
                    by_base[r.base].append((rank, r.grad))
        for base, pushed in by_base.items():  # exactly once: no trainer twice in a round
            assert len({rank for rank, _ in pushed}) == len(pushed), (slot, base)
        expected = -sum(torch.stack([g for _, g in gs]).mean(0) for gs in by_base.values())
        got = pull_params(address, "soak-0", make_job(Pieces(), num_shards=2).fingerprint, k)
        assert torch.equal(got, expected), (slot, (got - expected).abs().max())
        st = part_stats(address, k)
        assert (st.start, st.end) == tuple(outs[0]["ranges"][slot]) and st.partitions == PARTS
        assert st.version == len(by_base)  # one optimizer step per surviving round
        if back is not None:
            assert st.counters["restored_version"] == back
        versions.append(st.version)
        pushes += sum(len(gs) for gs in by_base.values())
    assert counters["steps"] == sum(versions)
    assert counters["pushes_applied"] == pushes  # each surviving gradient accepted once
    if restored is None:
        assert versions == [STEPS] * PARTS  # nothing lost on the shard that stayed up


class KillDuring:
    """Rank 0's hold: at HOLD_STEP, before HELD_SLOT's exchange, tell the test and wait until it restarted
    the shard (a timeout keeps a failed test from hanging the trainer)."""

    def __init__(self):
        self.reached, self.restarted = threading.Event(), threading.Event()

    def __call__(self, slot: int, step: int) -> None:
        if step == HOLD_STEP and slot == HELD_SLOT:
            self.reached.set()
            self.restarted.wait(120)


@pytest.mark.parametrize("pipeline", [False, True], ids=["partitioned", "pipelined"])
def test_kill_9_mid_partitioned_step_every_surviving_gradient_is_applied_exactly_once(tmp_path, pipeline):
    ckpt = tmp_path / "ckpt"
    shard_args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY)]
    shards = [start_shard(i, tmp_path / f"shard{i}.log", extra_args=shard_args if i == 1 else None)
              for i in range(2)]
    procs = list(shards)
    proxies = [FaultProxy(s.address, seed=13 * i + pipeline, mean_bytes_between_faults=120_000, max_faults=12,
                          max_delay=0.001) for i, s in enumerate(shards)]
    hold = KillDuring()
    threads = []
    try:
        outs = [dict(records=[]) for _ in range(TRAINERS)]
        errors = []
        threads = [threading.Thread(target=run_trainer, args=(r, ",".join(p.address for p in proxies), pipeline,
                                                              outs[r], errors, hold), daemon=True)
                   for r in range(TRAINERS)]
        for t in threads:
            t.start()
        assert hold.reached.wait(120), errors
        # every partition's version-10 checkpoint is on disk (written behind the steps): the restore's version
        wait_until(lambda: all(newest_version(ckpt, 1, k) == 2 * EVERY for k in range(PARTS)),
                   "shard 1's checkpoints at version 10")
        shards[1].kill()  # SIGKILL mid step: rank 0 has pushed some partitions of its 13th step, rank 1 maybe all
        restored = [load_newest(checkpoint_dir(ckpt, k), 1)[0].version for k in range(PARTS)]
        assert restored == [2 * EVERY] * PARTS
        procs.append(restart_on_its_port(shards[1], 1, tmp_path / "shard1-restarted.log", shard_args))
        hold.restarted.set()
        for t in threads:
            t.join(timeout=240)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        assert sum(p.faults for p in proxies) > 0  # the connection faults really happened too

        for shard in range(2):
            check_partitions(shards[shard].address, shard, outs, restored if shard == 1 else None)
        # Rank 0 was past version 10 on every partition of shard 1: each found the shard behind it, re-registered
        # once and lost the rounds rolled back.  Rank 1 may have retried an unanswered push into the restored
        # round instead (acknowledged, never re-registering there).
        assert outs[0]["rejoins"] == {PARTS + k: 1 for k in range(PARTS)}
        assert outs[0]["counters"]["steps_lost"] >= PARTS
        for o in outs:
            c, recs = o["counters"], o["records"]
            assert set(o["rejoins"]) <= {PARTS + k for k in range(PARTS)} and set(o["rejoins"].values()) <= {1}
            assert c.get("reconnects", 0) == len(o["rejoins"])
            assert c.get("duplicate_pushes", 0) == sum(r.outcome == "duplicate" for r in recs)
            assert len(recs) == STEPS * 2 * PARTS  # one answered exchange per slot per step: nothing dropped
        assert sum(o["counters"]["retries"] for o in outs) > 0
        assert "restored version 10" in (tmp_path / "shard1-restarted.log").read_text()
    finally:
        hold.restarted.set()  # a trainer still held goes on (and fails against a dead shard) instead of hanging
        for p in proxies:
            p.close()
        for p in procs:
            p.kill()
        for t in threads:
            t.join(timeout=60)


# -- a retry that reopens the restored round ----------------------------------------------------------------------

SHORT_STEPS = 7


def test_a_trainer_that_rejoins_pushes_its_step_again_so_a_peer_retrying_into_the_restored_round_is_not_stranded(
        tmp_path):
    """Rank 1's push of step 3 reaches shard 1 and closes its rounds there, but the answers never arrive; shard 1
    dies (kill -9) and comes back at version 2.  Rank 1's retry is a new push to the restored shard, so it waits in
    round 2.  Rank 0, a step ahead, finds shard 1 behind it and re-registers: were its gradient dropped, its next
    push there would be of step 5 while shard 0's rounds wait for rank 1's step 4 -- each trainer waiting for the
    other until the round timeout.  Pushed again on the restored version, it closes round 2 and both go on."""
    ckpt = tmp_path / "ckpt"
    shard_args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    shards = [start_shard(0, tmp_path / "shard0.log"),
              start_shard(1, tmp_path / "shard1.log", extra_args=shard_args)]
    procs = list(shards)
    proxy = SwitchProxy(shards[1].address)  # rank 1's way to shard 1
    reached = [[threading.Event() for _ in range(SHORT_STEPS)] for _ in range(TRAINERS)]
    go = [threading.Event() for _ in range(SHORT_STEPS)]
    outs, errors, threads = [{} for _ in range(TRAINERS)], [], []

    def trainer(rank, addresses):
        try:
            model = Pieces()
            with connect(addresses, model, mode="sync", rank=rank, num_trainers=TRAINERS, trainer_id=f"t{rank}",
                         optimizer={"name": "sgd", "lr": 1.0}, partition_bytes=PARTITION_BYTES, connect_timeout=60,
                         round_timeout=20) as ps:  # the deadlock, if any, ends as StepFailed after 20 s
                gen = torch.Generator().manual_seed(rank)
                for step in range(SHORT_STEPS):
                    reached[rank][step].set()
                    if not go[step].wait(120):
                        raise TimeoutError(f"rank {rank} was not let into step {step}")
                    model(torch.randint(-8, 9, (P,), generator=gen).float()).backward()
                    ps.step(num_samples=1)
                outs[rank].update(counters=dict(ps.counters), versions=list(ps.versions))
        except BaseException as e:  # noqa: BLE001 -- reported by the test thread
            errors.append(e)

    try:
        ps = [f"{shards[0].address},{shards[1].address}", f"{shards[0].address},{proxy.address}"]
        threads = [threading.Thread(target=trainer, args=(r, ps[r]), daemon=True) for r in range(TRAINERS)]
        for t in threads:
            t.start()
        for step in range(2):
            go[step].set()
        assert all(reached[r][2].wait(120) for r in range(TRAINERS)), errors
        wait_until(lambda: all(newest_version(ckpt, 1, k) == 2 for k in range(PARTS)), "the version-2 checkpoints")
        proxy.swallow_replies()  # rank 1's pushes of step 3 reach shard 1; their answers never come back
        go[2].set()
        assert reached[0][3].wait(120), errors  # rank 0's step 3 is done: shard 1's rounds 2 closed
        assert all(part_stats(shards[1].address, k).version == 3 for k in range(PARTS))
        proxy.refuse()
        shards[1].kill()
        procs.append(restart_on_its_port(shards[1], 1, tmp_path / "shard1-restarted.log", shard_args))
        proxy.forward()  # rank 1's retry reaches the restored shard: a new push into its round 2
        for step in range(3, SHORT_STEPS):
            go[step].set()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        c0, c1 = outs[0]["counters"], outs[1]["counters"]
        assert c0["reconnects"] == PARTS and c0["steps_lost"] == PARTS  # version 3 rolled back to 2, per partition
        assert c1.get("reconnects", 0) == 0  # rank 1 never saw the restart: its retry was answered
        for k in range(PARTS):
            # rounds 0-1 from the checkpoint, then 2-6 on the restarted shard: rank 1's steps 3-7 paired with
            # rank 0's steps 4-7 pushed again, the last closed when rank 0 left
            assert part_stats(shards[1].address, k).version == SHORT_STEPS
            assert part_stats(shards[0].address, k).version == SHORT_STEPS
    finally:
        for step in go:
            step.set()
        proxy.close()
        for p in procs:
            p.kill()
        for t in threads:
            t.join(timeout=60)


# -- SIGTERM with a round open, then --restore: every partition back as it was ------------------------------------

GATE_TOKEN = "partition-faults-token"  # the shards of the gate's test require it of every caller
HELD, TOTAL = 8, 16  # the gate lets rounds 0-7 close, holds round 8 open until shard 1 is back, then goes on
MLP_PARTS = 3  # the mlp's 134,661-element slices in partitions of at most 200,000 bytes


class Gate:
    """A third trainer in the test process: it pushes zero gradients (one sample each, against the real
    trainers' 32) into every partition's round, so each round closes only when the test lets it push.

    It learns the job the real trainers registered from GetStats as a holder of the shards' token: on a shard
    with a token every caller proved itself, and sees the job's spec (a stranger sees counters only)."""

    def __init__(self, addresses: list[str], security: ClientSecurity):
        st = part_stats(addresses[0], 0, security=security)
        self.job = JobSpec.from_proto(st.job)
        self.rank, self.trainer_id = 2, "gate"
        self.client = ShardedClient(addresses, self.job, rank=self.rank, trainer_id=self.trainer_id,
                                    security=security)
        try:
            replies = self.client.map(lambda s: s.registrar.register(self.job, 60), parts=True)
            self.lengths = [r.end - r.start for r in replies]
            # the first pull returns once rank 0 has initialised every partition and all three ranks registered
            self.versions = self.client.map(lambda s: s.dense.pull(0, self.client.wire, self.lengths[s.slot], 120)[0],
                                            parts=True)
        except BaseException:
            self.client.close()
            raise

    def step(self) -> list[str]:
        """Push zeros to every partition; returns once every round closed (the outcomes)."""
        replies = self.client.map(lambda s: s.dense.push_pull(torch.zeros(self.lengths[s.slot]), self.versions[s.slot],
                                                              1, self.client.wire, 120), parts=True)
        self.versions = [outcome.version for outcome, *_ in replies]
        return [outcome.outcome for outcome, *_ in replies]

    def close(self) -> None:
        try:
            self.client.map(lambda s: s.leave(quick=True), parts=True)
        finally:
            self.client.close()


def test_sigterm_of_a_partitioned_shard_with_its_rounds_open_restores_every_partition_as_it_was(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1000", "--lease-timeout", "0"]
    env, security = {TOKEN_ENV: GATE_TOKEN}, ClientSecurity(token=GATE_TOKEN)  # shards, trainers and the gate
    shards = [start_shard(0, tmp_path / "shard0.log", extra_args=["--lease-timeout", "0"], env=env),
              start_shard(1, tmp_path / "shard1.log", extra_args=args, env=env)]
    procs, gate = list(shards), None
    stats = functools.partial(part_stats, security=security)
    try:
        addresses = [s.address for s in shards]
        metrics = [tmp_path / f"t{r}.jsonl" for r in range(2)]
        trainers = [start_trainer(r, ",".join(addresses), tmp_path / f"t{r}.log",
                                  ["--num-trainers", "3", "--mode", "sync", "--model", "mlp", "--dataset", "synthetic",
                                   "--steps", str(TOTAL), "--partition-bytes", "200000", "--pipeline",
                                   "--metrics-file", str(metrics[r]), "--no-progress", "--threads", "1"], env=env)
                    for r in range(2)]
        procs += trainers
        wait_until(lambda: all(stats(a, 0).HasField("job") for a in addresses), "rank 0 to register")
        gate = Gate(addresses, security)
        assert gate.job.partitions == MLP_PARTS
        for _ in range(HELD):
            assert set(gate.step()) <= {"accepted", "applied"}
        # Rounds 8 hold both trainers' gradients, waiting for the gate's: nothing changes until it pushes.
        wait_until(lambda: stats(addresses[1], 0).counters["pushes_applied"] == MLP_PARTS * (3 * HELD + 2),
                   "both trainers' pushes of step 9 on shard 1")
        before = [stats(addresses[1], k, digest_as=gate) for k in range(MLP_PARTS)]
        assert [b.version for b in before] == [HELD] * MLP_PARTS

        shards[1].popen.send_signal(signal.SIGTERM)
        assert shards[1].popen.wait(60) == 0
        assert [newest_version(ckpt, 1, k) for k in range(MLP_PARTS)] == [HELD] * MLP_PARTS  # one final each
        restarted = restart_on_its_port(shards[1], 1, tmp_path / "shard1-restarted.log", args, env=env)
        procs.append(restarted)
        # The trainers' retries reach it now, answered DUPLICATE: they change no partition's state.
        after = [stats(addresses[1], k, digest_as=gate) for k in range(MLP_PARTS)]
        for k, (b, a) in enumerate(zip(before, after)):
            assert (a.version, a.start, a.end) == (b.version, b.start, b.end), k
            assert a.state_digest == b.state_digest, f"partition {k}: parameters, optimizer, version or round differ"
        assert after[0].partitions == MLP_PARTS
        assert [a.counters["restored_version"] for a in after] == [HELD] * MLP_PARTS  # each its own, not a sum

        assert set(gate.step()) == {"applied"}  # the gate's push closes every round 8: the trainers' were in it
        for _ in range(HELD + 1, TOTAL):
            assert set(gate.step()) <= {"accepted", "applied"}
        gate.close()
        gate = None
        assert wait_all(trainers, 120) == {"trainer0": 0, "trainer1": 0}
        for r in range(2):
            done = json.loads(metrics[r].read_text().splitlines()[-1])
            assert done["event"] == "done" and done["steps"] == TOTAL, trainers[r].log_tail()
            assert done["reconnects"] == 0 and done["steps_lost"] == 0  # the shard came back with everything
            assert done["duplicate_pushes"] == MLP_PARTS  # step 9's push to each partition, answered again
        for address in addresses:
            assert [stats(address, k).version for k in range(MLP_PARTS)] == [TOTAL] * MLP_PARTS
        log = restarted.log_path.read_text()
        assert "restored version 8" in log and "open round with 2 gradients" in log
        assert "final checkpoint" in shards[1].log_path.read_text()
    finally:
        if gate is not None:
            gate.client.close()
        for p in procs:
            p.kill()
