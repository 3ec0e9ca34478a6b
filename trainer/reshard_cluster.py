"""`ps-cluster --reshard M@ROUND`: a sync dense job grows from --shards to M shards while you watch
(docs/handoff-io.md).

The M - N extra shards are started empty with the others; the trainers get only the first N.  The coordinator
runs as a subprocess (``ps-server reshard --ps OLD --to NEW --at-round ROUND``: the trainer room may not import
the shard's code), started with the trainers so that its start-up (seconds) is spent before ROUND, not while the
unpaced job trains on; it prepares when shard 0's version reaches ROUND, and its lines are logged.  The shards pick the committed round R (at or
after ROUND); the summary gains R, the hand-off's seconds (PREPARE to the switch, the coordinator's own figure) and
rank 0's rounds per second before and after R.  The trainers are not paced: a source whose copy is outrun holds
its rounds until the forwards catch up (docs/handoff-io.md), so the rates are the job's own.
"""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

from trainer.procs import Proc, child_env, cli

log = logging.getLogger("ps-cluster")
DENSE_MODELS = ("cnn", "mlp", "widemlp", "resnet18")


def parse(text: str, shards: int) -> tuple[int, int]:
    """``M@ROUND`` -> (M, ROUND); one-line ValueError naming the value and a hint."""
    m = re.fullmatch(r"(\d+)@(\d+)", text.strip())
    if not m:
        raise ValueError(f"--reshard {text!r} is not M@ROUND; e.g. --shards 2 --reshard 3@20")
    to, at = int(m.group(1)), int(m.group(2))
    if to <= shards:
        raise ValueError(f"--reshard {to}@{at} must grow the job: {to} shards is not more than --shards {shards}; "
                         f"e.g. --reshard {shards + 1}@{at}")
    if at < 1:
        raise ValueError(f"--reshard {to}@{at}: ROUND must be 1 or more; e.g. --reshard {to}@20")
    return to, at


def check(args) -> tuple[int, int]:
    """--reshard's one-line refusals, before anything starts; returns (M, ROUND)."""
    to, at = parse(args.reshard, args.shards)
    if args.mode != "sync":
        raise ValueError(f"--reshard moves a sync job, not --mode {args.mode}; drop --mode")
    if args.model not in DENSE_MODELS or getattr(args, "embedding_dim", 0):
        raise ValueError(f"--reshard moves dense models only ({', '.join(DENSE_MODELS)}), not --model {args.model}; "
                         "e.g. --model mlp --dataset synthetic")
    if args.elastic:
        raise ValueError("--reshard and --elastic are separate scenarios; drop one")
    if args.steps <= at:
        raise ValueError(f"--reshard {to}@{at} needs --steps more than {at} (got {args.steps}): the switch must fall "
                         f"inside the run; e.g. --steps {at * 2}")
    return to, at


def trainer_flags(args, rank: int) -> list[str]:
    """What --reshard adds to a trainer's flags: a step record per step (for the rates).  No pace: the sources
    throttle their rounds if the copy is outrun (a --straggler-delay is ps-cluster's own, kept)."""
    return ["--log-every", "1"]


class ReshardScenario:
    """Runs ``ps-server reshard --at-round ROUND`` at the first ``poll`` (it waits for the round itself);
    ``finish`` reads its lines."""

    def __init__(self, at: int, old: list[str], new: list[str], run: Path):
        self.at, self.old, self.new, self.out = at, old, new, run / "reshard.log"
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
        self.proc = Proc("reshard", popen, self.out)

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


def handoff(lines: list[str], records: list[dict], at: int) -> dict:
    """The summary's hand-off: layout, committed round R, seconds, and rank 0's rounds/s before and after R
    (from its step records' ``versions`` and ``time``)."""
    text = "\n".join(lines)
    R = re.search(r"takes over at round (\d+)", text)
    done = re.search(r"done: layout (\d+), (\d+) bytes moved, hand-off ([\d.]+) s", text)
    R = int(R.group(1)) if R else None
    ends = {r["versions"][0]: r["time"] for r in records if r.get("event") == "step" and r.get("versions")}
    return dict(requested_round=at, round=R, layout=int(done.group(1)) if done else None,
                bytes_moved=int(done.group(2)) if done else None,
                handoff_seconds=float(done.group(3)) if done else None,
                steps_per_sec_before=rate(ends, None, R) if R else None,
                steps_per_sec_after=rate(ends, R, None) if R else None)


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


def with_shards(h: dict, stats: list) -> dict:
    """The hand-off with each shard's version and its newest layout's rounds and pushes applied (GetStats): after
    the switch every shard counts the rounds from R on, each once."""
    got = [s for s in stats if s is not None]
    return dict(h, shard_versions=[int(s.version) for s in got],
                shard_rounds=[int(s.counters.get("steps", 0)) for s in got],
                shard_pushes_applied=[int(s.counters.get("pushes_applied", 0)) for s in got])
