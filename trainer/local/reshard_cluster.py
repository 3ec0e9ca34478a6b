"""`ps-cluster --reshard M@ROUND[,M@ROUND...]`: a sync job -- dense, or a table model (mf, ncf, dlrm) whose tables
are sync too -- moves from --shards to M shards, step after step, while you watch (docs/design/handoff-io.md).

max(--shards, every M) shards are started, the extra ones empty; the trainers get only the first --shards.  Each
step is one coordinator subprocess (``ps-server reshard --ps OLD --to NEW --at-round ROUND``: the trainer room may
not import the shard's code), OLD and NEW being the first M of the list before and after; the next is started once
the previous exited 0.  A step to fewer shards drains the last ones: once its coordinator exited 0 (its last line
says they may be stopped) they are SIGTERMed and must exit 0.  The first is started with the trainers so that its
start-up (seconds) is spent before ROUND, not while the unpaced job trains on; each prepares when shard 0's version
reaches its ROUND, and its lines are logged.  The shards pick each committed round R (at or after ROUND); the
summary gains, per step, R, the hand-off's seconds (PREPARE to the switch, the coordinator's own figure) and rank
0's rounds per second before and after R.  The trainers are not paced: a source whose copy is outrun holds its
rounds until the forwards catch up (docs/design/handoff-io.md), so the rates are the job's own.
"""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

from trainer.local.procs import Proc, child_env, cli

log = logging.getLogger("ps-cluster")
DENSE_MODELS = ("cnn", "mlp", "widemlp", "resnet18")  # no tables; every other model has tables, moved if sync


def parse(text: str, shards: int) -> list[tuple[int, int]]:
    """``M1@R1,M2@R2,...`` -> [(M, ROUND), ...]; one-line ValueError naming the values and a hint.  Rounds
    increase; each M differs from the count before it (--shards for the first) and may be smaller (a drain, whose
    shards are then stopped: no later step grows back onto them)."""
    steps, before, after, low = [], shards, 0, None  # low: the fewest shards a drain left (the rest are stopped)
    for i, item in enumerate(text.split(","), 1):
        m = re.fullmatch(r"(\d+)@(\d+)", item.strip())
        if not m:
            raise ValueError(f"--reshard {text!r} is not M@ROUND[,M@ROUND...]; e.g. --shards 2 --reshard 3@20,2@60")
        to, at = int(m.group(1)), int(m.group(2))
        where = f"--reshard {text}: step {i} ({to}@{at})"
        before_name = f"--shards {shards}" if i == 1 else f"step {i - 1}'s {before}"
        if to < 1:
            raise ValueError(f"{where}: M must be 1 or more; e.g. --reshard {max(before - 1, 1)}@{at}")
        if to == before:
            raise ValueError(f"{where} changes nothing: {to} shards is the count before it ({before_name}); "
                             f"e.g. --reshard {before + 1}@{at} to grow or {max(before - 1, 1)}@{at} to drain")
        if at < 1:
            raise ValueError(f"{where}: ROUND must be 1 or more; e.g. --reshard {to}@20")
        if at <= after:
            raise ValueError(f"{where}: rounds must increase, and {at} is not after step {i - 1}'s {after}; "
                             f"e.g. {to}@{after + 20}")
        if low is not None and to > low:
            raise ValueError(f"{where} would grow back onto shard {low}, stopped after a drain (a drained process is "
                             f"not started again); e.g. end the sequence at the drain")
        steps.append((to, at))
        low = min(low if low is not None else to, to) if to < before else low
        before, after = to, at
    return steps


