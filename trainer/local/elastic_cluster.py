"""`ps-cluster --elastic`: the membership of a running sync job changes while you watch (docs/elastic.md).

The job starts with ``--trainers N`` (at least 2) and admits N + 1.  A third of the way through, a trainer
joins (``ps-trainer --join``: the job hands it rank N); two thirds of the way, rank 1 is sent SIGTERM and
leaves.  No timing decides where: rank 0 runs with ``--hold-at-round J`` and rank 1 with
``--hold-at-round L``, each waiting there until the membership changes (or, rank 1, until it is stopped), and
the scenario acts when shard 0's version reaches that round -- so the joiner is admitted at J + 2 and the
leaver is out from L + 1 however loaded the machine is.  The summary prints the membership timeline from
the shards' GetStats ``epochs`` and each epoch's throughput (the median round's, so the rounds a hold
stretched do not count).
"""

from __future__ import annotations

import logging
import signal
import statistics
from pathlib import Path

from psserver.protocol.stubs import fetch_stat
from trainer.local.procs import Proc, start_trainer

log = logging.getLogger("ps-cluster")
MIN_STEPS = 9  # a join a third of the way in (admitted two rounds later) and a leave after it


def check(args) -> None:
    """--elastic's one-line refusals, before anything starts."""
    if args.mode != "sync":
        raise ValueError(f"--elastic shows a sync job's membership epochs, not --mode {args.mode}; drop --mode")
    if args.trainers < 2:
        raise ValueError(f"--elastic needs --trainers 2 or more (got {args.trainers}): rank 1 is the one that leaves")
    if args.steps < MIN_STEPS:
        raise ValueError(f"--elastic needs --steps {MIN_STEPS} or more (got {args.steps}): the join is placed a "
                         "third of the way in and the leave two thirds; e.g. --steps 300")


def rounds(args) -> tuple[int, int]:
    """(J, L): the round rank 0 holds at for the join, and the round rank 1 holds at to be stopped."""
    return args.steps // 3, 2 * args.steps // 3


def trainer_flags(args, rank: int) -> list[str]:
    """What --elastic adds to an initial trainer's flags (ps-cluster's trainer_args)."""
    join_at, leave_at = rounds(args)
    hold = {0: join_at, 1: leave_at}.get(rank)
    return ["--max-trainers", str(args.trainers + 1), "--log-every", "1"] + (
        ["--hold-at-round", str(hold)] if hold is not None else [])


class ElasticScenario:
    """Starts the joiner and stops the leaver as shard 0's version reaches their rounds (``poll``)."""

    def __init__(self, args, run: Path, ps: str, trainers: list[Proc], joiner_args: list[str], env: dict):
        self.args, self.run, self.ps, self.trainers = args, run, ps, trainers
        self.joiner_args, self.env = joiner_args, env
        self.join_at, self.leave_at = rounds(args)
        self.joined = self.stopped = False

    def poll(self) -> None:
        """One look at shard 0's version; acts at most once per event.  ``trainers`` grows by the joiner."""
        if self.joined and self.stopped:
            return
        version = fetch_stat(self.ps.split(",")[0]).version
        if not self.joined and version >= self.join_at:
            self.joined = True
            rank = self.args.trainers
            log.info("round %d: a trainer joins the running job (ps-trainer --join; it will be rank %d)",
                     version, rank)
            self.trainers.append(start_trainer(None, self.ps, self.run / f"trainer{rank}.log",
                                               ["--join", *self.joiner_args], env=self.env, name=f"trainer{rank}"))
        if self.joined and not self.stopped and version >= self.leave_at:
            self.stopped = True
            log.info("round %d: rank 1 is sent SIGTERM: it takes one more step, announces its leave, and goes",
                     version)
            self.trainers[1].signal(signal.SIGTERM)


def membership_rows(stats0, records: list[dict], steps: int, batch: int) -> list[dict]:
    """Each membership epoch of the job's rounds (shard 0's timeline): its first round, ranks, and samples/s
    over its rounds -- members x batch / the median round's seconds, from rank 0's step records (``versions``
    and ``time``; rank 0 is a member throughout).  Epochs from the last round on (the trainers' final
    Leaves) are left out."""
    ends = {r["versions"][0]: r["time"] for r in records if r.get("event") == "step" and r.get("versions")}
    epochs = [e for e in stats0.epochs if e.round < steps] if stats0 is not None else []
    rows = []
    for k, e in enumerate(epochs):
        stop = epochs[k + 1].round if k + 1 < len(epochs) else steps
        seconds = [ends[r + 1] - ends[r] for r in range(e.round, stop) if r in ends and r + 1 in ends]
        median = statistics.median(seconds) if seconds else 0.0
        rate = max(e.size, len(e.members)) * batch / median if median > 0 else None  # size: sent for every epoch
        rows.append(dict(epoch=e.number, round=e.round, rounds=stop - e.round, members=sorted(e.members),
                         samples_per_sec=rate))
    return rows


def summary_rows(rows: list[dict]) -> list[tuple[str, str]]:
    """print_summary's lines for the timeline: one per epoch."""
    return [(f"epoch {r['epoch']} (rounds {r['round']}-{r['round'] + r['rounds'] - 1})",
             f"ranks {', '.join(map(str, r['members']))}: "
             + ("n/a" if r["samples_per_sec"] is None else f"{r['samples_per_sec']:.1f} samples/s"))
            for r in rows]
