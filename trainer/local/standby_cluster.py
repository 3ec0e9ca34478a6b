"""``ps-cluster --standbys 1 [--kill-primary SHARD@ROUND ...]``: every shard as a primary and a hot standby
(docs/standby.md), an etcd to decide between them, and primaries killed with SIGKILL when their version reaches
ROUND.  The summary's ``failovers`` says, for each kill, how long the shard took to go on (from the kill to the
first round its new primary closed) and how many of its versions were rolled back (0: nothing acknowledged lost).
The killed replica is started again and rejoins as the standby, so a shard may be killed more than once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from psserver.common.cli_support import FENCED_EXIT
from psserver.protocol.admin_token import ADMIN_TOKEN_ENV, new_token
from psserver.protocol.stubs import fetch_stat
from trainer.local.procs import Proc, await_ready, free_port, launch_shard, start_etcd

log = logging.getLogger("trainer.local.cluster")


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
    for shard in {s for s, _ in kills}:
        rounds = [at for s, at in kills if s == shard]
        if rounds != sorted(set(rounds)):
            raise ValueError(f"--kill-primary {text!r}: shard {shard}'s rounds must increase (each kill waits for "
                             f"the replica restarted after the one before to catch up)")
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
    fenced: bool = False  # not killed: the primary's lease lapsed (a loaded host), its standby took over


@dataclass
class StandbyCluster:
    """The shards' replicas and their etcd.  ``poll`` kills the primaries that are due and, once the standby went
    on, starts the killed replica again: it rejoins as the standby and catches up (re-protection), so a later
    kill of the same shard fails over again."""

    run: Path
    shards: int
    kills: list[tuple[int, int]]
    host: str = "127.0.0.1"
    lease_seconds: int = 1
    job: str = ""
    etcd: Proc | None = None
    pairs: list[list[Proc]] = field(default_factory=list)  # per shard: [primary, standby] now
    processes: list[Proc] = field(default_factory=list)  # (ps-cluster's shard list: every replica started, killed too)
    watched: list[Proc] = field(default_factory=list)  # (ps-cluster's list: the replicas whose death stops the run)
    failovers: list[Failover] = field(default_factory=list)
    fenced: set = field(default_factory=set)  # the replicas that exited fenced (FENCED_EXIT): restarted, no failure
    _synced_from: dict = field(default_factory=dict)  # shard -> where its primary's log begins as primary
    # the operator's admin token every replica shares (the caller's $PS_ADMIN_TOKEN, else one for this run)
    admin_token: str = field(default_factory=lambda: os.environ.get(ADMIN_TOKEN_ENV) or new_token())

    def start(self, job: str, processes: list[Proc], watched: list[Proc], on_up=lambda proc: None) -> str:
        """etcd, then every shard's primary, then its standby, once every standby is in sync; returns --ps.
        Every replica started, now and later, goes into ``processes`` (ps-cluster stops them at the end)."""
        self.job, self.processes, self.watched = job, processes, watched
        self.etcd = start_etcd(self.run / "etcd-data", self.run / "etcd.log", self.host)
        log.info("etcd up at %s (the standbys' arbiter)", self.etcd.address)
        ports = [(free_port(self.host), free_port(self.host)) for _ in range(self.shards)]
        primaries = [self._launch(i, "a", ports[i][0]) for i in range(self.shards)]
        await_ready(primaries, 120, on_up)
        standbys = [self._launch(i, "b", ports[i][1]) for i in range(self.shards)]
        await_ready(standbys, 120, on_up)
        self.pairs = [[a, b] for a, b in zip(primaries, standbys)]
        for i in range(self.shards):
            self._synced_from[i] = 0
            self._wait_synced(i, 60)
        self._rewatch()
        return ",".join(f"{a.address}|{b.address}" for a, b in self.pairs)

    def _launch(self, shard: int, replica: str, port: int) -> Proc:
        proc = launch_shard(shard, self.run / f"shard{shard}-{replica}.log", self.host, port, [
            "--etcd", self.etcd.address, "--job-name", self.job, "--replica", replica,
            "--lease-seconds", str(self.lease_seconds)], env={ADMIN_TOKEN_ENV: self.admin_token})
        name = f"shard{shard}-{replica}"
        started = sum(p.name.split(".")[0] == name for p in self.processes)
        proc.name = f"{name}.{started + 1}" if started else name  # a restart of a killed replica: shard0-a.2
        proc.address = f"{self.host}:{port}"
        self.processes.append(proc)
        return proc

    def _synced(self, shard: int) -> bool:
        primary = self.pairs[shard][0]
        return "caught up" in primary.log_path.read_text(errors="replace")[self._synced_from[shard]:]

    def _wait_synced(self, shard: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._synced(shard):
            primary = self.pairs[shard][0]
            if time.monotonic() > deadline or not primary.alive():
                raise RuntimeError(f"{primary.name}'s standby did not catch up; its log says:\n{primary.log_tail()}")
            time.sleep(0.1)  # polling a log for readiness, not synchronising

    def _rewatch(self) -> None:
        """Every replica alive now but a primary due to be killed (its death is planned) or fenced (restarted)."""
        doomed = {s for s, _ in self.kills}
        self.watched[:] = [p for i, pair in enumerate(self.pairs) for k, p in enumerate(pair)
                           if not (k == 0 and i in doomed) and p.name not in self.fenced]

    def poll(self) -> None:
        self._take_fenced()
        for shard, at in list(self.kills):
            if self.kills.index((shard, at)) != next(k for k, (s, _) in enumerate(self.kills) if s == shard):
                continue  # a later kill of the same shard waits for the earlier one
            pending = any(f.shard == shard and f.seconds is None for f in self.failovers)
            stats = None if pending or not self._synced(shard) else _stats(self.pairs[shard][0].address)
            if stats is not None and stats.version >= at:
                self.pairs[shard][0].kill()
                self.kills.remove((shard, at))
                self.failovers.append(Failover(shard, int(stats.version), self._acknowledged(shard), time.monotonic()))
                log.warning("killed shard %d's primary %s (SIGKILL) at version %d", shard, self.pairs[shard][0].name,
                            stats.version)
        for f in self.failovers:
            if f.seconds is not None:
                continue
            standby = self.pairs[f.shard][1]
            stats = _stats(standby.address)
            if stats is None or stats.version <= f.round:
                continue
            f.seconds = time.monotonic() - f.killed_at
            f.steps_lost = max(0, f.acknowledged - int(stats.counters.get("restored_version", 0)))
            log.warning("shard %d went on on its standby %.2f s after the %s (%d versions lost); restarting the "
                        "%s replica as its standby", f.shard, f.seconds, "fence" if f.fenced else "kill", f.steps_lost,
                        "fenced" if f.fenced else "killed")
            dead = self.pairs[f.shard][0]
            self._synced_from[f.shard] = len(standby.log_path.read_text(errors="replace"))
            replica = dead.name.split("-")[1].split(".")[0]
            self.pairs[f.shard] = [standby, self._launch(f.shard, replica, int(dead.address.rpartition(":")[2]))]
            self._rewatch()

    def _take_fenced(self) -> None:
        """A primary that exited fenced -- its etcd lease lapsed while the host was too loaded to renew it, so its
        standby took over (docs/standby.md, ``--lease-seconds``) -- is a failover like a kill: once the standby
        went on, the fenced replica is started again as its standby.  Nothing acknowledged is lost either way."""
        for shard, pair in enumerate(self.pairs):
            primary = pair[0]
            if primary.name in self.fenced or primary.popen.poll() != FENCED_EXIT:
                continue
            self.fenced.add(primary.name)
            self._rewatch()
            acknowledged = self._acknowledged(shard)
            self.failovers.append(Failover(shard, acknowledged, acknowledged, time.monotonic(), fenced=True))
            log.warning("shard %d's primary %s was fenced: its etcd lease lapsed (a loaded host; --lease-seconds "
                        "%d) and its standby took over", shard, primary.name, self.lease_seconds)

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

    def killed(self) -> set[str]:
        """The replicas whose exit is no failure: those killed on purpose, those fenced (restarted as standbys),
        and restarted standbys the end of the run stopped before they could take the signal (still starting)."""
        current = [p for pair in self.pairs for p in pair]
        return {p.name for p in self.processes if (p.popen.returncode == -9 and p not in current)
                or (p.popen.returncode == -15 and "." in p.name)} | self.fenced

    def missed(self) -> list[str]:
        """The --kill-primary items the run ended before."""
        return [f"{s}@{at}" for s, at in self.kills]

    def summary(self) -> list[dict]:
        return [dict(shard=f.shard, round=f.round, seconds=None if f.seconds is None else round(f.seconds, 3),
                     steps_lost=f.steps_lost, **({"fenced": True} if f.fenced else {})) for f in self.failovers]

    def stop_etcd(self) -> None:
        if self.etcd is not None:
            self.etcd.terminate()


def _stats(address: str):
    try:
        return fetch_stat(address, timeout=2)
    except Exception:  # noqa: BLE001 -- a replica not serving (a standby, a killed primary) has no stats
        return None