def check(args) -> list[tuple[int, int]]:
    """--reshard's one-line refusals, before anything starts; returns the steps [(M, ROUND), ...]."""
    steps = parse(args.reshard, args.shards)
    if args.mode == "async" and (args.optimizer or "sgd") != "sgd":  # (psserver.resharding.handoff.shard_async)
        raise ValueError(f"--reshard of an async job takes --optimizer sgd, not {args.optimizer} (its shards stop at "
                         "different versions, so a step count would differ); use --optimizer sgd")
    if args.mode == "async" and args.push_window != 1:
        raise ValueError(f"--reshard of an async job follows the switch with --push-window 1, not {args.push_window}; "
                         "drop --push-window")
    tables = getattr(args, "embedding_mode", None) or args.mode
    if args.model not in DENSE_MODELS and tables != "sync":
        raise ValueError(f"--reshard moves sync tables only, not --embedding-mode {tables} (--model {args.model}'s "
                         f"tables); drop --embedding-mode, or e.g. --model mlp --dataset synthetic")
    if args.elastic:
        raise ValueError("--reshard and --elastic are separate scenarios; drop one")
    last = steps[-1][1]
    if args.steps <= last:
        raise ValueError(f"--reshard {args.reshard} needs --steps more than {last} (got {args.steps}): every switch "
                         f"must fall inside the run; e.g. --steps {last * 2}")
    return steps


def trainer_flags(args, rank: int) -> list[str]:
    """What --reshard adds to a trainer's flags: a step record per step (for the rates).  No pace: the sources
    throttle their rounds if the copy is outrun (a --straggler-delay is ps-cluster's own, kept)."""
    return ["--log-every", "1"]


