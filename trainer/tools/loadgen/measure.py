"""One measurement: a fresh job on the shard under test, its phases, and its row."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rules import Mode
from trainer.tools.loadgen.board import Board
from trainer.tools.loadgen.config import NO_STOP, JobWire, LoadConfig, make_job
from trainer.tools.loadgen.fleet import Fleet
from trainer.tools.loadgen.prober import Prober
from trainer.tools.loadgen.summary import (
    cpu_rate,
    health_stats,
    merge_results,
    shard_stats,
    slowest_probes,
    sync_window,
    window_summary,
)
from trainer.tools.procstat import free_port, sample

log = logging.getLogger("ps-loadgen")


class ShardUnderTest:
    """The shard under test: started here (fresh per measurement) or given with --ps.

    ``health_port``: start it with ``--health-port`` on a free loopback port; ``health_address`` (--ps only):
    where the external shard answers Health from its own thread.  Either way ``health_address`` is what the
    second prober probes, or "" for none.
    """

    def __init__(self, address: str | None, log_dir: Path, server_args: list[str], label: str,
                 health_port: bool = False, health_address: str = ""):
        self.proc = None
        self.health_address = health_address if address else ""
        if address:
            self.address = address
        else:
            from trainer.local.procs import start_shard

            # PS_HEALTH_PORT is also ps-server's own variable (an int there): never let loadgen's leak into it.
            env = {"PS_HEALTH_PORT": "-1"} if "PS_HEALTH_PORT" in os.environ else None
            for attempt in range(3):
                port = free_port() if health_port else None
                extra = server_args + (["--health-port", str(port)] if port else [])
                try:
                    self.proc = start_shard(0, log_dir / f"shard-{label}.log", extra_args=extra, env=env)
                    break
                except RuntimeError as e:  # someone took the port between our probe and the shard's bind?
                    if not port or "--health-port" not in str(e) or attempt == 2:
                        raise
                    log.warning("health port %d was taken before the shard bound it; trying another", port)
            self.address = self.proc.address
            if port:
                self.health_address = f"127.0.0.1:{port}"
        self.pid = self.proc.popen.pid if self.proc else None
        self.start_sample = sample(self.pid)

    def alive(self) -> bool:
        return self.proc is None or self.proc.alive()

    def stop(self) -> int | None:
        return self.proc.terminate() if self.proc else None


@dataclass
class Session:
    """What one run of a fleet left behind: whether its phases all finished, where it stopped, its data."""

    ok: bool = False
    phase: str = "setup"
    results: list = dataclasses.field(default_factory=list)
    stranger: dict | None = None
    probes: list = dataclasses.field(default_factory=list)
    port_probes: list | None = None  # the --health-port prober's, or None when that port is not probed
    fleet: "Fleet | None" = None


def run_session(ctx, cfg: LoadConfig, job: JobWire, shard: ShardUnderTest, prober: Prober, phases, deadline: float,
                 stall: tuple[int, int] | None = None, port_prober: Prober | None = None) -> Session:
    """Run ``phases(fleet, session) -> bool`` on a fresh fleet, probing the shard from the moment every client
    process is up (their start-up is not the shard's doing); whatever happens, the client processes are stopped
    (at once unless every phase finished) and their results and the probes collected.  ``port_prober`` probes
    the shard's health port (``shard.health_address``), if it has one, over the same span."""
    s = Session(phase="starting client processes")
    port_prober = port_prober if shard.health_address else None
    if port_prober is not None:
        s.port_probes = []
    try:
        s.fleet = Fleet(ctx, cfg, job, stall, broken=lambda: not shard.alive())
        if s.fleet.wait(lambda: s.fleet.board.up(stall is not None), deadline):
            prober.start(shard.address)
            if port_prober is not None:
                port_prober.start(shard.health_address)
            s.fleet.cells[Board.GO] = 1
            s.phase = "setup"
            s.ok = phases(s.fleet, s)
    finally:
        try:
            if s.fleet is not None:
                if not s.ok:  # the deadline, a dead process, or an exception here: the trainers stop where they are
                    s.fleet.cells[Board.ABORT] = 1
                s.results, s.stranger = s.fleet.finish()
        finally:
            if s.fleet is not None:
                s.fleet.kill()
            s.probes = prober.stop()
            if port_prober is not None:
                s.port_probes = port_prober.stop()
    return s


def session_status(s: Session, shard: ShardUnderTest, crashes: list, deadline: float) -> str:
    if s.ok:
        return "ok"
    if s.fleet.why == "shard" or not shard.alive():
        return f"shard exited during {s.phase}"
    if s.fleet.why == "client" or crashes:
        return f"client failed during {s.phase}"
    return f"deadline ({deadline:.0f} s) during {s.phase}"


def measure(ctx, cfg: LoadConfig, shard: ShardUnderTest, prober: Prober, n: int, port_prober: Prober | None = None) -> dict:
    """One row: N trainers on a fresh job, warm-up, a measured window, bounded by ``cfg.deadline``."""
    job = make_job(cfg, shard.address, n)
    t_begin = time.monotonic()
    deadline = t_begin + cfg.deadline
    v_start = cfg.warmup if cfg.sync_like else cfg.warmup * n
    marks, samples = {}, {}

    def phases(fleet: Fleet, s: Session) -> bool:
        cells, board = fleet.cells, fleet.board
        pids = [shard.pid] + fleet.worker_pids()
        marks["go"] = time.monotonic()
        try:
            if not fleet.wait(lambda: board.total(Board.READY) == n and cells[Board.INIT_DONE], deadline):
                return False
            marks["setup"], s.phase = time.monotonic(), "warm-up"
            if not fleet.wait(lambda: board.max_version() >= v_start, deadline):
                return False
            samples["start"] = [sample(p) for p in pids]
            marks["start"], s.phase = time.monotonic(), "measure"
            stop_time = marks["start"] + cfg.seconds if cfg.seconds > 0 else math.inf
            if not fleet.wait(lambda: time.monotonic() >= stop_time
                              or (cfg.rounds and board.max_version() >= v_start + cfg.rounds), deadline):
                return False
            cells[Board.STOP_REQ] = 1
            marks["stop"], s.phase = time.monotonic(), "drain"
            return fleet.wait(lambda: board.total(Board.DONE) == n, deadline)
        finally:
            samples["end"] = [sample(p) for p in pids]
            marks["end"] = time.monotonic()

    s = run_session(ctx, cfg, job, shard, prober, phases, deadline, port_prober=port_prober)
    marks.setdefault("end", time.monotonic())  # (the phases never ran if the client processes never came up)
    records, errors, examples, leave_errors, crashes = merge_results(s.results)
    status = session_status(s, shard, crashes, cfg.deadline)
    cells = s.fleet.cells
    stop_at = int(cells[Board.STOP_AT]) if cells[Board.STOP_AT] < NO_STOP else None
    if s.ok and cfg.sync_like and stop_at is not None:
        window = sync_window(records, v_start, stop_at)
        w0, w1 = window.pop("t0"), window.pop("t1")
    else:
        w0 = marks.get("start", marks.get("setup", t_begin))
        w1 = marks.get("stop", marks["end"])
        window = window_summary(records, w0, w1)
    full = window["pushes"] == n * window["rounds"] and set(window["outcomes"]) <= {"applied", "accepted"}
    if s.ok and cfg.mode == Mode.SYNC and not full:
        status = "rounds closed without everyone"
    start, end = samples.get("start"), samples.get("end") or [None]
    port = {} if s.port_probes is None else dict(  # measured only with --health-port / --health-address
        health_port=health_stats(s.port_probes), health_port_window=health_stats(s.port_probes, w0, w1))
    return dict(
        mode=cfg.mode, trainers=n, status=status, **{k: window[k] for k in ("rounds", "pushes", "seconds")},
        pushes_per_s=window["pushes_per_s"], rounds_per_s=window["rounds_per_s"],
        full_rounds=full if cfg.mode == Mode.SYNC else None, outcomes=window["outcomes"],
        rounds_total=max((r.version for r in records), default=0), step=window["step"],
        health=health_stats(s.probes), health_window=health_stats(s.probes, w0, w1), **port,
        health_slowest=slowest_probes(s.probes, marks),
        shard=dict(pid=shard.pid, cpu_per_s=rounded(cpu_rate(start[:1], end[:1])) if start else None,
                   rss_start_mb=mb(shard.start_sample, "VmRSS"), rss_end_mb=mb(end[0], "VmRSS"),
                   peak_rss_mb=mb(end[0], "VmHWM")),
        client=dict(procs=len(s.fleet.ranks), cpu_per_s=rounded(cpu_rate(start[1:], end[1:])) if start else None),
        errors=dict(Counter(e.code for e in errors)), error_examples=examples, leave_errors=leave_errors,
        crashes=crashes, setup_s=round(marks.get("setup", marks["end"]) - t_begin, 3),
        shard_stats=shard_stats(shard.address, cfg.token) if shard.alive() else dict(error="the shard exited"),
    )


def measure_stall(ctx, cfg: LoadConfig, shard: ShardUnderTest, prober: Prober, trainers: int, streams: int,
                  connections: int, port_prober: Prober | None = None) -> dict:
    """A sync job unloaded, then while a stranger holds ``streams`` silent Push streams open, then after."""
    cfg = dataclasses.replace(cfg, mode="sync", rounds=0)
    job = make_job(cfg, shard.address, trainers)
    seconds = cfg.seconds if cfg.seconds > 0 else 5.0
    deadline = time.monotonic() + cfg.deadline + 3 * seconds
    windows = {}

    def phases(fleet: Fleet, s: Session) -> bool:
        cells, board = fleet.cells, fleet.board
        if not fleet.wait(lambda: board.total(Board.READY) == trainers and cells[Board.INIT_DONE], deadline):
            return False
        s.phase = "warm-up"
        if not fleet.wait(lambda: board.max_version() >= cfg.warmup, deadline):
            return False
        for name in ("unloaded", "stalled", "released"):
            if name == "stalled":
                cells[Board.STALL_OPEN] = 1
                s.phase = "opening the stalled streams"
                if not fleet.wait(lambda: cells[Board.STALL_OPENED] > 0 or cells[Board.STALL_DONE], deadline):
                    return False
            elif name == "released":
                cells[Board.STALL_RELEASE] = 1
                s.phase = "releasing the stalled streams"
                if not fleet.wait(lambda: cells[Board.STALL_DONE] > 0, deadline):
                    return False
            s.phase, t0 = name, time.monotonic()
            done = fleet.wait(lambda: time.monotonic() >= t0 + seconds, deadline)
            windows[name] = (t0, time.monotonic())
            if not done:
                return False
        cells[Board.STOP_REQ] = 1
        s.phase = "drain"
        return fleet.wait(lambda: board.total(Board.DONE) == trainers, deadline)

    s = run_session(ctx, cfg, job, shard, prober, phases, deadline, stall=(streams, connections),
                     port_prober=port_prober)
    records, errors, examples, leave_errors, crashes = merge_results(s.results)
    counted = (_pb.APPLIED, _pb.ACCEPTED)
    per_round = Counter(r.version for r in records if r.outcome in counted)  # round v -> gradients it closed with
    rows = []
    for name, (t0, t1) in windows.items():
        w = window_summary(records, t0, t1)
        reached = {r.version for r in records if t0 <= r.t1 <= t1 and r.outcome in counted}
        rows.append(dict(phase=name, seconds=w["seconds"], rounds=w["rounds"], steps=w["pushes"], step=w["step"],
                         partial_rounds=sum(per_round[v] < trainers for v in reached), outcomes=w["outcomes"],
                         health=health_stats(s.probes, t0, t1),
                         **({} if s.port_probes is None else dict(health_port=health_stats(s.port_probes, t0, t1))),
                         errors=dict(Counter(e.code for e in errors if t0 <= e.at <= t1))))
    by = {r["phase"]: r for r in rows}
    ratio = {}
    if "unloaded" in by and "stalled" in by:
        for q in ("p50_ms", "p99_ms"):
            a, b = by["unloaded"]["step"][q], by["stalled"]["step"][q]
            ratio[q] = round(b / a, 3) if a and b is not None else None
    return dict(streams=streams, connections=connections, trainers=trainers,
                status=session_status(s, shard, crashes, cfg.deadline + 3 * seconds),
                phases=rows, step_ratio=ratio, stranger=s.stranger, errors=dict(Counter(c for _, c in errors)),
                error_examples=examples, leave_errors=leave_errors, crashes=crashes,
                shard_stats=shard_stats(shard.address, cfg.token) if shard.alive() else dict(error="the shard exited"))


def mb(sample: dict | None, key: str) -> float | None:
    return round(sample[key] / 2 ** 20, 2) if sample and key in sample else None


def rounded(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def add_rss_growth(rows: list[dict]) -> None:
    """RSS growth per extra trainer against the smallest-N row (N=1 in a default run)."""
    base = min((r for r in rows if r["shard"]["rss_end_mb"] is not None), key=lambda r: r["trainers"], default=None)
    for r in rows:
        grow = None
        if base is not None and r["shard"]["rss_end_mb"] is not None and r["trainers"] > base["trainers"]:
            grow = round((r["shard"]["rss_end_mb"] - base["shard"]["rss_end_mb"]) * 1024
                         / (r["trainers"] - base["trainers"]), 1)
        r["shard"]["rss_growth_kb_per_trainer"] = grow
