"""``ps-cluster --standbys 1 [--kill-primary SHARD@ROUND ...]``: every shard as a primary and a hot standby
(docs/standby.md), an etcd to decide between them, and primaries killed with SIGKILL when their version reaches
ROUND.  The summary's ``failovers`` says, for each kill, how long the shard took to go on (from the kill to the
first round its new primary closed) and how many of its versions were rolled back (0: nothing acknowledged lost).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from psserver.protocol.stubs import fetch_stat
from trainer.procs import Proc, await_ready, free_port, launch_shard, start_etcd

log = logging.getLogger("trainer.cluster")


def parse_kills(text: str, shards: int) -> list[tuple[int, int]]:
    """'0@20,1@50' -> [(0, 20), (1, 50)]: SIGKILL shard 0's primary at version 20, then shard 1's at 50."""
    kills = []
    for item in [t.strip() for t in text.split(",") if t.strip()]:
        shard, _, at = item.partition("@")
        if not shard.isdigit() or not at.isdigit() or int(at) < 1:
            raise ValueError(f"--kill-primary {item!r}: give SHARD@ROUND, e.g. 0@20 (ROUND 1 or more)")
        if int(shard) >= shards:
            raise ValueError(f"--kill-primary {item!r}: the job has shards 0..{shards - 1}")
        kills.append((int(shard), int(at)))
    if len({s for s, _ in kills}) != len(kills):
        raise ValueError(f"--kill-primary {text!r}: one kill a shard (its standby has no standby of its own)")
    return kills


def check(args) -> list[tuple[int, int]]:
    if args.standbys not in (0, 1):
        raise ValueError(f"--standbys is {args.standbys}: 0 or 1 standby a shard")
    if args.kill_primary and not args.standbys:
        raise ValueError("--kill-primary needs --standbys 1: without a standby, a killed shard is lost")
    if args.standbys and (args.reshard or args.elastic or args.elastic_schedule):
        raise ValueError("--standbys does not go with --reshard, --elastic or --elastic-schedule yet")
    return parse_kills(args.kill_primary, args.shards) if args.kill_primary else []


@dataclass
class Failover:
    shard: int
    round: int  # the version at which its primary was killed
    acknowledged: int = 0  # the newest version of it any trainer had been answered with by then
    killed_at: float = 0.0
    seconds: float | None = None  # from the kill to the first round the new primary closed
    steps_lost: int | None = None  # acknowledged versions its standby did not hold (0: nothing lost)


@dataclass
class StandbyCluster:
    """The shards' replicas and their etcd; ``poll`` kills the primaries that are due."""

    run: Path
    shards: int
    kills: list[tuple[int, int]]
    host: str = "127.0.0.1"
    lease_seconds: int = 1
    etcd: Proc | None = None
    primaries: list[Proc] = field(default_factory=list)
    standbys: list[Proc] = field(default_factory=list)
    failovers: list[Failover] = field(default_factory=list)

    def start(self, job: str, on_up=lambda proc: None) -> str:
        """etcd, then every shard's primary, then its standby, once every standby is in sync; returns --ps."""
        self.etcd = start_etcd(self.run / "etcd-data", self.run / "etcd.log", self.host)
        log.info("etcd up at %s (the standbys' arbiter)", self.etcd.address)

        def replicas(name: str) -> list[Proc]:
            procs = [launch_shard(i, self.run / f"shard{i}-{name}.log", self.host, free_port(self.host), [
                "--etcd", self.etcd.address, "--job-name", job, "--replica", name,
                "--lease-seconds", str(self.lease_seconds)]) for i in range(self.shards)]
            for i, p in enumerate(procs):
                p.name = f"shard{i}-{name}"
            await_ready(procs, 120, on_up)
            return procs

        self.primaries = replicas("a")
        self.standbys = replicas("b")
        deadline = time.monotonic() + 60
        for p in self.primaries:
            while "caught up" not in p.log_path.read_text(errors="replace"):
                if time.monotonic() > deadline or not p.alive():
                    raise RuntimeError(f"{p.name}'s standby did not catch up; its log says:\n{p.log_tail()}")
                time.sleep(0.1)  # polling a log for readiness, not synchronising
        return ",".join(f"{a.address}|{b.address}" for a, b in zip(self.primaries, self.standbys))

    @property
    def processes(self) -> list[Proc]:
        return self.primaries + self.standbys

    def watched(self) -> list[Proc]:
        """The replicas whose death stops the run: every standby, and the primaries not due to be killed."""
        doomed = {s for s, _ in self.kills}
        return self.standbys + [p for i, p in enumerate(self.primaries) if i not in doomed]

    def poll(self) -> None:
        for shard, at in list(self.kills):
            stats = _stats(self.primaries[shard].address)
            if stats is not None and stats.version >= at:
                self.primaries[shard].kill()
                self.kills.remove((shard, at))
                self.failovers.append(Failover(shard, int(stats.version), self._acknowledged(shard), time.monotonic()))
                log.warning("killed shard %d's primary (SIGKILL) at version %d", shard, stats.version)
        for f in self.failovers:
            if f.seconds is None:
                stats = _stats(self.standbys[f.shard].address)
                if stats is not None and stats.version > f.round:
                    f.seconds = time.monotonic() - f.killed_at
                    f.steps_lost = max(0, f.acknowledged - int(stats.counters.get("restored_version", 0)))
                    log.warning("shard %d went on on its standby %.2f s after the kill (%d versions lost)",
                                f.shard, f.seconds, f.steps_lost)

    def _acknowledged(self, shard: int) -> int:
        """The newest version of ``shard`` the trainers' metrics say they were answered with (their step lines)."""
        newest = 0
        for path in self.run.glob("trainer*.jsonl"):
            for line in reversed(path.read_text(errors="replace").splitlines()[-50:]):
                if '"versions"' in line:
                    try:
                        newest = max(newest, int(json.loads(line)["versions"][shard]))
                    except (ValueError, KeyError, IndexError):
                        continue
                    break
        return newest

    def summary(self) -> list[dict]:
        return [dict(shard=f.shard, round=f.round, seconds=None if f.seconds is None else round(f.seconds, 3),
                     steps_lost=f.steps_lost) for f in self.failovers]

    def stop_etcd(self) -> None:
        if self.etcd is not None:
            self.etcd.terminate()


def _stats(address: str):
    try:
        return fetch_stat(address, timeout=2)
    except Exception:  # noqa: BLE001 -- a replica not serving (a standby, a killed primary) has no stats
        return None