class ReshardScenario:
    """Runs ``ps-server reshard --at-round ROUND`` at the first ``poll`` (it waits for the round itself);
    ``finish`` reads its lines.  One step of ``ReshardSteps``."""

    def __init__(self, at: int, old: list[str], new: list[str], run: Path, log_name: str = "reshard.log"):
        self.at, self.old, self.new, self.out = at, old, new, run / log_name
        self.proc: Proc | None = None
        self.lines: list[str] = []

    def poll(self) -> None:
        """Starts the coordinator (it waits for ROUND itself); after that, logs its new lines as they come."""
        if self.proc is not None:
            self.say_new()
            if self.proc.popen.poll():  # the trainers would wait out their retry budgets: stop now, say why
                raise RuntimeError(f"ps-server reshard exited with {self.proc.popen.returncode}; its log "
                                   f"{self.out} ends: {self.proc.log_tail(1)}")
            return
        log.info("ps-server reshard --ps %s --to %s --at-round %d", ",".join(self.old), ",".join(self.new), self.at)
        with open(self.out, "ab") as f:
            popen = subprocess.Popen(cli("psserver.cli") + ["reshard", "--ps", ",".join(self.old), "--to",
                                                            ",".join(self.new), "--wait", "300",
                                                            "--at-round", str(self.at)],
                                     stdout=f, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
        self.proc = Proc(self.out.stem, popen, self.out)

    def finish(self, timeout: float = 330.0) -> tuple[int | None, list[str]]:
        """The coordinator's exit code (None: it never started) and its lines, each logged."""
        if self.proc is None:
            return None, []
        code = self.proc.terminate(timeout) if self.proc.alive() else self.proc.popen.returncode
        self.say_new(final=True)
        return code, self.lines

    def say_new(self, final: bool = False) -> None:
        """Logs the coordinator's complete lines not logged yet (``final``: a last partial one too)."""
        text = self.out.read_text(errors="replace")
        lines = text.splitlines() if final or text.endswith("\n") else text.splitlines()[:-1]
        for line in lines[len(self.lines):]:
            log.info("reshard: %s", line)
        self.lines = lines


class ReshardSteps:
    """The steps of ``--reshard``, one coordinator at a time: step k moves the job from the first M(k-1) shards
    to the first M(k), started once step k-1's coordinator exited 0.  After a drain's coordinator exited 0 (its
    last line: the drained shards may be stopped), those shards are SIGTERMed and taken off ``watched`` (the
    shards ``follow`` stops the run for if they exit); their exit codes are read like every shard's."""

    def __init__(self, steps: list[tuple[int, int]], first: int, shards: list[Proc], watched: list[Proc],
                 run: Path):
        self.steps, self.shards, self.watched, self.run = steps, shards, watched, run
        self.counts = [first] + [m for m, _ in steps]  # the shard count before each step, then after the last
        self.done: list[ReshardScenario] = []
        self.current: ReshardScenario | None = None

    @property
    def procs(self) -> list[Proc]:
        """Every coordinator started so far."""
        return [s.proc for s in self.done + [self.current] if s is not None and s.proc is not None]

    def poll(self) -> None:
        """Starts the next step when none runs; ends one that exited 0 (stopping what it drained)."""
        if self.current is None:
            k = len(self.done)
            if k == len(self.steps):
                return
            names = [s.address for s in self.shards]
            self.current = ReshardScenario(self.steps[k][1], names[:self.counts[k]], names[:self.counts[k + 1]],
                                           self.run, "reshard.log" if k == 0 else f"reshard{k + 1}.log")
        self.current.poll()
        if self.current.proc.popen.poll() == 0:
            self.current.say_new(final=True)
            self.stop_drained(len(self.done))
            self.done.append(self.current)
            self.current = None

    def stop_drained(self, k: int) -> None:
        """SIGTERM the shards step k drained (none if it grew the job); each must exit 0."""
        for p in self.shards[self.counts[k + 1]:self.counts[k]]:
            if p in self.watched:
                self.watched.remove(p)
            code = p.terminate(30.0)
            log.info("%s drained and stopped (exit code %s)", p.name, code)

    def finish(self) -> list[tuple[int | None, list[str]]]:
        """Every step's coordinator exit code (None: never started) and lines; a running one is stopped."""
        if self.current is not None:
            self.done.append(self.current)
            self.current = None
        return [s.finish() for s in self.done] + [(None, [])] * (len(self.steps) - len(self.done))


def handoff(lines: list[str], records: list[dict], at: int, lo: int | None = None, hi: int | None = None) -> dict:
    """The summary's hand-off: layout, committed round R, seconds, and rank 0's rounds/s before R (from ``lo``,
    the step before's R) and after R (up to ``hi``, the step after's R), from its step records' ``versions``
    and ``time``."""
    R = committed_round(lines)
    done = re.search(r"done: layout (\d+), (\d+) bytes moved, hand-off ([\d.]+) s", "\n".join(lines))
    ends = {r["versions"][0]: r["time"] for r in records if r.get("event") == "step" and r.get("versions")}
    return dict(requested_round=at, round=R, layout=int(done.group(1)) if done else None,
                bytes_moved=int(done.group(2)) if done else None,
                handoff_seconds=float(done.group(3)) if done else None,
                steps_per_sec_before=rate(ends, lo, R) if R else None,
                steps_per_sec_after=rate(ends, R, hi) if R else None)


def handoffs(results: list[tuple[int | None, list[str]]], records: list[dict], steps: list[tuple[int, int]],
             first: int) -> list[dict]:
    """One hand-off per step (``ReshardSteps.finish``'s results), each with its shard counts; the rates of
    step k are measured between the committed rounds of steps k-1 and k+1 (a step's own rates, not the run's)."""
    Rs = [None] + [committed_round(lines) for _, lines in results] + [None]
    counts = [first] + [m for m, _ in steps]
    return [handoff(lines, records, at, Rs[k], Rs[k + 2]) | dict(shards_before=counts[k], shards_after=counts[k + 1])
            for k, ((_, lines), (_, at)) in enumerate(zip(results, steps))]


def committed_round(lines: list[str]) -> int | None:
    """The round R a coordinator's lines say the new layout takes over at (None: not committed)."""
    m = re.search(r"takes over at round (\d+)", "\n".join(lines))
    return int(m.group(1)) if m else None


def as_steps(reshard: dict | list) -> list[dict]:
    """A summary.json's ``reshard`` as a list of steps, whichever shape it was written in (before the steps, a
    single dict)."""
    return [reshard] if isinstance(reshard, dict) else list(reshard)


def rate(ends: dict[int, float], lo: int | None, hi: int | None) -> float | None:
    """Rounds per second over the recorded versions in [lo, hi] (None: no span to measure)."""
    vs = sorted(v for v in ends if (lo is None or v >= lo) and (hi is None or v <= hi))
    if len(vs) < 2 or ends[vs[-1]] <= ends[vs[0]]:
        return None
    return (vs[-1] - vs[0]) / (ends[vs[-1]] - ends[vs[0]])


def summary_rows(h: dict) -> list[tuple[str, str]]:
    """print_summary's lines for the hand-off."""
    def fmt(x):
        return "n/a" if x is None else f"{x:.1f}"
    secs = "n/a" if h["handoff_seconds"] is None else f"{h['handoff_seconds']:.2f} s"
    return [("re-shard", f"layout {h['layout']} from round {h['round']} (asked at {h['requested_round']}), "
                         f"hand-off {secs}"),
            ("steps/s before / after", f"{fmt(h['steps_per_sec_before'])} / {fmt(h['steps_per_sec_after'])}")]


def steps_rows(hs: list[dict]) -> list[tuple[str, str]]:
    """print_summary's lines for every step (one step: the rows as before the steps)."""
    if len(hs) == 1:
        return summary_rows(hs[0]) + table_rows(hs[0])
    rows = []
    for i, h in enumerate(hs, 1):
        (_, move), (_, rates) = summary_rows(h)
        rows += [(f"re-shard {i} ({h['shards_before']} -> {h['shards_after']})", move),
                 (f"steps/s before / after {i}", rates)]
    return rows + table_rows(hs[-1])


def table_rows(h: dict) -> list[tuple[str, str]]:
    """The tables' line of the summary (none without tables): each table's version and live rows, shard by shard."""
    versions, rows = h.get("shard_table_versions"), h.get("shard_table_rows")
    if not versions:
        return []
    names = sorted({n for v in versions for n in v})
    return [("tables: version (rows)", "; ".join(
        f"{n} " + " / ".join(f"{v.get(n, '-')} ({r.get(n, '-')})" for v, r in zip(versions, rows)) for n in names))]


def with_shards(h: dict, stats: list) -> dict:
    """The hand-off with each shard's version and its newest layout's rounds and pushes applied (GetStats): after
    the switch every shard counts the rounds from R on, each once.  A job with tables adds each shard's table
    versions and live rows (``table.<name>.version`` / ``.live_rows`` counters): a sync table is at the job's
    version on every shard, its rows spread over the new shards."""
    got = [s for s in stats if s is not None]
    out = dict(h, shard_versions=[int(s.version) for s in got],
               shard_rounds=[int(s.counters.get("steps", 0)) for s in got],
               shard_pushes_applied=[int(s.counters.get("pushes_applied", 0)) for s in got])
    tables = [table_counts(s.counters) for s in got]
    if any(tables):
        out.update(shard_table_versions=[{n: v for n, (v, _) in t.items()} for t in tables],
                   shard_table_rows=[{n: r for n, (_, r) in t.items()} for t in tables])
    return out


def table_counts(counters) -> dict[str, tuple[int, int]]:
    """table name -> (version, live rows), from a shard's ``table.<name>.<counter>`` counters."""
    names = {k[len("table."):-len(".version")] for k in counters if k.startswith("table.") and k.endswith(".version")}
    return {n: (int(counters[f"table.{n}.version"]), int(counters.get(f"table.{n}.live_rows", 0)))
            for n in sorted(names)}


def last_with_shards(hs: list[dict], stats: list) -> list[dict]:
    """The steps, the last one with the shards' figures (``with_shards``: the layout the job ended in)."""
    return hs[:-1] + [with_shards(hs[-1], stats)]
