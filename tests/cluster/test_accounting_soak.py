"""Exact accounting under connection faults: nothing lost, nothing applied twice.

Two trainers (threads using the Python API) push integer-valued gradients
through fault-injecting proxies to two real ps-server processes; plain SGD with
lr 1 makes every update exact in fp32.  At the end each shard's parameters must
equal exactly minus the sum of what it acknowledged: every acknowledged push in
async mode, the mean of each round's acknowledged pushes in the sync modes.
"""

import threading
from collections import defaultdict

import grpc
import pytest
import torch

from psserver.proto import ps_pb2 as pb
from psserver.proto import ps_pb2_grpc as pb_grpc
from tests.cluster.faultproxy import FaultProxy
from psserver.admin import fetch_stat as stats
from trainer import connect
from trainer.procs import start_shard

P, STEPS, TRAINERS = 20_000, 40, 2
ACKED = {"applied", "accepted", "duplicate"}


class Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(P))


def run_trainer(rank, addresses, mode, records, errors):
    try:
        model = Flat()
        ps = connect(addresses, model, mode=mode, rank=rank, num_trainers=TRAINERS, trainer_id=f"soak-{rank}",
                     optimizer={"name": "sgd", "lr": 1.0}, sync_timeout=0.3, connect_timeout=60)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            grad = torch.randint(-8, 9, (P,), generator=gen).float()
            model.w.grad = grad.clone()
            bases = list(ps.versions)
            info = ps.step(num_samples=1)
            records.append((bases, info.outcomes, grad))
        records.append(("counters", ps.counters))
        # Rank 0 stays registered (a left rank is forgotten) so the test can read the final weights as it.
        ps.close(leave=rank != 0)
    except Exception as e:  # reported by the test thread
        errors.append(e)


def final_params(address: str, shard: int) -> torch.Tensor:
    with grpc.insecure_channel(address) as ch:
        chunks = list(pb_grpc.ParameterServerStub(ch).Pull(
            pb.PullRequest(rank=0, trainer_id="soak-0", fingerprint=stats(address).job.fingerprint), timeout=30))
    return torch.frombuffer(bytearray(b"".join(c.data for c in chunks)), dtype=torch.float32)


@pytest.mark.parametrize("mode", ["sync", "async", "stale-timeout"])
def test_final_parameters_equal_the_sum_of_acknowledged_gradients(tmp_path, mode):
    shards = [start_shard(i, tmp_path / f"shard{i}.log") for i in range(2)]
    proxies = [FaultProxy(s.address, seed=7 * i + len(mode), mean_bytes_between_faults=150_000, max_faults=25,
                          max_delay=0.002) for i, s in enumerate(shards)]
    try:
        records = [[] for _ in range(TRAINERS)]
        errors = []
        threads = [threading.Thread(target=run_trainer, args=(r, ",".join(p.address for p in proxies), mode,
                                                              records[r], errors)) for r in range(TRAINERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        assert sum(p.faults for p in proxies) > 0  # the faults really happened
        counters = [r[-1][1] for r in records]
        assert sum(c.get("retries", 0) for c in counters) > 0

        bounds = [(0, P // 2), (P // 2, P)]
        for shard, (start, end) in enumerate(bounds):
            by_base = defaultdict(list)  # base version -> acknowledged gradient slices
            for rank_records in records:
                for bases, outcomes, grad in rank_records[:-1]:
                    if outcomes[shard] in ACKED:
                        by_base[bases[shard]].append(grad[start:end])
            if mode == "async":
                expected = -sum(g for gs in by_base.values() for g in gs)
            else:
                expected = -sum(torch.stack(gs).mean(0) for gs in by_base.values())
            got = final_params(shards[shard].address, shard)
            assert torch.equal(got, expected), (got - expected).abs().max()
            st = stats(shards[shard].address)
            applied_rounds = len(by_base) if mode != "async" else sum(len(g) for g in by_base.values())
            assert st.version == applied_rounds
    finally:
        for p in proxies:
            p.close()
        for s in shards:
            s.kill()
