"""A drained shard killed between its vote and DECIDE, end to end (docs/design/handoff-io.md, "A drained shard lost after
its vote"; issue 24 item 4).

Three real ``ps-server`` processes; two sync trainers (threads on the Python API, integer gradients, SGD lr 1 --
exact in fp32, as tests/cluster/test_reshard_soak.py) train while the test, as ``ps-server reshard`` would, drains
the job to two shards -- and ``kill -9``s the drained one once every source voted at R (every new piece ready),
before DECIDE.  Its held round R-1 replies go with it: each trainer's step of base R-1 finds shards 0 and 1 answering
(applied, naming layout 1) and shard 2 unreachable; once its retry budget is spent the new owners of shard 2's
range answer from shard 2's push book at R, which moved with its vote.  The trainers go on in layout 1; at the end
the two shards' parameters equal exactly minus the sum over rounds of the mean of each element's acknowledged
gradients (0 lost, 0 applied twice), and nothing is left running.
"""

from __future__ import annotations

import threading
import time

import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.stubs import fetch_stat
from psserver.resharding.reshard_cmd import TAILING, Coordinator
from tests.cluster.helpers import pull_params
from tests.cluster.test_reshard_soak import ACKED, PACE, P, Flat, expected_params, step_until_done
from tests.helpers import wait_until
from trainer import connect
from trainer.stepping.api import make_job
from trainer.local.procs import start_shard

TRAINERS, TAIL, RETRY_BUDGET = 2, 6, 3.0
Op = pb.ReshardRequest


def run_trainer(rank: int, addresses: str, last: dict, records: list, errors: list) -> None:
    """As the soak's trainer, but a step finished by the lost slot's new owners is recorded in the layout it was
    applied in (its old ranges and bases: ``outcomes`` has one answer per old slot)."""
    try:
        model = Flat()
        ps = connect(addresses, model, mode="sync", rank=rank, num_trainers=TRAINERS, trainer_id=f"lost-{rank}",
                     optimizer={"name": "sgd", "lr": 1.0}, connect_timeout=60, retry_budget=RETRY_BUDGET)
        gen = torch.Generator().manual_seed(500 + rank)
        step = 0
        while last["step"] is None or step < last["step"]:
            grad = torch.randint(-8, 9, (P,), generator=gen).float()
            model.w.grad = grad.clone()
            bases, ranges = list(ps.versions), list(ps.ranges)
            info = step_until_done(ps)
            if list(ps.ranges) != ranges and len(info.outcomes) != len(ranges):  # re-routed: sent in the new one
                bases, ranges = [min(bases)] * len(ps.ranges), list(ps.ranges)
            records.append((bases, ranges, info.outcomes, grad))
            step += 1
            time.sleep(PACE)
        records.append(("counters", dict(ps.counters)))
        ps.close(leave=rank != 0)  # rank 0 stays registered: the test reads the final weights as it
    except Exception as e:  # reported by the test thread
        errors.append(e)


def test_a_drained_shard_killed_after_its_vote_loses_no_step_and_the_trainers_go_on_in_the_new_layout(tmp_path):
    shards = [start_shard(i, tmp_path / f"shard{i}.log", extra_args=["--handoff-timeout", "60"]) for i in range(3)]
    threads, last, records, errors = [], {"step": None}, [[] for _ in range(TRAINERS)], []
    three = [s.address for s in shards]
    two = three[:2]
    coordinator = Coordinator(three, two, say=lambda line: None)
    try:
        threads += [threading.Thread(target=run_trainer, args=(r, ",".join(three), last, records[r], errors),
                                     daemon=True) for r in range(TRAINERS)]
        for t in threads:
            t.start()
        wait_until(lambda: all(fetch_stat(a).version >= 3 for a in three), "round 3", timeout=120)
        coordinator.call_all(Op.PREPARE)
        replies = coordinator.wait(lambda r: (ph := [p for p in coordinator.phases(r) if p.startswith("source:")])
                                   and set(ph) <= TAILING, "every move's copy to be acknowledged", 120)
        R = max(r.round for r in replies.values()) or max(coordinator.call(a, Op.PROPOSE).proposal for a in three)
        coordinator.call_all(Op.COMMIT, round=R)
        coordinator.wait(lambda r: set(coordinator.phases(r)) == {"source:blocked", "dest:ready"},
                         f"every source to vote at R={R}", 120)
        shards[2].kill()  # kill -9 between its vote and DECIDE: its held round R-1 replies go with it
        for a in two:
            assert coordinator.call(a, Op.DECIDE, switch=True).layout_epoch == 1
        wait_until(lambda: all(fetch_stat(a).version >= R + 2 for a in two), "layout 1 past R + 2", timeout=120)
        last["step"] = max(fetch_stat(a).version for a in two) + TAIL
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        final = [fetch_stat(a) for a in two]
        got = torch.cat([pull_params(a, "lost-0", make_job(Flat(), 2).fingerprint, layout_epoch=1) for a in two])
    finally:
        if last["step"] is None:
            last["step"] = 0  # the trainers stop at their next step (their shards are killed below)
        coordinator.close()
        for s in shards:
            s.kill()
        for t in threads:
            t.join(timeout=60)
    assert not any(s.alive() for s in shards) and not any(t.is_alive() for t in threads)  # nothing left running
    steps = last["step"]
    assert 3 <= R < steps
    want = expected_params(records)  # 0 lost, 0 applied twice
    assert torch.equal(got, want), (got - want).abs().max()
    for rank_records in records:
        assert len(rank_records) - 1 == steps
        assert all(o in ACKED for _, _, outcomes, _ in rank_records[:-1] for o in outcomes)
        lost_step = [r for r in rank_records[:-1] if r[0][0] == R - 1]
        assert len(lost_step) == 1 and lost_step[0][2][2] == "duplicate"  # slot 2 answered from its book
        counters = rank_records[-1][1]
        assert (counters["steps_answered_by_new_owners"], counters["layouts_followed"]) == (1, 1), counters
        assert counters.get("steps_failed", 0) == 0 and counters.get("steps_dropped_past_unreachable", 0) == 0
    for st in final:  # layout 1's job on each of the two shards: rounds R..end, each trainer's push applied once
        c = st.counters
        assert (st.version, c["steps"], c["pushes_applied"]) == (steps, steps - R, TRAINERS * (steps - R)), dict(c)
    assert final[1].counters["moved_pushes_duplicate"] == TRAINERS  # old slot 2 lies in new slot 1
