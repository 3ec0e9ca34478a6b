"""`ps-cluster --elastic-schedule join@R1,join@R2,...`: trainers join a running job one at a time, and the summary
says how the throughput follows the members (docs/elastic.md, "Scaling 1 -> 4").

The job starts with ``--trainers N`` and admits N + the joins (``--max-trainers``).  Where the joins land needs no
timing in sync mode: rank 0 holds at R1 (``--hold-at-round``) and each joiner but the last holds at the next
join's round, so the job waits at R_k until the k-th joiner, started when shard 0 reaches R_k, is in (admitted at
R_k + 2).  Async has no shared round (a joiner's own round counts its own steps), so only rank 0 holds, for the
first join; later joiners are started when shard 0's version reaches their R and join once their process is up.

Per membership epoch (shard 0's GetStats ``epochs``) the summary gives the members, shard 0's versions per second
(rounds/s in sync, pushes/s in async), samples/s, their ratio to the first epoch, and what the data-parallel model
expects of it: N_e / N_0 ideally, and min(N_e, cores) / min(N_0, cores) on this host, where every trainer gets
``cores // (N + joins)`` torch threads (at least 1) and the trainers share the cores with the shards.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from psserver.protocol.stubs import fetch_stat
from trainer.local.procs import Proc, start_trainer

log = logging.getLogger("ps-cluster")
MODES = ("sync", "async")
JOIN_LEAD = 2  # a joiner started while the job holds at R is admitted at R + 2 (psserver.protocol.epochs)
GAP = JOIN_LEAD + 1  # sync: a joiner holds at the next join's round, which must come after its first round


def parse(text: str) -> list[int]:
    """``join@R1,join@R2,...`` -> [R1, R2, ...]; one-line ValueError naming the item and a hint.  Rounds are 1 or
    more and at least GAP apart (a joiner computes from R + 2 and holds at the next R)."""
    rounds: list[int] = []
    for i, item in enumerate(text.split(","), 1):
        m = re.fullmatch(r"join@(\d+)", item.strip())
        if not m:
            raise ValueError(f"--elastic-schedule {text!r}: event {i} ({item.strip()!r}) is not join@ROUND; "
                             "e.g. --elastic-schedule join@40,join@80,join@120")
        at = int(m.group(1))
        if at < 1:
            raise ValueError(f"--elastic-schedule {text}: event {i} (join@{at}): ROUND must be 1 or more; "
                             "e.g. join@40")
        if rounds and at < rounds[-1] + GAP:
            raise ValueError(f"--elastic-schedule {text}: event {i} (join@{at}) must come {GAP} or more rounds after "
                             f"event {i - 1}'s {rounds[-1]} (a joiner computes from its ROUND + {JOIN_LEAD}); "
                             f"e.g. join@{rounds[-1] + 40}")
        rounds.append(at)
    return rounds


def check(args) -> list[int]:
    """--elastic-schedule's one-line refusals, before anything starts; returns the join rounds."""
    rounds = parse(args.elastic_schedule)
    if args.mode not in MODES:
        raise ValueError(f"--elastic-schedule runs a sync or async job, not --mode {args.mode}; e.g. --mode sync")
    if args.elastic or getattr(args, "reshard", ""):
        other = "--elastic" if args.elastic else "--reshard"
        raise ValueError(f"--elastic-schedule and {other} are separate scenarios; drop one")
    if args.steps <= rounds[-1] + GAP:
        raise ValueError(f"--elastic-schedule {args.elastic_schedule} needs --steps more than {rounds[-1] + GAP} "
                         f"(got {args.steps}): the last joiner is admitted at {rounds[-1] + JOIN_LEAD} and needs "
                         f"rounds to measure; e.g. --steps {rounds[-1] + rounds[0]}")
    return rounds


def most_trainers(args) -> int:
    """The members the job reaches: --trainers plus one per join (its --max-trainers)."""
    return args.trainers + len(parse(args.elastic_schedule))


