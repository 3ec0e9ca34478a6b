"""A live re-shard's plan as a shard holds it (docs/design/handoff-io.md): the two address lists and this shard's place
in each, read and bounded from a PREPARE, its moves of a job, and the checks made before anything of it is taken
(PREPARE's refusals, ``--max-memory``, a COPY's job).  A value apart from HandoffIO: both its calls and the streams
in (psserver.resharding.handoff.inbox) compute from a plan, which needs none of the hand-off's state."""

from __future__ import annotations

from dataclasses import dataclass

from psserver.protocol import limits
from psserver.protocol.errors import InvalidRequest, JobMismatch, NotReady, OutOfMemory
from psserver.protocol.job import JobSpec
from psserver.protocol.layouts import LayoutEpoch, Move, first_layout, new_job, plan_moves
from psserver.resharding.handoff import shard_async as async_
from psserver.resharding.handoff.shard_rows import check_tables
from psserver.resharding.handoff.wire import job_proto
from psserver.resharding.layout_host import LayoutHost
from psserver.state.budget import dense_bytes, handoff_bytes


@dataclass(frozen=True)
class Plan:
    """A coordinator's plan as this shard holds it: both address lists, its place in each, the moves."""
    id: str
    old: tuple[str, ...]
    new: tuple[str, ...]
    partitions: int  # the new layout's per shard (0: the job's)
    you: str

    @property
    def old_index(self) -> int | None:
        return self.old.index(self.you) if self.you in self.old else None

    @property
    def new_index(self) -> int | None:
        return self.new.index(self.you) if self.you in self.new else None

    def layouts(self, job: JobSpec) -> tuple[LayoutEpoch, LayoutEpoch, JobSpec]:
        """(the old layout, the new one as plan_moves reads it, the new job)."""
        job2 = new_job(job, len(self.new), self.partitions or job.partitions)
        return (first_layout(job, self.old), LayoutEpoch(1, 0, job2.num_shards, job2.partitions, self.new),
                job2)

    def moves(self, job: JobSpec) -> list[Move]:
        old, new, _ = self.layouts(job)
        return plan_moves(job.total_params, old, new)


def plan_of(request) -> Plan:
    """The plan a PREPARE names, bounded before anything is computed from it (an address list past MAX_SHARDS made
    new_job raise ValueError: UNKNOWN): INVALID_ARGUMENT naming the field and both values."""
    for field in ("old_addresses", "new_addresses"):
        addresses = list(getattr(request, field))
        if not 0 < len(addresses) <= limits.MAX_SHARDS:
            raise InvalidRequest(f"{field} lists {len(addresses)} addresses but a plan takes 1 to {limits.MAX_SHARDS}")
        for address in addresses:
            limits.check_id(field, address, limits.MAX_NAME_CHARS)
        twice = sorted({a for a in addresses if addresses.count(a) > 1})
        if twice:
            raise InvalidRequest(f"{field} lists {twice[0]!r} {addresses.count(twice[0])} times but each shard once")
    limits.check_id("you", request.you, limits.MAX_NAME_CHARS)
    if request.partitions > limits.MAX_PARTITIONS:
        raise InvalidRequest(f"partitions is {request.partitions} but a plan takes at most {limits.MAX_PARTITIONS}")
    return Plan(request.plan, tuple(request.old_addresses), tuple(request.new_addresses), request.partitions,
                request.you)


def check_job(layouts: LayoutHost, job: JobSpec, plan: Plan) -> None:
    """PREPARE's refusals (docs/status-codes.md): FAILED_PRECONDITION each, nothing changed."""
    async_.check_job(job, layouts.current.part(0).cursor.next)  # sync, or async (stage 8)
    check_tables(job)
    for part in layouts.current.parts[:job.partitions]:
        if part.params is None:  # nothing to copy yet (before: copy_range's AttributeError, UNKNOWN)
            raise NotReady(f"initialized is False on partition {part.partition} but a live re-shard copies "
                           "the parameters: re-shard after rank 0's Init")
        pending = part.epochs.pending if part.epochs is not None else {}
        if pending:
            rank, join = sorted(pending.items())[0]
            raise JobMismatch(f"rank {rank} has a pending join (proposed round {join.proposal}) but a live "
                              "re-shard needs rank None pending: re-shard after the join settles")
    if plan.old_index is None or len(plan.old) != job.num_shards:
        raise InvalidRequest(f"you is {plan.you!r} but the job's {job.num_shards} shards are --ps "
                             f"{list(plan.old)}: name this shard's address in it")
    moves = moves_of(plan, job)
    if not any(m.src == plan.old_index for m in moves):
        raise InvalidRequest(f"plan {plan.id!r} moves nothing from shard {plan.old_index}: its dense slice is "
                             f"empty (the job's {job.total_params} parameters over {job.num_shards} shards; mf has "
                             "1), and a live re-shard moves every old shard's slice: not built for an empty one")


def check_memory(layouts: LayoutHost, job: JobSpec, plan: Plan, max_lag: int) -> None:
    """PREPARE's copies, forward logs and new pieces beside the job, in --max-memory: RESOURCE_EXHAUSTED naming
    both numbers (a snapshot of the range was taken whatever the budget)."""
    budget = layouts.current.budget
    extra = handoff_bytes(job, plan.layouts(job)[2], moves_of(plan, job), plan.old_index, plan.new_index, max_lag)
    held = dense_bytes(job, layouts.current.shard_id)
    if held + sum(extra.values()) > budget.limit:
        parts = ", ".join(f"{k} {v}" for k, v in extra.items())
        raise OutOfMemory(f"a live re-shard needs {held + sum(extra.values())} bytes here (the job's {held}, "
                          f"{parts}) but the shard's memory budget is {budget.limit} bytes: raise ps-server "
                          "--max-memory or re-shard to more shards")


def check_piece_memory(layouts: LayoutHost, job: JobSpec, plan: Plan) -> None:
    """A shard that had no job at PREPARE (a new one) learns the job from the first COPY: its new pieces must
    fit in --max-memory (a shard with a job checked them at PREPARE)."""
    if layouts.current.head.job is None:
        need = dense_bytes(plan.layouts(job)[2], plan.new_index)
        limit = layouts.current.budget.limit
        if need > limit:
            raise OutOfMemory(f"the new pieces of plan {plan.id!r} need {need} bytes here but the shard's memory "
                              f"budget is {limit} bytes: raise ps-server --max-memory")


def moves_of(plan: Plan, job: JobSpec) -> list[Move]:
    """The plan's moves of ``job``; a job whose layout cannot be computed for the plan is INVALID_ARGUMENT."""
    try:
        return plan.moves(job)
    except ValueError as e:
        raise InvalidRequest(f"plan {plan.id!r} cannot move this job: {str(e)[:200]}") from None


def copied_job(payload: dict, plan: Plan) -> JobSpec:
    """A COPY's job (checked by psserver.resharding.handoff.wire), which must be a job of the plan's old shards."""
    job = JobSpec.from_proto(job_proto(payload))
    if job.num_shards != len(plan.old):
        raise InvalidRequest(f"a COPY's job has num_shards {job.num_shards} but plan {plan.id!r} moves from "
                             f"{len(plan.old)} shards")
    return job
