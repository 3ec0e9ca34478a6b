"""The layouts one process serves (psserver.resharding.layout_host), without a network and on a fake clock: one layout
routes as the ShardHost does; a switch at a round boundary adds a host, routes by base and keeps the old one as
the tombstone; a switch off a boundary, or with an async table or
a table's round open, changes nothing; a sync table switches from its own round; the timer ticks every layout."""

import dataclasses

import pytest
import torch

from psserver.partition.host import ShardHost
from psserver.protocol.errors import LayoutAhead, LayoutMoved, NotInLayout, PsError
from psserver.protocol.job import TableSpec
from psserver.protocol.layout import Layout
from psserver.protocol.layouts import LayoutEpoch, moved_layout
from psserver.protocol.rows.placement import shard_of
from psserver.resharding.layout_host import LayoutHost
from psserver.resharding.reshard import ReshardError
from psserver.serving.service import ServiceLimits
from psserver.serving.service_rows import RowRpcs
from psserver.sparse.serving import RowsPush
from tests.conftest import P, make_spec
from tests.offline_switch import switch_offline
from tests.unit.test_shard_leases import LEASE, Clock

JOB = make_spec()
JOB = dataclasses.replace(JOB, fingerprint=Layout.from_shapes(JOB.tensors, 1).fingerprint())


def running(job=JOB, rounds=2, clock=None):
    """A one-shard host after ``rounds`` applied rounds of rank 0, and its LayoutHost."""
    host = ShardHost(0, clock=clock or Clock(), lease_timeout=LEASE)
    host.part_for_register(0, 0, 0, job).register(0, "t0", 0, job)
    host.head.init(0, "t0", job.fingerprint, torch.zeros(P))
    for base in range(rounds):
        host.head.push(0, "t0", job.fingerprint, base, 1, torch.ones(P), sequence=base + 1)
    return host, LayoutHost(host)


def test_with_one_layout_every_base_and_version_routes_to_the_hosts_own_partition():
    host, layouts = running()
    for value in (0, 1, 2, 10**9):
        assert layouts.push_part(0, 0, value) is host.part(0) and layouts.pull_part(0, 0, value) is host.part(0)
    assert (layouts.newest, layouts.current) == (0, host)
    assert layouts.timeline() == [LayoutEpoch(0, 0, 1, 1, (), JOB.fingerprint)]
    with pytest.raises(LayoutAhead, match="layout_epoch is 1 but this shard knows layouts 0 to 0"):
        layouts.push_part(1, 0, 0)


