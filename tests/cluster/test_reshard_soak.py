"""The exact-accounting soak through a live 2 -> 3 -> 2 (issue 24 item 4, stage 7 of docs/design/live-reshard.md).

Two trainers (threads using the Python API, as tests/cluster/test_accounting_soak.py) push integer-valued
gradients, sync mode, SGD lr 1, while ``ps-server reshard`` grows the job from two ``ps-server`` processes to three
and drains it back to two.  Every byte between processes goes through a FaultProxy (connections reset or dropped
after a seeded number of bytes -- cut streams and lost replies -- and delayed): the trainers' calls, the
coordinator's ``Reshard`` calls and the shards' ``Handoff`` streams, since the plan's addresses are the proxies'
and a source dials the address the plan names for its destination.

At the end the two shards' parameters must equal exactly minus the sum, round by round, of the mean of the
acknowledged gradients of each element -- whichever layout acknowledged them: no acknowledged push lost or
applied twice through both hand-offs.  The trainers run until the test names their last step, once the drained
shard has stopped (SIGTERM, exit code 0), so both switches fall inside the run without a timing deciding it;
``PACE`` only spaces the steps so that a copy on a loaded machine is not outrun past the forward log's bound.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict

import torch

from psserver.protocol.stubs import fetch_stat
from tests.cluster.faultproxy import FaultProxy
from tests.cluster.helpers import live_reshard, pull_params, reshard_shards
from tests.helpers import wait_until
from trainer import connect
from trainer.stepping.api import make_job
from trainer.stepping.attempt import StepFailed

P, TRAINERS, TAIL = 20_000, 2, 10
ACKED = {"applied", "accepted", "duplicate"}
PACE = 0.05  # seconds between a trainer's steps: pacing, not a synchronisation (see the docstring)
FAULTS = dict(mean_bytes_between_faults=150_000, max_faults=150, max_delay=0.002)  # per proxy: to the end


class Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(P))


def run_trainer(rank: int, addresses: str, last: dict, records: list, errors: list, retry_budget: float = 60.0
                ) -> None:
    """Steps until ``last["step"]`` (set by the test) is reached; each step recorded as (each slot's base, each
    slot's range, each slot's answer, the gradient), in the layout the step was finally sent in.  A failed step
    (its calls' ``retry_budget`` spent) is sent again, as the API says: same gradient, same numbers."""
    try:
        model = Flat()
        ps = connect(addresses, model, mode="sync", rank=rank, num_trainers=TRAINERS, trainer_id=f"rsoak-{rank}",
                     optimizer={"name": "sgd", "lr": 1.0}, connect_timeout=60, retry_budget=retry_budget)
        gen = torch.Generator().manual_seed(300 + rank)
        step = 0
        while last["step"] is None or step < last["step"]:
            grad = torch.randint(-8, 9, (P,), generator=gen).float()
            model.w.grad = grad.clone()
            bases, ranges = list(ps.versions), list(ps.ranges)
            info = step_until_done(ps)
            if list(ps.ranges) != ranges:  # switched: every new slot started at the step's base (trainer.membership.relayout)
                bases = [min(bases)] * len(ps.ranges)
            records.append((bases, list(ps.ranges), info.outcomes, grad))
            step += 1
            time.sleep(PACE)
        records.append(("counters", dict(ps.counters)))
        ps.close(leave=rank != 0)  # rank 0 stays registered: the test reads the final weights as it
    except Exception as e:  # reported by the test thread
        errors.append(e)


def step_until_done(ps, tries: int = 30):
    """``ps.step()``, called again after a StepFailed (the failed shards retried under the same numbers)."""
    for _ in range(tries - 1):
        try:
            return ps.step(num_samples=1)
        except StepFailed:
            continue
    return ps.step(num_samples=1)


def expected_params(records: list[list]) -> torch.Tensor:
    """Plain SGD with lr 1 from zeros: minus, for every element, the sum over rounds of the mean of the
    acknowledged gradients that covered it in that round (exact in fp32 for these integers)."""
    sums, counts = defaultdict(lambda: torch.zeros(P)), defaultdict(lambda: torch.zeros(P))
    for rank_records in records:
        for bases, ranges, outcomes, grad in rank_records[:-1]:
            for base, (a, b), outcome in zip(bases, ranges, outcomes):
                if outcome in ACKED:
                    sums[base][a:b] += grad[a:b]
                    counts[base][a:b] += 1
    return -sum(sums[v] / counts[v].clamp(min=1) for v in sorted(sums))


def test_acknowledged_pushes_through_faults_and_a_live_2_to_3_to_2_are_each_in_the_final_parameters_once(
        tmp_path, capsys):
    shards = reshard_shards(tmp_path)
    proxies, threads, last = [], [], {"step": None}
    records, errors = [[] for _ in range(TRAINERS)], []
    try:
        proxies += [FaultProxy(s.address, seed=40 + i, **FAULTS) for i, s in enumerate(shards)]
        two, three = [p.address for p in proxies[:2]], [p.address for p in proxies]
        threads += [threading.Thread(target=run_trainer, args=(r, ",".join(two), last, records[r], errors),
                                     daemon=True) for r in range(TRAINERS)]
        for t in threads:
            t.start()
        wait_until(lambda: all(fetch_stat(s.address).version >= 3 for s in shards[:2]), "round 3", timeout=120)
        faults = [sum(p.faults for p in proxies)]  # before, during and after each hand-off (reported)
        R1, out1 = live_reshard(capsys, two, three)
        faults.append(sum(p.faults for p in proxies))
        wait_until(lambda: all(fetch_stat(s.address).version >= R1 + 5 for s in shards), "layout 1 past R1 + 5",
                   timeout=120)
        faults.append(sum(p.faults for p in proxies))
        R2, out2 = live_reshard(capsys, three, two)
        faults.append(sum(p.faults for p in proxies))
        assert out2.strip().splitlines()[-1] == f"drained {three[2]}: it holds no job state now and may be stopped"
        assert fetch_stat(shards[2].address).drained == "retired"
        assert shards[2].terminate() == 0, shards[2].log_tail()  # SIGTERM: stops cleanly
        last["step"] = max(fetch_stat(s.address).version for s in shards[:2]) + TAIL
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        final = [fetch_stat(s.address) for s in shards[:2]]
        got = torch.cat([pull_params(s.address, "rsoak-0", make_job(Flat(), 2).fingerprint,
                                     layout_epoch=2) for s in shards[:2]])  # in layout 2: two shards again
    finally:
        if last["step"] is None:
            last["step"] = 0  # the trainers stop at their next step (their shards are killed below)
        for p in proxies:
            p.close()
        for s in shards:
            s.kill()
    steps = last["step"]
    assert 3 <= R1 < R2 < steps, (R1, R2, steps)  # both switches fell inside the run
    assert sum(p.faults for p in proxies) > 0  # the faults really happened

    # 0 lost, 0 applied twice: every acknowledged gradient is in the final parameters exactly once
    want = expected_params(records)
    assert torch.equal(got, want), (got - want).abs().max()
    for rank_records in records:  # sync: every step acknowledged by every slot of its layout
        assert len(rank_records) - 1 == steps
        assert all(o in ACKED for _, _, outcomes, _ in rank_records[:-1] for o in outcomes)
        counters = rank_records[-1][1]
        assert counters["layouts_followed"] == 2, counters
    # layout 2's job on each of the two shards: rounds R2..end, each trainer's push applied once
    for shard, st in enumerate(final):
        acked = [o for rr in records for bases, _, outcomes, _ in rr[:-1] if bases[0] >= R2
                 for i, o in enumerate(outcomes) if i == shard]
        c = st.counters
        assert (st.version, c["steps"], c["pushes_applied"]) == (steps, steps - R2, len(acked)), dict(c)
        assert len(acked) == TRAINERS * (steps - R2)
        assert c.get("duplicates", 0) >= acked.count("duplicate"), dict(c)
    with capsys.disabled():  # the soak's numbers, for docs/design/handoff-io.md
        print(f"\nsoak: steps {steps}, R1 {R1}, R2 {R2}, faults before/after each hand-off {faults}\n"
              f"{numbers(tmp_path, records, proxies)}\n{out1}{out2}")


def numbers(tmp_path, records: list[list], proxies: list[FaultProxy]) -> str:
    """What the soak went through: acknowledged pushes, faults, streams sent again, the trainers' counters."""
    streams = [len(re.findall(r"a Handoff stream to \S+ failed", (tmp_path / f"shard{i}.log").read_text()))
               for i in range(3)]
    acked = sum(o in ACKED for rr in records for _, _, outcomes, _ in rr[:-1] for o in outcomes)
    counters = [rr[-1][1] for rr in records]
    keys = ("retries", "duplicate_pushes", "pushes_rerouted", "steps_rerouted_past_unreachable", "layout_fetches",
            "heartbeat_failures")
    return (f"pushes acknowledged {acked}, faults per proxy {[p.faults for p in proxies]}, connections "
            f"{[p.connections for p in proxies]}, Handoff streams sent again per shard {streams}, per trainer "
            f"{ {k: [c.get(k, 0) for c in counters] for k in keys} }")
