"""A trainer follows a layout switch (stage 4 of docs/design/live-reshard.md), on real shards over gRPC.

A sync job on two shards runs R rounds; then both processes switch offline (tests.offline_switch.switch_layout_offline, at
the round boundary) to layout 1: one shard -- the first process -- of two partitions, re-cut from both old shards'
states; the second process is drained.  The trainer, one layout behind, sends its next step in layout 0, is
refused ``layout-moved`` everywhere (nothing applied), learns layout 1, re-routes the step whole and goes on.  Its
final parameters must equal bit for bit those of the same job that never switched: nothing lost, nothing twice.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import WAIT_TIMEOUT, run_ranks
from tests.offline_switch import capture_states, switch_layout_offline
from trainer import connect
from trainer.membership.relayout import RegisterMoved

STEPS, R = 6, 3
OPTIMIZER = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


class Net(torch.nn.Module):
    """Two layers of uneven sizes (1,034 parameters), so slot edges fall inside tensors."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(12, 60)
        self.b = torch.nn.Linear(60, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]


def switch_to_one_shard(servers) -> None:
    """Layout 1 from the round both shards are at: one shard (the first process) of two partitions."""
    pieces = [capture_states(s) for s in servers]
    first = (servers[0].address,)
    for s in servers:
        layout = switch_layout_offline(s, 1, 0, 2, pieces, first)
        assert (layout.number, layout.round, layout.num_shards, layout.partitions) == (1, R, 1, 2)


def train(servers, switch_at=None, before_step=lambda ps: None):
    """STEPS sync steps of one trainer; (its parameters, its counters, its job) after them."""
    model = Net()
    with connect(",".join(s.address for s in servers), model, mode="sync", rank=0, num_trainers=1,
                 optimizer=OPTIMIZER, connect_timeout=30) as ps:
        for i, (x, y) in enumerate(batches()):
            if i == switch_at:
                switch_to_one_shard(servers)
                before_step(ps)
            ps.prepare_step(len(x))
            F.cross_entropy(model(x), y).backward()
            ps.step(num_samples=len(x))
        ps.flush()
        params = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        return params, Counter(ps.client.counters), ps.job, [s.address for s in ps.client.parts]


def test_a_trainer_refused_layout_moved_learns_the_layout_reroutes_the_step_and_ends_bit_for_bit_as_without_a_switch(
        shard_server):
    reference, _, _, _ = train([shard_server(shard=i).server for i in range(2)])
    servers = [shard_server(shard=i).server for i in range(2)]
    params, counters, job, addresses = train(servers, switch_at=R)
    assert torch.equal(params, reference)
    assert (job.num_shards, job.partitions, addresses) == (1, 2, [servers[0].address] * 2)
    assert counters["pushes_rerouted"] == 2  # both old slots refused the step at base R; it went again whole
    assert (counters["layouts_followed"], counters["layout_fetches"]) == (1, 1)
    assert counters["steps_failed"] == counters["steps_abandoned"] == counters["reconnects"] == 0
    head = servers[0].layouts.current
    assert [p.capture().version for p in head.parts[:2]] == [STEPS, STEPS]  # every step applied once, in its layout
    assert servers[0].layouts.host(0).part(0).capture().version == R  # the tombstone: nothing after the switch


def test_a_trainer_that_saw_the_new_layout_in_a_reply_switches_before_pushing_and_nothing_is_refused(shard_server):
    reference, _, _, _ = train([shard_server(shard=i).server for i in range(2)])
    servers = [shard_server(shard=i).server for i in range(2)]

    def hear_of_it(ps):
        """A pull of version R in layout 0 (the tombstone serves it) names layout 1 in its reply."""
        s = ps.client.parts[1]
        version, _, _ = s.dense.pull(R, ps.client.wire, ps.ranges[1][1] - ps.ranges[1][0], timeout=10)
        assert (version, s.calls.layout_seen, s.caller.layout_epoch) == (R, 1, 0)

    params, counters, job, _ = train(servers, switch_at=R, before_step=hear_of_it)
    assert torch.equal(params, reference)
    assert (job.num_shards, job.partitions) == (1, 2)
    assert counters["pushes_rerouted"] == 0 and counters["layouts_followed"] == 1