def test_a_switch_at_a_round_boundary_routes_each_base_to_one_layout_and_keeps_the_old_host():
    host, layouts = running()
    layout = switch_offline(layouts, 2, 0)
    assert (layout.number, layout.round, layout.num_shards) == (1, 2, 2)
    new = layouts.current
    assert new is not host and layouts.host(0) is host and layouts.newest == 1
    assert (new.head.version, new.head.slice_length(), host.head.version) == (2, P // 2, 2)
    assert layouts.push_part(0, 0, 1) is host.part(0) and layouts.push_part(1, 0, 2) is new.part(0)
    with pytest.raises(LayoutMoved, match="base version 2 is at or after round 2, where layout 0 ends"):
        layouts.push_part(0, 0, 2)
    with pytest.raises(LayoutMoved, match="base version 1 is before round 2, where layout 1 starts"):
        layouts.push_part(1, 0, 1)
    assert layouts.pull_part(0, 0, 2) is host.part(0)
    with pytest.raises(LayoutMoved, match="layout_epoch is 0 but this shard's newest layout is 1, from round 2"):
        layouts.membership.register_host(0)
    assert new.snapshot().counters["refused_layout_moved"] == 2  # shard-wide: GetStats shows them


def test_how_the_rounds_closed_goes_on_across_a_switch_and_the_slices_own_counts_start_again():
    host, layouts = running(rounds=3)
    assert host.snapshot().counters["rounds_all_arrived"] == host.snapshot().counters["steps"] == 3
    switch_offline(layouts, 2, 0)
    new = layouts.current.head
    new.push(0, "t0", new.job.fingerprint, 3, 1, torch.ones(new.slice_length()), sequence=4)
    after = layouts.current.snapshot().counters
    assert after["rounds_all_arrived"] == new.version == 4  # the rounds add up to the version, which goes on
    assert after["steps"] == after["pushes_applied"] == 1  # the re-cut slice's own, since the switch


def test_a_switch_with_a_round_open_is_refused_and_installs_nothing():
    job = dataclasses.replace(JOB, num_trainers=2)
    host = ShardHost(0, clock=Clock(), lease_timeout=LEASE)
    for rank in (0, 1):
        host.part_for_register(0, rank, 0, job).register(rank, f"t{rank}", 0, job)
    host.head.init(0, "t0", job.fingerprint, torch.zeros(P))
    for rank in (0, 1):
        host.head.push(rank, f"t{rank}", job.fingerprint, 0, 1, torch.ones(P))
    host.head.push(0, "t0", job.fingerprint, 1, 1, torch.ones(P))
    layouts = LayoutHost(host)
    before = host.head.state_digest()
    with pytest.raises(ValueError, match="partition 0 is at version 1 with a round open"):
        switch_offline(layouts, 2, 0)
    assert (layouts.newest, layouts.current, host.head.state_digest()) == (0, host, before)


IDS = torch.arange(40, dtype=torch.int64)


def with_table(mode="", table_pushes=3, num_trainers=1):
    """A one-shard job of a table ``emb`` (dim 4; ``mode``) after 2 dense rounds and ``table_pushes`` table rounds
    of rank 0 over ids 0..39: the table's rounds are its own (3), not the dense slice's (2)."""
    job = dataclasses.replace(JOB, tables=(TableSpec("emb", 4, mode=mode),), num_trainers=num_trainers)
    host = ShardHost(0, clock=Clock(), lease_timeout=LEASE)
    for rank in range(num_trainers):
        host.part_for_register(0, rank, 0, job).register(rank, f"t{rank}", 0, job)
    host.head.init(0, "t0", job.fingerprint, torch.zeros(P))
    for base in range(2):
        for rank in range(num_trainers):
            host.head.push(rank, f"t{rank}", job.fingerprint, base, 1, torch.ones(P), sequence=base + 1)
    for base in range(table_pushes):
        grads = torch.full((len(IDS), 4), float(base + 1))
        host.head.push_rows(job.fingerprint, "emb", RowsPush(0, "t0", base, 1, base + 1, IDS, grads), True)
    return host, LayoutHost(host)


def test_a_sync_table_switches_from_its_own_round_with_its_rows_re_placed_and_row_calls_routed_by_it():
    host, layouts = with_table()
    before = host.head.capture().tables["emb"]["rows"]
    layout = switch_offline(layouts, 2, 1)
    assert (layout.round, layout.table_rounds, layout.start("emb")) == (2, (("emb", 3),), 3)
    new = layouts.current.head
    rows = new.capture().tables["emb"]["rows"]
    mine = shard_of(before["ids"], 2) == 1
    assert torch.equal(rows["ids"], before["ids"][mine]) and torch.equal(rows["rows"], before["rows"][mine])
    assert new.tables.get("emb").version == 3  # the table's round carried
    assert layouts.rows_head(1, "emb", 3) is new and layouts.rows_head(0, "emb", 2) is host.head
    assert layouts.rows_head(0, "emb", 3, pull=True) is host.head  # version 3 is the state both layouts share
    with pytest.raises(LayoutMoved, match="base version 3 is at or after table 'emb'.s round 3, where layout 0 ends"):
        layouts.rows_head(0, "emb", 3)
    with pytest.raises(LayoutMoved, match="version 4 is past table 'emb'.s round 3"):
        layouts.rows_head(0, "emb", 4, pull=True)
    with pytest.raises(LayoutMoved, match="base version 2 is before table 'emb'.s round 3, where layout 1 starts"):
        layouts.rows_head(1, "emb", 2)


def test_an_async_table_or_an_open_table_round_refuses_the_switch_and_changes_nothing():
    for host, layouts, why in ((*with_table(mode="async"), "table 'emb' is async"),
                               (*with_table(num_trainers=2, table_pushes=1), "table 'emb' has a round open")):
        digest = host.head.state_digest()
        with pytest.raises(ReshardError, match=why):
            switch_offline(layouts, 2, 0)
        assert (layouts.newest, layouts.current, host.head.state_digest()) == (0, host, digest)


def test_only_the_next_layout_number_is_installed():
    host, layouts = running()
    with pytest.raises(ValueError, match="layout is 2 but the next layout here is 1"):
        layouts.install(LayoutEpoch(2, 2, 1), host.successor(0))


def test_the_timer_expires_leases_in_every_layout():
    clock = Clock()
    host, layouts = running(clock=clock)
    switch_offline(layouts, 2, 0)
    layouts.current.head.check_member(0, "t0", layouts.timeline()[1].fingerprint)  # heard from in layout 1
    clock.now += 2 * LEASE
    layouts.tick()
    assert layouts.current.head.counters["lease_expired"] == 1 and host.head.counters["lease_expired"] == 1


def test_a_heartbeat_in_the_old_layout_renews_the_members_lease_in_the_new_one():
    """A trainer one layout behind heartbeats with its old fingerprint until its next step: its lease in the newest
    layout is renewed (counted), so a long step after the switch does not expire it; a stranger is still refused."""
    clock = Clock()
    host, layouts = running(clock=clock)
    switch_offline(layouts, 2, 0)
    new = layouts.current.head
    new.check_member(0, "t0", layouts.timeline()[1].fingerprint)  # heard from in layout 1 at the switch
    for _ in range(3):
        clock.now += 0.6 * LEASE
        layouts.membership.heartbeat(0, 0, "t0", JOB.fingerprint)  # the old layout's fingerprint
        layouts.tick()
    assert new.counters.get("lease_expired", 0) == 0 and new.counters["heartbeats_from_older_layout"] == 3
    with pytest.raises(PsError):
        layouts.membership.heartbeat(0, 0, "t9", JOB.fingerprint)  # not a member of any layout


def test_retire_frees_the_old_layouts_state_keeps_the_routing_record_and_old_calls_are_layout_moved():
    """RETIRE: the tombstone's parameters, optimizer state, books and members go (bytes counted); the timeline stays,
    every call in the freed layout is layout-moved naming the newest layout, and a member of it is still known (its
    heartbeat renews in the newest, it may read the timeline)."""
    clock = Clock()
    host, layouts = running(clock=clock)
    switch_offline(layouts, 2, 0, addresses=("a:1", "b:2"))
    timeline = layouts.timeline()
    freed = layouts.retire()
    assert freed == P * 4 * 2  # parameters and momentum
    assert host.head.params is None and host.head.job is None and host.head.members.members() == {}
    assert layouts.timeline() == timeline and layouts.current.head.counters["tombstone_bytes_freed"] == freed
    for call in (lambda: layouts.pull_part(0, 0, 1), lambda: layouts.push_part(0, 0, 0), lambda: layouts.part(0, 0)):
        with pytest.raises(LayoutMoved, match=r"layout_epoch is 0 .* freed \(RETIRE\): send it in layout 1 "
                                              r"\(its shards: a:1, b:2\)"):
            call()
    was_member = layouts.tombstones.was_member
    assert was_member(0, "t0", JOB.fingerprint) and not was_member(0, "t9", JOB.fingerprint)
    clock.now += 0.6 * LEASE
    layouts.membership.heartbeat(0, 0, "t0", JOB.fingerprint)
    assert layouts.current.head.counters["heartbeats_from_older_layout"] == 1
    assert layouts.retire() == 0 and layouts.drained == ""  # asked twice: nothing more to free


def test_a_drained_process_serves_no_new_layout_and_is_retired_once_its_tombstone_is_freed():
    host, layouts = running()
    layout = LayoutEpoch(1, 2, 2, 1, ("a:1", "b:2"), "f2")
    layouts.drain(layout, "c:3")
    assert (layouts.newest, layouts.current, layouts.drained) == (1, host, "tombstone")
    assert layouts.pull_part(0, 0, 2) is host.part(0)  # the tombstone answers the old layout up to R
    with pytest.raises(NotInLayout, match=r"layout_epoch is 1 but this shard c:3 is not among layout 1's shards "
                                          r"\['a:1', 'b:2'\]"):
        layouts.push_part(1, 0, 2)
    with pytest.raises(NotInLayout):
        layouts.membership.register_host(1)
    counters = host.snapshot().counters  # (the refusal is shard-wide, the drain the job's)
    assert counters["refused_not_in_layout"] == 1 and counters["layouts_drained"] == 1
    layouts.retire()
    assert layouts.drained == "retired" and host.head.params is None


def test_a_drain_off_a_round_boundary_is_refused_and_changes_nothing():
    host, layouts = running()
    with pytest.raises(ValueError, match="starts at round 3 but partition 0 is at version 2"):
        layouts.drain(LayoutEpoch(1, 3, 2, 1, ("a:1", "b:2")), "c:3")
    assert (layouts.newest, layouts.drained, layouts.drained_as) == (0, "", None)


def test_retire_releases_the_freed_layouts_memory_reservation_so_a_drained_process_reports_none_reserved():
    """issue 24: RETIRE freed the tombstone's tensors but kept its host's plan, so a drained, retired process
    still said it reserved the old job's bytes of --max-memory (memory_reserved_bytes)."""
    host, layouts = running()
    reserved = host.snapshot().counters["memory_reserved_bytes"]
    assert reserved > 0 and host.plan is not None
    layouts.drain(LayoutEpoch(1, 2, 2, 1, ("a:1", "b:2"), "f2"), "c:3")
    assert host.snapshot().counters["memory_reserved_bytes"] == reserved  # the tombstone still holds the job
    layouts.retire()
    assert host.plan is None
    assert layouts.current.snapshot().counters["memory_reserved_bytes"] == 0
    assert layouts.current.snapshot().counters["memory_tables_budget_bytes"] == 0


def _rows_only(layouts) -> RowRpcs:
    """The servicer's row-call room alone (no gRPC, no runtime): what ``rows_at`` keeps per layout."""
    return RowRpcs(layouts.current.head, layouts, None, ServiceLimits(), None, None, None)


def test_row_calls_of_layouts_retire_freed_are_dropped_so_they_do_not_grow_with_every_reshard():
    """issue 24: ``_rows_by_epoch`` kept a RowCalls (its remembered pulls, its freed partition) per layout ever
    served; now a new layout's row calls, or any Reshard op, drop those of layouts this process no longer holds."""
    host, layouts = running()
    rows = _rows_only(layouts)
    switch_offline(layouts, 1, 0)
    first = rows.rows_at(1)
    assert rows.rows_at(1) is first  # kept while layout 1 serves
    head = layouts.current.head
    head.push(0, "t0", head.job.fingerprint, 2, 1, torch.ones(P), sequence=3)  # a round in layout 1
    switch_offline(layouts, 1, 0)
    layouts.retire()  # frees layouts 0 and 1
    rows.rows_at(2)
    assert set(rows._rows_by_epoch) == {2}
    assert not layouts.holds(1) and layouts.holds(2)
    assert rows.drop_freed_rows() == 0  # nothing more to drop while layout 2 serves


def test_a_register_in_a_layout_retire_freed_is_layout_moved_carrying_the_newest_layout_to_its_jobs_callers_only():
    host, layouts = running()
    switch_offline(layouts, 2, 0, addresses=("a:1", "b:2"))
    layouts.retire()
    with pytest.raises(LayoutMoved, match=r"freed \(RETIRE\)") as e:
        layouts.membership.register_host(0, JOB.fingerprint)
    assert moved_layout(e.value.trailers()) == layouts.timeline()[1]  # its shards, count, round, fingerprint
    with pytest.raises(LayoutMoved) as e:
        layouts.membership.register_host(0, "0" * 16)  # another job's caller: no fingerprint of this one
    assert moved_layout(e.value.trailers()) is None and e.value.newest == 1


def test_a_newest_layout_too_big_for_a_trailer_is_not_attached_and_the_refusal_stays_layout_moved():
    host, layouts = running()
    switch_offline(layouts, 2, 0, addresses=tuple(f"{'x' * 2100}-{i}:7000" for i in range(2)))  # 4.2 KB of names
    with pytest.raises(LayoutMoved) as e:
        layouts.membership.register_host(0, JOB.fingerprint)
    assert moved_layout(e.value.trailers()) is None and e.value.newest == 1
