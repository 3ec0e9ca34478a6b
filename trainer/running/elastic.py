"""The training loop of an elastic job (docs/elastic.md): each round's batch follows the membership timeline,
and ``--hold-at-round`` lets a demo or a test change the membership at a known round.

Split from trainer.running.loop, whose plain loop splits the data by a fixed rank and number of trainers.
"""

from __future__ import annotations

import logging
import time

import torch

from psserver.protocol.rules import Mode
from trainer.workloads.data import batch_place, epoch_order, member_batch_indices, round_batch
from trainer.membership.data_claims import BatchClaims
from trainer.running.reporting import Progress
from trainer.running.stopping import StopRequest

log = logging.getLogger(__name__)

HOLD_POLL_SECONDS = 0.25  # --hold-at-round: how often the held trainer asks a shard for the timeline


def run_elastic_steps(run, stop: StopRequest) -> str:
    """The steps of an elastic job: each step's batch is this trainer's part of the data epoch's remaining
    samples, so a join or a leave re-splits them over the members.  Sync: the round's global batch as the
    membership timeline places it (trainer.workloads.data.round_batch), the round being the version pulled.  Async and
    stale-timeout: the batch the job's data cursor grants (trainer.membership.data_claims), the round only counting the
    steps taken since the trainer joined.  Runs until the job's round --steps.  ``run``: trainer.running.loop.Run."""
    cfg, ps = run.cfg, run.ps
    n = len(run.data.x_train)
    claims = None if cfg.mode == Mode.SYNC else BatchClaims(ps.client.parts[0], max(1, n // cfg.batch_size))
    run.claims = claims
    progress = Progress(cfg, run.total_steps)
    orders: dict[int, torch.Tensor] = {}
    losses: list[float] = []
    last = False  # this round's push announces the leave
    try:
        while True:
            round_ = ps.versions[0] if claims is None else ps.joined_at + run.step
            if round_ >= run.total_steps:
                break
            if cfg.hold_at_round and round_ == cfg.hold_at_round:
                hold_for_membership(ps, stop, round_)
            if stop.is_set():
                if last:
                    return "signal"
                last = True  # one more step, whose push says it is the last: no round's data is left untaken
                ps.announce_leave()
                log.info("rank %d: stopping: round %d is its last; it leaves after it", ps.rank, round_)
            epoch, start = step_batch(run, ps, claims, round_)
            if epoch > run.epoch:
                if losses:
                    acc = run.evaluate(train_loss=sum(losses) / len(losses), end_of_epoch=True)
                    progress.evaluated(run.step, run.epoch, acc, end_of_epoch=True)
                run.epoch, losses = epoch, []
            if epoch not in orders:
                orders = {**{e: o for e, o in orders.items() if e == run.epoch}, epoch: epoch_order(n, cfg.seed, epoch)}
            if claims is not None and not last and round_ + 1 < run.total_steps:
                claims.arm()  # this step's push claims the next batch (trainer.membership.data_claims)
            loss = run.train_step(member_batch_indices(orders[epoch], start, 0, cfg.batch_size))
            losses.append(loss)
            run.record_step(loss)
            elapsed = time.perf_counter() - run.t_start
            progress.step(run.step, run.epoch, loss, run.step * cfg.batch_size / elapsed, run.stale_steps,
                          run.versions)
        acc = run.evaluate(train_loss=sum(losses) / max(1, len(losses)), end_of_epoch=False)
        progress.evaluated(run.step, run.epoch, acc, end_of_epoch=False)
        return ""
    except BaseException:
        claims = None  # a step that failed: its batch is re-issued at the Leave, not released
        raise
    finally:
        if claims is not None and not ps.left:
            claims.release()  # the last batch was trained: nothing of it is re-issued at the Leave
        progress.close()


def step_batch(run, ps, claims: BatchClaims | None, round_: int) -> tuple[int, int]:
    """(data epoch, offset in its order) of this trainer's batch for this step."""
    cfg = run.cfg
    if claims is not None:
        batch = claims.next()
        return batch_place(batch, claims.batches_per_epoch, cfg.batch_size)
    members = ps.members_at(round_)
    if ps.rank not in members:
        raise RuntimeError(f"rank {ps.rank} is not a member of the job at round {round_} (members "
                           f"{members[:10]}): it left or was never admitted")
    timeline = [(e.round, e.size) for e in ps.timeline] or [(0, cfg.num_trainers)]
    epoch, offset, _ = round_batch(len(run.data.x_train), cfg.batch_size, timeline, round_)
    return epoch, offset + members.index(ps.rank) * cfg.batch_size


def hold_for_membership(ps, stop: StopRequest, round_: int) -> bool:
    """``--hold-at-round``: before computing ``round_``, wait until the job's membership timeline changes (a
    join committed, a leave) or this trainer is stopped -- so a demo or a test adds or removes a trainer at a
    known round however slowly the other process starts, with no timing in it.  Meanwhile (sync) every
    round from ``round_`` on waits for this trainer; a joiner is admitted from ``round_ + 2``
    (psserver.protocol.epochs.JOIN_LEAD).  Returns True if the membership changed."""
    before = ps.fetch_timeline()
    log.info("rank %d holds at round %d until the job's membership changes (--hold-at-round)", ps.rank, round_)
    while not stop.wait(HOLD_POLL_SECONDS):
        if ps.fetch_timeline() != before:
            log.info("rank %d: the membership changed; round %d goes on", ps.rank, round_)
            return True
    return False