def two_trainers(servers, make_model, loss, weights, counts, switch_at=None):
    """Two trainers (threads) of one sync job, STEPS steps each on their own data (``loss(model, g, ps)``, ``g``
    seeded by rank); with ``switch_at``, both stop between steps (a barrier: every round up to R closed, none
    open) while the shards switch (``switch_to_one_shard``).  ({rank: weights(model)}, {rank: counts(ps)})."""
    models, results, counters = [make_model() for _ in range(2)], {}, {}
    between = threading.Barrier(2, timeout=WAIT_TIMEOUT)

    def run(rank):
        g = torch.Generator().manual_seed(11 + rank)
        with connect(",".join(s.address for s in servers), models[rank], mode="sync", rank=rank, num_trainers=2,
                     optimizer=OPTIMIZER, connect_timeout=30) as ps:
            for i in range(STEPS):
                if i == switch_at:
                    between.wait()
                    if rank == 0:
                        switch_to_one_shard(servers)
                    between.wait()
                value, n = loss(models[rank], g, ps)  # (the step's loss, its samples), after prepare_step
                value.backward()
                ps.step(num_samples=n)
            ps.flush()
            results[rank], counters[rank] = weights(models[rank]), counts(ps)

    run_ranks(run, 2)
    return results, counters


def train_two(servers, switch_at=None):
    """``two_trainers`` of Net: their flat parameters and counters."""
    def loss(model, g, ps):
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)
        ps.prepare_step(len(x))
        return F.cross_entropy(model(x), y), len(x)

    return two_trainers(servers, Net, loss, flat_parameters, lambda ps: Counter(ps.client.counters), switch_at)