def threads(args) -> int:
    """Torch threads per trainer: the host's cores over the most trainers, so each trainer computes the same
    way in every epoch (the data-parallel model's unit)."""
    return max(1, (os.cpu_count() or 1) // most_trainers(args))


def hold_round(args, rank: int) -> int | None:
    """The round a trainer holds at: rank 0 at the first join; in sync each joiner at the next join's round."""
    rounds = parse(args.elastic_schedule)
    if rank == 0:
        return rounds[0]
    k = rank - args.trainers + 1  # joiner k (1-based) is rank N + k - 1: no trainer leaves here
    if args.mode == "sync" and 1 <= k < len(rounds):
        return rounds[k]
    return None


def trainer_flags(args, rank: int) -> list[str]:
    """What --elastic-schedule adds to a trainer's flags (ps-cluster's trainer_args): a step record per step
    (for the rates), the job's --max-trainers, the hold, and the threads."""
    hold = hold_round(args, rank)
    return ["--max-trainers", str(most_trainers(args)), "--log-every", "1", "--threads", str(threads(args))] + (
        ["--hold-at-round", str(hold)] if hold is not None else [])


class ScheduleScenario:
    """Starts joiner k once shard 0's version reaches R_k (``poll``); ``trainers`` grows by each joiner.
    ``joiner_args(rank)``: that joiner's ps-trainer flags; ``env(rank)``: its environment.  Each poll also
    samples the CPU seconds the job's processes (``shards`` and ``trainers``) have used, against shard 0's
    version: on a shared machine other users take cores too, and samples per CPU second is what they leave
    alone."""

    def __init__(self, args, run: Path, ps: str, trainers: list[Proc], shards: list[Proc], joiner_args, env):
        self.args, self.run, self.ps, self.trainers, self.shards = args, run, ps, trainers, shards
        self.joiner_args, self.env = joiner_args, env
        self.rounds = parse(args.elastic_schedule)
        self.started = 0
        self.load = [os.getloadavg()[0]]  # the 1-minute load at the start and at each join (a shared machine)
        self.cpu: list[tuple[float, int, float, float]] = []  # (time, shard 0's version, CPU s: all, the shards)
        self._last: dict[int, float] = {}  # pid -> its CPU seconds last read (kept once it exits)

    def poll(self) -> None:
        """One look at shard 0's version and the processes' CPU; starts at most one joiner."""
        version = fetch_stat(self.ps.split(",")[0]).version
        for p in self.shards + self.trainers:
            got = cpu_seconds(p.popen.pid)
            if got is not None:
                self._last[p.popen.pid] = got
        shard_pids = {p.popen.pid for p in self.shards}
        self.cpu.append((time.time(), version, sum(self._last.values()),
                         sum(v for pid, v in self._last.items() if pid in shard_pids)))
        if self.started == len(self.rounds) or version < self.rounds[self.started]:
            return
        rank = self.args.trainers + self.started
        self.started += 1
        self.load.append(os.getloadavg()[0])
        log.info("round %d: trainer %d of %d joins the running job (ps-trainer --join; it will be rank %d)",
                 version, rank + 1, most_trainers(self.args), rank)
        self.trainers.append(start_trainer(None, self.ps, self.run / f"trainer{rank}.log",
                                           ["--join", *self.joiner_args(rank)], env=self.env(rank),
                                           name=f"trainer{rank}"))


def cpu_seconds(pid: int) -> float | None:
    """A live process's CPU seconds (utime + stime, Linux /proc); None if it is gone or /proc is not there.
    (trainer.tools.procstat reads the same, but the library does not import its measuring tools.)"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def version_times(records: list[list[dict]]) -> dict[int, float]:
    """Shard 0's version -> the earliest time any trainer's step record saw it (``versions[0]``, ``time``: wall
    clock, comparable across the processes of one host).  A sync version v is seen when round v - 1 closed."""
    seen: dict[int, float] = {}
    for recs in records:
        for r in recs:
            if r.get("event") == "step" and r.get("versions"):
                v = r["versions"][0]
                seen[v] = min(seen.get(v, r["time"]), r["time"])
    return seen


def window(start: int, stop: int, last: bool) -> tuple[int, int]:
    """The versions an epoch [start, stop) is measured between.  Left out: its first round (the joiner's first
    step warms up) and, before a join, the last two (held at the next join's round, then until its commit)."""
    return start + 1, stop if last else stop - JOIN_LEAD


def rate(seen: dict[int, float], lo: int, hi: int) -> float | None:
    """Versions per second between the first version seen at or after ``lo`` and the last at or before ``hi``."""
    inside = sorted(v for v in seen if lo <= v <= hi)
    if len(inside) < 2 or seen[inside[-1]] <= seen[inside[0]]:
        return None
    return (inside[-1] - inside[0]) / (seen[inside[-1]] - seen[inside[0]])


def growing(epochs, end: int) -> tuple[list, int]:
    """The epochs of the joins: from the first until one that shrinks (the trainers' final leaves; in async
    each trainer ends at its own step) or that starts at ``end``; and the version the last one ends at."""
    kept = []
    for e in epochs:
        if e.round >= end or (kept and max(e.size, len(e.members)) < max(kept[-1].size, len(kept[-1].members))):
            return kept, min(end, e.round)
        kept.append(e)
    return kept, end


def cpu_use(cpu: list[tuple[float, int, float, float]], lo: int, hi: int) -> tuple[float, float, float, int] | None:
    """(seconds, CPU seconds, the shards' CPU seconds, versions) between the first CPU sample at a version in
    [lo, hi) and the last.  Not at hi: a sync job held at a join's round stays at that version while the joiner
    starts (its torch import would count)."""
    inside = [c for c in cpu if lo <= c[1] < hi]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0] or inside[-1][2] <= inside[0][2]:
        return None
    first, last = inside[0], inside[-1]
    return last[0] - first[0], last[2] - first[2], last[3] - first[3], last[1] - first[1]


def scaling_rows(epochs, seen: dict[int, float], steps: int, batch: int, mode: str, cores: int,
                 per_trainer: int, cpu: list | None = None) -> list[dict]:
    """One row per membership epoch before round ``steps`` (``epochs``: shard 0's StatsReply.epochs): members,
    versions/s (rounds/s in sync, pushes/s in async), samples/s, the ratio to the first epoch, and the
    data-parallel model's expectation: ideal N_e / N_0, and on this host's ``cores`` with ``per_trainer``
    threads each, min(N_e * t, cores) / min(N_0 * t, cores).  With ``cpu`` (ScheduleScenario's samples) also
    the cores the job's processes used and its samples per CPU second: constant in the ideal model."""
    kept, end = growing(epochs, steps if mode == "sync" else max(seen, default=0))
    rows = []
    for k, e in enumerate(kept):
        last = k + 1 == len(kept)
        stop = end if last else kept[k + 1].round
        n = max(e.size, len(e.members))
        lo, hi = window(e.round, stop, last)
        per_sec = rate(seen, lo, hi)
        samples = None if per_sec is None else per_sec * batch * (n if mode == "sync" else 1)
        rows.append(dict(epoch=e.number, round=e.round, rounds=stop - e.round, members=sorted(e.members),
                         trainers=n, measured=[lo, hi], versions_per_sec=per_sec, samples_per_sec=samples,
                         **cpu_columns(cpu_use(cpu or [], lo, hi), batch * (n if mode == "sync" else 1))))
    base = rows[0] if rows else None
    for r in rows:
        ok = base["samples_per_sec"] and r["samples_per_sec"]
        r["ratio"] = r["samples_per_sec"] / base["samples_per_sec"] if ok else None
        r["ideal"] = r["trainers"] / base["trainers"]
        r["bound_here"] = min(r["trainers"] * per_trainer, cores) / min(base["trainers"] * per_trainer, cores)
    return rows


def cpu_columns(use: tuple[float, float, float, int] | None, per_version: int) -> dict:
    """A row's cores used (all the job's processes, and the shards alone) and samples per CPU second (None
    where the CPU was not sampled enough)."""
    if use is None:
        return dict(cores_used=None, shard_cores_used=None, samples_per_cpu_sec=None)
    seconds, cpu_seconds, shard_seconds, versions = use
    return dict(cores_used=cpu_seconds / seconds, shard_cores_used=shard_seconds / seconds,
                samples_per_cpu_sec=versions * per_version / cpu_seconds)


def used(row: dict) -> str:
    """'1.42 (0.61)': the cores the job used in an epoch, the shards' part in brackets."""
    if row.get("cores_used") is None:
        return "n/a"
    return f"{row['cores_used']:.2f} ({row['shard_cores_used']:.2f})"


def summary_rows(scaling: dict) -> list[tuple[str, str]]:
    """print_summary's lines: a header, then one per epoch."""
    unit = "rounds/s" if scaling["mode"] == "sync" else "pushes/s"
    head = (f"scaling ({scaling['mode']}, {scaling['cores']} cores)",
            f"{'members':<12} {unit:>9} {'samples/s':>10} {'x first':>8} {'ideal':>6} {'cores allow':>11} "
            f"{'cores used (shards)':>19} {'samples/cpu-s':>13}")
    lines = [head]
    for r in scaling["epochs"]:
        num = (lambda x, f: "n/a" if x is None else format(x, f))
        span = "rounds" if scaling["mode"] == "sync" else "versions"  # async: shard 0's, one per push
        lines.append((f"epoch {r['epoch']} ({span} {r['round']}-{r['round'] + r['rounds'] - 1})",
                      f"{','.join(map(str, r['members'])):<12} {num(r['versions_per_sec'], '.2f'):>9} "
                      f"{num(r['samples_per_sec'], '.1f'):>10} {num(r['ratio'], '.2f'):>8} "
                      f"{r['ideal']:>6.2f} {r['bound_here']:>11.2f} {used(r):>19} "
                      f"{num(r.get('samples_per_cpu_sec'), '.1f'):>13}"))
    lines.append(("load (1 min) at start / joins", " / ".join(f"{x:.2f}" for x in scaling["load"])))
    return lines


def summarize(args, stats: list, run: Path, read_records, load: list[float], cpu: list) -> dict:
    """summary.json's ``scaling``: the host, the load, each shard's epoch boundaries (so a reader sees every join
    took effect at one round on every shard), and the rows (``read_records``: trainer.local.cluster's)."""
    records = [read_records(run / f"trainer{r}.jsonl") for r in range(most_trainers(args))]
    epochs = list(stats[0].epochs) if stats and stats[0] is not None else []
    cores = os.cpu_count() or 1
    return dict(mode=args.mode, schedule=args.elastic_schedule, cores=cores, threads_per_trainer=threads(args),
                batch=args.batch_size or 32, load=load,
                boundaries=[None if s is None else [[e.round, sorted(e.members)] for e in s.epochs] for s in stats],
                epochs=scaling_rows(epochs, version_times(records), args.steps, args.batch_size or 32, args.mode,
                                    cores, threads(args), cpu))