def flat_parameters(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def test_two_sync_trainers_both_follow_the_switch_and_end_bit_for_bit_as_without_one(shard_server):
    reference, _ = train_two([shard_server(shard=i).server for i in range(2)])
    servers = [shard_server(shard=i).server for i in range(2)]
    results, counters = train_two(servers, switch_at=R)
    assert torch.equal(results[0], reference[0]) and torch.equal(results[1], reference[1])
    assert torch.equal(results[0], results[1])  # sync: both hold the same weights
    for rank in (0, 1):
        assert (counters[rank]["pushes_rerouted"], counters[rank]["layouts_followed"]) == (2, 1)
        assert counters[rank]["steps_failed"] == counters[rank]["steps_abandoned"] == 0
    assert [p.capture().version for p in servers[0].layouts.current.parts[:2]] == [STEPS, STEPS]


def one_step(ps, model, batch) -> None:
    x, y = batch
    ps.prepare_step(len(x))
    F.cross_entropy(model(x), y).backward()
    ps.step(num_samples=len(x))
    ps.flush()


def test_an_async_trainer_started_after_a_switch_with_the_old_ps_list_follows_the_layout_its_register_refusal_names(
        shard_server):
    """Async jobs do not wait for every trainer, so rank 1 may first register after the switch, in layout 0: every
    old shard refuses it ``layout-moved`` with layout 1 whole (psserver.resharding.layout_host.register_host), and it registers
    there instead (trainer.membership.relayout.Relayout.at_register), counted and logged; its steps go to layout 1's shards."""
    servers = [shard_server(shard=i).server for i in range(2)]
    addresses, data = ",".join(s.address for s in servers), batches()
    first, late = Net(), Net()
    with connect(addresses, first, mode="async", rank=0, num_trainers=2, optimizer=OPTIMIZER,
                 connect_timeout=30) as ps0:
        for batch in data[:R]:
            one_step(ps0, first, batch)
        switch_to_one_shard(servers)
        with connect(addresses, late, mode="async", rank=1, num_trainers=2, optimizer=OPTIMIZER,
                     connect_timeout=30) as ps1:
            counters = ps1.client.counters
            assert (counters["register_followed_layout"], counters["layouts_followed"]) == (1, 1)
            assert (ps1.job.num_shards, ps1.job.partitions) == (1, 2)
            assert [s.address for s in ps1.client.parts] == [servers[0].address] * 2
            one_step(ps1, late, data[R])
            assert counters["pushes_rerouted"] == counters["steps_failed"] == counters["reconnects"] == 0
        one_step(ps0, first, data[R + 1])  # rank 0 follows at its next step, as before
        assert ps0.client.counters["layouts_followed"] == 1
    assert [p.capture().version for p in servers[0].layouts.current.parts[:2]] == [R + 2, R + 2]
    assert servers[0].layouts.host(0).part(0).capture().version == R  # nothing of rank 1 in the old layout


def test_a_trainer_of_another_job_refused_layout_moved_at_register_fails_in_one_line_naming_the_shard(shard_server):
    """The shards keep the newest layout from a caller that named another job (its fingerprint is this job's
    identity): the refusal names no layout to follow, and connect fails with its one-line cause."""
    servers = [shard_server(shard=i).server for i in range(2)]
    addresses = ",".join(s.address for s in servers)
    first, data = Net(), batches()
    with connect(addresses, first, mode="async", rank=0, num_trainers=2, optimizer=OPTIMIZER,
                 connect_timeout=30) as ps0:
        for batch in data[:R]:
            one_step(ps0, first, batch)
        switch_to_one_shard(servers)
        with pytest.raises(RegisterMoved) as e:
            connect(addresses, torch.nn.Linear(12, 4), mode="async", rank=1, num_trainers=2, optimizer=OPTIMIZER,
                    connect_timeout=30)
        message = str(e.value)
        assert "\n" not in message and "refused Register layout-moved" in message
        assert "restart it on the new layout's --ps list" in message
        one_step(ps0, first, data[R])  # rank 0 follows (its Leave is then in layout 1)


def test_an_elastic_joiner_started_after_a_switch_with_the_old_ps_list_follows_the_layout_its_admission_names(
        shard_server):
    """As a late rank: a join's admission in layout 0 is refused ``layout-moved`` with layout 1 whole, and the joiner
    joins there (admission, commit, confirm in layout 1) while rank 0 trains on (a join waits for its round)."""
    servers = [shard_server(shard=i).server for i in range(2)]
    addresses, data = ",".join(s.address for s in servers), batches()
    first, joiner = Net(), Net()
    elastic = dict(mode="async", num_trainers=1, max_trainers=2, optimizer=OPTIMIZER, connect_timeout=60)
    with connect(addresses, first, rank=0, **elastic) as ps0:
        for batch in data[:R]:
            one_step(ps0, first, batch)
        switch_to_one_shard(servers)
        joined, steps = threading.Event(), []

        def rank0() -> None:  # its steps move the rounds the join waits for; it follows at the first
            while not joined.is_set():
                one_step(ps0, first, data[len(steps) % STEPS])
                steps.append(1)

        training = threading.Thread(target=rank0, name="rank0")
        training.start()
        try:
            with connect(addresses, joiner, join=True, **elastic) as ps1:
                joined.set()
                counters = ps1.client.counters
                assert (ps1.rank, counters["register_followed_layout"], counters["joins"]) == (1, 1, 1)
                assert (ps1.job.num_shards, ps1.job.partitions) == (1, 2)
                one_step(ps1, joiner, data[R])
                assert counters["steps_failed"] == counters["pushes_rerouted"] == 0
        finally:
            joined.set()
            training.join(WAIT_TIMEOUT)
        assert not training.is_alive() and ps0.client.counters["layouts_followed"] == 1
