"""`ps-loadgen`: drive one real shard with N simulated trainers and measure how it scales.

ps-bench measures training; this measures serving: what one shard does when many
trainers wait on it at once.  Per N it records pushes/s, rounds/s, step latency,
health-check latency, the shard's CPU and RSS, and errors by status code.

* A simulated trainer is an asyncio coroutine on grpc.aio with its own channel
  and its own TCP connection (``grpc.use_local_subchannel_pool``: otherwise gRPC
  shares one connection among channels to one target), many per process
  (``--client-procs`` spreads them over processes).  It registers, rank 0 sends
  Init, then each loops PushPull (a tiny gradient; the model is P=1000 floats,
  so this measures serving, not bandwidth) and finally Leave.
* The health prober runs in a process of its own: on the client's busy event
  loop it would measure the client.  With ``--health-port`` each shard started
  here also answers Health on a free loopback port from a process of its own
  (ps-server ``--health-port``); a second prober, same interval, probes that port
  over the same windows, so both latencies are in every row.
* Every N has a hard deadline: a shard that stops serving yields a row saying so
  (rounds closed, errors by code), never a hang.
* ``ps-loadgen stall --streams K``: a stranger opens K Push streams that never
  send a byte; how much do health checks and a legitimate job suffer?

Processes share a small board of doubles (one writer per cell; see ``_Board``).
The orchestrator only reads it, polls it, and samples /proc around the window.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import platform
import random
import resource
import shlex
import signal
import sys
import time
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import numpy as np

from psserver.common.cli_support import EnvArgumentParser, run_cli, setup_logging
from psserver.common.logsafe import counted
from psserver.protocol.codec import DEFAULT_CHUNK_BYTES, encode_raw
from psserver.protocol.fastwire import parse_chunk, serialize_chunk
from psserver.protocol.job import MODES, JobSpec, OptimizerConfig
from psserver.protocol.layout import Layout
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rules import Mode
from psserver.protocol.security import read_token
from psserver.protocol.stubs import method
from trainer.tools.procstat import free_port, sample

log = logging.getLogger("ps-loadgen")

# One TCP connection per channel: a simulated trainer must cost the shard what a real one does.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20)]
DEFAULT_TRAINERS = "1,4,16,64,256,1024"
NO_STOP = float(2 ** 53)  # "no stop version yet" on the board (doubles hold integers exactly up to 2^53)


# ---------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class LoadConfig:
    """What one measurement needs; picklable, so worker processes get it whole."""

    mode: str = "sync"
    params: int = 1000  # P: a tiny model, so the numbers are about serving, not bandwidth
    seconds: float = 10.0  # measured window per N
    rounds: int = 0  # or stop after this many rounds (versions in async mode); 0: --seconds only
    warmup: int = 3  # rounds (sync modes) or pushes per trainer (async) before the window opens
    deadline: float = 120.0  # hard limit per N, setup and teardown included
    step_timeout: float = 30.0  # per PushPull; a shard stuck longer counts DEADLINE_EXCEEDED and is retried
    connect_timeout: float = 30.0
    sync_timeout: float = 0.5  # stale-timeout mode
    client_procs: int = 1
    health_interval: float = 0.02
    health_timeout: float = 5.0
    token: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"The mode ({self.mode!r}) must be one of {', '.join(MODES)}.")
        if self.params < 1:
            raise ValueError(f"The parameter count ({self.params}) must be at least 1.")
        if not (self.seconds > 0 or self.rounds > 0):
            raise ValueError(f"Give a window: --seconds ({self.seconds}) or --rounds ({self.rounds}) must be > 0.")
        if self.warmup < 1:
            raise ValueError(f"The warm-up ({self.warmup}) must be at least 1 round.")
        if self.client_procs < 1:
            raise ValueError(f"The client process count ({self.client_procs}) must be at least 1.")
        if not self.deadline > 0 or not self.step_timeout > 0:
            raise ValueError(f"--deadline ({self.deadline}) and --step-timeout ({self.step_timeout}) must be > 0.")

    @property
    def sync_like(self) -> bool:
        return self.mode != Mode.ASYNC


@dataclass(frozen=True)
class JobWire:
    """One job as the simulated trainers send it."""

    address: str
    job: bytes  # serialized JobSpec proto
    job_id: str
    fingerprint: str
    num_trainers: int


def make_job(cfg: LoadConfig, address: str, num_trainers: int) -> JobWire:
    """A one-tensor job; ``job_id`` is set on the spec if this JobSpec knows it, else on the proto."""
    tensors = (("w", (cfg.params,), "float32"),)
    fingerprint = Layout.from_shapes(tensors, 1).fingerprint()
    job_id = f"loadgen-{uuid.uuid4().hex[:12]}"
    kw = dict(mode=cfg.mode, num_trainers=num_trainers, num_shards=1, total_params=cfg.params,
              fingerprint=fingerprint, optimizer=OptimizerConfig("sgd", lr=0.01), tensors=tensors,
              sync_timeout=cfg.sync_timeout if cfg.mode == Mode.STALE_TIMEOUT else 0.0)
    if "job_id" in {f.name for f in dataclasses.fields(JobSpec)}:
        kw["job_id"] = job_id
    msg = JobSpec(**kw).to_proto()
    msg.job_id = job_id
    return JobWire(address, msg.SerializeToString(), job_id, fingerprint, num_trainers)


# ------------------------------------------------------------------------------------------------- board
class _Board:
    """Doubles shared by the orchestrator, the workers and the stranger.

    One writer per cell (a worker's own slot; STOP_AT is written under ``lock``),
    so plain loads and stores suffice: an aligned 8-byte store is atomic.
    """

    STOP_REQ, STOP_AT, ABORT, INIT_DONE, GO = range(5)
    STALL_OPEN, STALL_RELEASE, STALL_OPENED, STALL_DONE, STRANGER_UP = range(5, 10)
    SLOT0, SLOT_SIZE = 16, 5
    # Per worker: highest reply version seen, trainers registered, trainers finished, process up (imports done),
    # trainers that died of a bug (any: the job cannot go on, so the orchestrator stops at once).
    MAXV, READY, DONE, UP, CRASHED = range(5)

    def __init__(self, ctx, workers: int):
        self.cells = ctx.RawArray("d", self.SLOT0 + self.SLOT_SIZE * workers)
        self.cells[self.STOP_AT] = NO_STOP
        self.lock = ctx.Lock()
        self.workers = workers

    def total(self, field: int) -> float:
        return sum(self.cells[self.SLOT0 + i * self.SLOT_SIZE + field] for i in range(self.workers))

    def up(self, stranger: bool) -> bool:
        return self.total(self.UP) == self.workers and (not stranger or self.cells[self.STRANGER_UP] > 0)

    def max_version(self) -> int:
        return int(max(self.cells[self.SLOT0 + i * self.SLOT_SIZE + self.MAXV] for i in range(self.workers)))


# ------------------------------------------------------------------------------------- simulated trainers
class _SimTrainer:
    """One trainer: Register, (rank 0) Init, PushPull until told to stop, Leave."""

    def __init__(self, rank: int, job: JobWire, cfg: LoadConfig, cells, lock, slot: int):
        self.rank, self.job, self.cfg, self.cells, self.lock, self.slot = rank, job, cfg, cells, lock, slot
        self.trainer_id = f"{job.job_id}-r{rank}"
        self.channel = grpc.aio.insecure_channel(job.address, options=CHANNEL_OPTIONS)
        ch = self.channel
        self._register = ch.unary_unary(method("Register"), _pb.RegisterRequest.SerializeToString,
                                        _pb.RegisterReply.FromString)
        self._init = ch.stream_unary(method("Init"), serialize_chunk, _pb.InitReply.FromString)
        self._push_pull_one = ch.unary_stream(method("PushPull"), serialize_chunk, parse_chunk)
        self._push_pull = ch.stream_stream(method("PushPull"), serialize_chunk, parse_chunk)
        self._leave = ch.unary_unary(method("Leave"), _pb.LeaveRequest.SerializeToString, _pb.LeaveReply.FromString)
        self.metadata = (("authorization", f"Bearer {cfg.token}"),) if cfg.token else None
        rng = np.random.default_rng(cfg.seed * 1_000_003 + rank)
        self.grad = (rng.standard_normal(cfg.params, dtype=np.float32) * 1e-3).astype("<f4").tobytes()
        self.base = 0
        self.registered = False
        self.records: list[tuple] = []  # (base, t0, t1, reply version, outcome) per completed step
        self.errors: list[tuple] = []  # (time, status code) per failed call
        self.examples: dict[str, str] = {}  # status code -> first message seen
        self.leave_errors: Counter = Counter()

    def _header(self, **kw) -> _pb.ChunkHeader:
        return _pb.ChunkHeader(rank=self.rank, trainer_id=self.trainer_id, fingerprint=self.job.fingerprint,
                               dtype=_pb.FLOAT32, length=self.cfg.params, **kw)

    async def _retry(self, what: str, call):
        """Await ``call()`` until it succeeds; every failure is counted by code, then retried after a backoff."""
        delay = 0.05
        while True:
            try:
                return await call()
            except grpc.aio.AioRpcError as e:
                code = e.code().name
                self.errors.append((time.monotonic(), code))
                self.examples.setdefault(code, f"{what}: {e.details()}")
                if self.cells[_Board.ABORT]:
                    raise
                await asyncio.sleep(random.uniform(delay / 2, delay))  # backoff, not synchronisation
                delay = min(2 * delay, 1.0)

    async def run(self) -> None:
        try:
            await self._run()
        except Exception:  # a bug, not a refusal (those are retried): tell the orchestrator, which stops the run
            self.cells[self.slot + _Board.CRASHED] += 1
            raise

    async def _run(self) -> None:
        cells, cfg = self.cells, self.cfg
        req = _pb.RegisterRequest(rank=self.rank, trainer_id=self.trainer_id, expected_shard=0,
                                  job=_pb.JobSpec.FromString(self.job.job))
        reply = await self._retry("Register", lambda: self._register(
            req, timeout=cfg.connect_timeout, wait_for_ready=True, metadata=self.metadata))
        self.registered, self.base = True, reply.version
        cells[self.slot + _Board.READY] += 1
        if self.rank == 0:
            rng = np.random.default_rng(cfg.seed)
            values = (rng.standard_normal(cfg.params, dtype=np.float32) * 0.01).astype("<f4").tobytes()
            header = self._header()
            await self._retry("Init", lambda: self._init(iter(list(encode_raw(values, header, DEFAULT_CHUNK_BYTES))),
                                                         timeout=cfg.connect_timeout, metadata=self.metadata))
            cells[_Board.INIT_DONE] = 1
        while not cells[_Board.INIT_DONE]:  # rank 0 may live in another process
            await asyncio.sleep(0.01)
        await self._steps()
        cells[self.slot + _Board.DONE] += 1

    async def _steps(self) -> None:
        cells, slot = self.cells, self.slot
        sequence = 0
        while not cells[_Board.ABORT]:
            if cells[_Board.STOP_REQ]:
                if not self.cfg.sync_like:
                    return
                # Sync: this trainer holds the newest version (round `base` cannot close without its push), so
                # every trainer can still reach base + 1 and none is past it: stopping there leaves no round half full.
                if self.base + 1 < cells[_Board.STOP_AT]:
                    with self.lock:
                        if self.base + 1 < cells[_Board.STOP_AT]:
                            cells[_Board.STOP_AT] = self.base + 1
            if self.base >= cells[_Board.STOP_AT]:
                return
            sequence += 1
            chunks = list(encode_raw(self.grad, self._header(version=self.base, num_samples=1, sequence=sequence),
                                     DEFAULT_CHUNK_BYTES))
            t0 = time.monotonic()
            header = await self._retry("PushPull", lambda: self._push_pull_once(chunks))
            self.records.append((self.base, t0, time.monotonic(), header.version, header.outcome))
            self.base = header.version
            if header.version > cells[slot + _Board.MAXV]:
                cells[slot + _Board.MAXV] = header.version

    async def _push_pull_once(self, chunks: list) -> _pb.ChunkHeader:
        """One PushPull (a retry resends the same chunks: same sequence number, so never applied twice)."""
        timeout, md = self.cfg.step_timeout, self.metadata
        call = (self._push_pull_one(chunks[0], timeout=timeout, metadata=md) if len(chunks) == 1
                else self._push_pull(iter(chunks), timeout=timeout, metadata=md))
        header = None
        async for chunk in call:
            if header is None:
                header = chunk.header
        if header is None:
            raise RuntimeError("a PushPull reply streamed no chunk")
        return header

    async def leave(self, timeout: float) -> None:
        if not self.registered:
            return
        try:
            request = _pb.LeaveRequest(rank=self.rank, trainer_id=self.trainer_id, fingerprint=self.job.fingerprint)
            await self._leave(request, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            self.leave_errors[e.code().name] += 1


async def _watch_abort(cells, tasks) -> None:
    while not cells[_Board.ABORT]:
        await asyncio.sleep(0.02)
    for t in tasks:
        t.cancel()


async def _run_trainers(index: int, ranks: list[int], job: JobWire, cfg: LoadConfig, cells, lock) -> dict:
    slot = _Board.SLOT0 + index * _Board.SLOT_SIZE
    cells[slot + _Board.UP] = 1
    while not (cells[_Board.GO] or cells[_Board.ABORT]):  # the prober starts once every client process is up
        await asyncio.sleep(0.01)
    sims = [_SimTrainer(r, job, cfg, cells, lock, slot) for r in ranks]
    tasks = [asyncio.create_task(s.run()) for s in sims]
    watcher = asyncio.create_task(_watch_abort(cells, tasks))
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    watcher.cancel()
    await asyncio.gather(*(s.leave(2.0 if cells[_Board.ABORT] else 10.0) for s in sims))
    await asyncio.gather(*(s.channel.close() for s in sims), return_exceptions=True)
    crashes = [f"rank {s.rank}: {o!r}" for s, o in zip(sims, outcomes)
               if isinstance(o, BaseException) and not isinstance(o, (asyncio.CancelledError, grpc.aio.AioRpcError))]
    return dict(records=[r for s in sims for r in s.records], errors=[e for s in sims for e in s.errors],
                examples={k: v for s in sims for k, v in s.examples.items()},
                leave_errors=dict(sum((s.leave_errors for s in sims), Counter())), crashes=crashes)


def _worker_main(index: int, ranks: list[int], job: JobWire, cfg: LoadConfig, cells, lock, conn) -> None:
    """A client process: its trainers on one event loop; the results go back through ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator decides when to stop
    try:
        result = asyncio.run(_run_trainers(index, ranks, job, cfg, cells, lock))
    except BaseException:  # noqa: BLE001 -- reported to the orchestrator, which owns the exit code
        result = dict(records=[], errors=[], examples={}, leave_errors={}, crashes=[traceback.format_exc()])
    conn.send(result)
    conn.close()


# --------------------------------------------------------------------------------------------- stranger
async def _stall_streams(address: str, streams: int, connections: int, cells) -> dict:
    """Open ``streams`` Push streams that never send a message, hold them until released, then cancel them."""
    cells[_Board.STRANGER_UP] = 1
    while not cells[_Board.STALL_OPEN]:
        if cells[_Board.ABORT]:
            return {}
        await asyncio.sleep(0.01)
    never = asyncio.Event()

    async def silent():
        await never.wait()  # never set: the stream stays open and empty
        yield b""

    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(connections)]
    pushes = [ch.stream_unary(method("Push"), serialize_chunk, _pb.PushReply.FromString) for ch in channels]
    calls = [pushes[i % connections](silent()) for i in range(streams)]

    async def hold(call) -> str:
        try:
            await call
            return "OK"
        except grpc.aio.AioRpcError as e:
            return e.code().name
        except asyncio.CancelledError:
            return "CANCELLED"

    tasks = [asyncio.create_task(hold(c)) for c in calls]
    await asyncio.gather(*(asyncio.wait_for(c.wait_for_connection(), 10) for c in calls), return_exceptions=True)
    await asyncio.sleep(0.2)  # let immediate refusals arrive before counting what is open
    cells[_Board.STALL_OPENED] = sum(not t.done() for t in tasks)
    while not (cells[_Board.STALL_RELEASE] or cells[_Board.ABORT]):
        await asyncio.sleep(0.01)
    ended_early = Counter(t.result() for t in tasks if t.done())
    still_open = sum(not t.done() for t in tasks)
    for c in calls:
        c.cancel()
    await asyncio.gather(*tasks)
    await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)
    cells[_Board.STALL_DONE] = 1
    return dict(streams=streams, connections=connections, open_at_release=still_open,
                ended_before_release=dict(ended_early))


def _stranger_main(address: str, streams: int, connections: int, cells, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = asyncio.run(_stall_streams(address, streams, connections, cells))
    except BaseException:  # noqa: BLE001
        result = dict(crash=traceback.format_exc())
    cells[_Board.STALL_DONE] = 1
    conn.send(result)
    conn.close()


# ----------------------------------------------------------------------------------------------- prober
def _prober_main(conn, interval: float, timeout: float) -> None:
    """Health.Check every ``interval`` s while told to probe; (sent at, seconds, code) per probe."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    request = health_pb2.HealthCheckRequest(service="")
    while True:
        command = conn.recv()
        if command[0] != "probe":
            return
        records = []
        with grpc.insecure_channel(command[1], options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            try:
                # The first probe should not pay for connecting.
                grpc.channel_ready_future(channel).result(timeout=timeout)
            except grpc.FutureTimeoutError:
                pass
            next_at = time.monotonic()
            while True:
                t0 = time.monotonic()
                try:
                    reply = check(request, timeout=timeout)
                    code = "OK" if reply.status == health_pb2.HealthCheckResponse.SERVING else "NOT_SERVING"
                except grpc.RpcError as e:
                    code = e.code().name
                t1 = time.monotonic()
                records.append((t0, t1 - t0, code))
                next_at = max(next_at + interval, t1)  # no catch-up burst after a slow probe
                if conn.poll(max(0.0, next_at - time.monotonic())):
                    conn.recv()  # "stop"
                    break
        conn.send(records)


class _Prober:
    """A long-lived probing process, pointed at one shard per measurement."""

    def __init__(self, ctx, cfg: LoadConfig, name: str = "loadgen-prober"):
        self.cfg = cfg
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prober_main, args=(child, cfg.health_interval, cfg.health_timeout),
                                name=name, daemon=True)
        self.proc.start()
        child.close()
        self.probing = False

    def start(self, address: str) -> None:
        self.conn.send(("probe", address))
        self.probing = True

    def stop(self) -> list[tuple]:
        if not self.probing:
            return []
        self.probing = False
        try:
            self.conn.send(("stop",))
            if self.conn.poll(self.cfg.health_timeout + 30):
                return self.conn.recv()
        except (OSError, EOFError):
            pass
        log.warning("%s did not answer; its probes are lost", self.proc.name)
        return []

    def close(self) -> None:
        try:
            self.conn.send(("quit",))
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()


# ----------------------------------------------------------------------------------------------- fleet
class _Fleet:
    """The client processes hosting one job's trainers (and, for a stall run, the stranger)."""

    def __init__(self, ctx, cfg: LoadConfig, job: JobWire, stall: tuple[int, int] | None = None,
                 broken=lambda: False):
        n = job.num_trainers
        self.broken = broken  # e.g. the shard exited: no point waiting for the deadline
        self.why = ""  # why the last wait gave up
        procs = min(cfg.client_procs, n)
        self.n = n
        self.board = _Board(ctx, procs)
        self.cells = self.board.cells
        if cfg.sync_like and cfg.rounds:
            self.cells[_Board.STOP_AT] = cfg.warmup + cfg.rounds  # known in advance: no race to decide it
        self.ranks = [list(range(i, n, procs)) for i in range(procs)]  # rank 0 in worker 0
        self.procs, self.conns = [], []
        self.stranger = None
        try:
            for i, ranks in enumerate(self.ranks):
                self._spawn(ctx, f"loadgen-worker{i}", _worker_main, (i, ranks, job, cfg, self.cells, self.board.lock))
            if stall:
                self.stranger = self._spawn(ctx, "loadgen-stranger", _stranger_main, (job.address, *stall, self.cells))
        except BaseException:
            self.kill()
            raise

    def _spawn(self, ctx, name, target, args):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(*args, child), name=name, daemon=True)
        p.start()
        child.close()
        self.procs.append(p)
        self.conns.append(parent)
        return p

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs[:len(self.ranks)]]

    def failed(self) -> bool:
        """A trainer crashed, or a worker exited before its trainers finished (it crashed or was killed)."""
        for i, p in enumerate(self.procs[:len(self.ranks)]):
            slot = _Board.SLOT0 + i * _Board.SLOT_SIZE
            if self.cells[slot + _Board.CRASHED] or (
                    not p.is_alive() and self.cells[slot + _Board.DONE] < len(self.ranks[i])):
                return True
        return False

    def wait(self, predicate, deadline: float) -> bool:
        """Poll ``predicate`` until true; False (and ``why`` says which) at the deadline, when a client process
        died, or when ``broken()``."""
        while not predicate():
            self.why = ("client" if self.failed() else "shard" if self.broken()
                        else "deadline" if time.monotonic() >= deadline else "")
            if self.why:
                return False
            time.sleep(0.005)  # polling the board: the orchestrator is not on any measured path
        return True

    def finish(self, timeout: float = 60.0) -> tuple[list[dict], dict | None]:
        """Collect every process's result and join it; a process that does not answer is terminated."""
        give_up = time.monotonic() + timeout
        results = []
        for p, conn in zip(self.procs, self.conns):
            result = None
            try:
                if conn.poll(max(0.0, give_up - time.monotonic())):
                    result = conn.recv()
            except (EOFError, OSError):
                pass
            p.join(max(0.1, give_up - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join()
            results.append(result if result is not None else
                           dict(records=[], errors=[], examples={}, leave_errors={},
                                crashes=[f"{p.name} sent no result (exit code {p.exitcode})"]))
        stranger = results.pop() if self.stranger is not None else None
        return results, stranger

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
            p.join()


# ---------------------------------------------------------------------------------------------- /proc
def _cpu_rate(before: list, after: list) -> float | None:
    pairs = [(a, b) for a, b in zip(before, after) if a and b]
    if not pairs:
        return None
    span = max(b["time"] - a["time"] for a, b in pairs)
    return sum(b["cpu"] - a["cpu"] for a, b in pairs) / span if span > 0 else None


# --------------------------------------------------------------------------------------------- summaries
def _pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) or None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 3)


def latency_stats(seconds: list[float]) -> dict:
    return dict(count=len(seconds), p50_ms=_ms(_pct(seconds, 0.5)), p99_ms=_ms(_pct(seconds, 0.99)),
                max_ms=_ms(max(seconds) if seconds else None))


def health_stats(probes: list[tuple], t0: float = -math.inf, t1: float = math.inf) -> dict:
    """Latency of every probe sent in [t0, t1] (failures included: a refusal is an answer too) and failures by code."""
    inside = [p for p in probes if t0 <= p[0] <= t1]
    out = latency_stats([p[1] for p in inside])
    out["failures"] = dict(Counter(p[2] for p in inside if p[2] != "OK"))
    return out


def _slowest(probes: list[tuple], marks: dict, k: int = 5) -> list[dict]:
    """The slowest probes, each placed in the phase it was sent in (did setup or the window cause it?)."""
    begins = {"go": "setup", "setup": "warm-up", "start": "measure", "stop": "drain", "end": "teardown"}
    order = sorted((t, begins[name]) for name, t in marks.items() if name in begins)
    out = []
    for t, seconds, code in sorted(probes, key=lambda p: -p[1])[:k]:
        phase = next((name for mt, name in reversed(order) if mt <= t), "setup")
        out.append(dict(ms=_ms(seconds), code=code, phase=phase, at_s=round(t - order[0][0], 3) if order else None))
    return out


def _merge(results: list[dict]) -> tuple[list, list, dict, dict, list]:
    records = [r for res in results for r in res["records"]]
    errors = [e for res in results for e in res["errors"]]
    examples = {k: v for res in results for k, v in res["examples"].items()}
    leave = sum((Counter(res["leave_errors"]) for res in results), Counter())
    crashes = [c for res in results for c in res["crashes"]]
    return records, errors, examples, dict(leave), crashes


def window_summary(records: list[tuple], t0: float, t1: float) -> dict:
    """Steps that completed in [t0, t1]: count, distinct round versions reached, step latency."""
    inside = [r for r in records if t0 <= r[2] <= t1]
    versions = [r[3] for r in records if r[2] <= t1]
    before = [r[3] for r in records if r[2] < t0]
    rounds = (max(versions) if versions else 0) - (max(before) if before else 0)
    span = t1 - t0
    return dict(seconds=round(span, 3), pushes=len(inside), rounds=rounds,
                pushes_per_s=round(len(inside) / span, 2) if span > 0 else None,
                rounds_per_s=round(rounds / span, 2) if span > 0 else None,
                step=latency_stats([r[2] - r[1] for r in inside]), outcomes=_outcomes(inside))


def sync_window(records: list[tuple], v_start: int, stop_at: int) -> dict:
    """The exact window of a sync run: pushes on base versions [v_start, stop_at), from round v_start opening
    (its first reply) to the last reply of round stop_at."""
    inside = [r for r in records if v_start <= r[0] < stop_at]
    opened = [r[2] for r in records if r[3] >= v_start]
    t0 = min(opened) if opened else 0.0
    t1 = max((r[2] for r in inside), default=t0)
    rounds, span = stop_at - v_start, t1 - t0
    return dict(seconds=round(span, 3), pushes=len(inside), rounds=rounds, t0=t0, t1=t1,
                pushes_per_s=round(len(inside) / span, 2) if span > 0 else None,
                rounds_per_s=round(rounds / span, 2) if span > 0 else None,
                step=latency_stats([r[2] - r[1] for r in inside]), outcomes=_outcomes(inside))


def _outcomes(records: list[tuple]) -> dict:
    """What became of the pushes (the reply header's outcome): applied, accepted, stale, duplicate..."""
    return {_pb.PushOutcome.Name(k).lower(): v for k, v in sorted(Counter(r[4] for r in records).items())}


def _shard_stats(address: str, token: str) -> dict:
    """The shard's version and counters, or why not (a starved shard may refuse even this)."""
    md = (("authorization", f"Bearer {token}"),) if token else None
    try:
        with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            get = ch.unary_unary(method("GetStats"), _pb.StatsRequest.SerializeToString, _pb.StatsReply.FromString)
            s = get(_pb.StatsRequest(), timeout=10, metadata=md)
    except grpc.RpcError as e:
        return dict(error=f"{e.code().name}: {e.details()}")
    return dict(version=s.version, live=len(s.live_ranks), counters={k: round(v, 4) for k, v in s.counters.items()})


# ------------------------------------------------------------------------------------------ measurements
class _Shard:
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
            from trainer.procs import start_shard

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
class _Session:
    """What one run of a fleet left behind: whether its phases all finished, where it stopped, its data."""

    ok: bool = False
    phase: str = "setup"
    results: list = dataclasses.field(default_factory=list)
    stranger: dict | None = None
    probes: list = dataclasses.field(default_factory=list)
    port_probes: list | None = None  # the --health-port prober's, or None when that port is not probed
    fleet: "_Fleet | None" = None


def _run_session(ctx, cfg: LoadConfig, job: JobWire, shard: _Shard, prober: _Prober, phases, deadline: float,
                 stall: tuple[int, int] | None = None, port_prober: _Prober | None = None) -> _Session:
    """Run ``phases(fleet, session) -> bool`` on a fresh fleet, probing the shard from the moment every client
    process is up (their start-up is not the shard's doing); whatever happens, the client processes are stopped
    (at once unless every phase finished) and their results and the probes collected.  ``port_prober`` probes
    the shard's health port (``shard.health_address``), if it has one, over the same span."""
    s = _Session(phase="starting client processes")
    port_prober = port_prober if shard.health_address else None
    if port_prober is not None:
        s.port_probes = []
    try:
        s.fleet = _Fleet(ctx, cfg, job, stall, broken=lambda: not shard.alive())
        if s.fleet.wait(lambda: s.fleet.board.up(stall is not None), deadline):
            prober.start(shard.address)
            if port_prober is not None:
                port_prober.start(shard.health_address)
            s.fleet.cells[_Board.GO] = 1
            s.phase = "setup"
            s.ok = phases(s.fleet, s)
    finally:
        try:
            if s.fleet is not None:
                if not s.ok:  # the deadline, a dead process, or an exception here: the trainers stop where they are
                    s.fleet.cells[_Board.ABORT] = 1
                s.results, s.stranger = s.fleet.finish()
        finally:
            if s.fleet is not None:
                s.fleet.kill()
            s.probes = prober.stop()
            if port_prober is not None:
                s.port_probes = port_prober.stop()
    return s


def _status(s: _Session, shard: _Shard, crashes: list, deadline: float) -> str:
    if s.ok:
        return "ok"
    if s.fleet.why == "shard" or not shard.alive():
        return f"shard exited during {s.phase}"
    if s.fleet.why == "client" or crashes:
        return f"client failed during {s.phase}"
    return f"deadline ({deadline:.0f} s) during {s.phase}"


def measure(ctx, cfg: LoadConfig, shard: _Shard, prober: _Prober, n: int, port_prober: _Prober | None = None) -> dict:
    """One row: N trainers on a fresh job, warm-up, a measured window, bounded by ``cfg.deadline``."""
    job = make_job(cfg, shard.address, n)
    t_begin = time.monotonic()
    deadline = t_begin + cfg.deadline
    v_start = cfg.warmup if cfg.sync_like else cfg.warmup * n
    marks, samples = {}, {}

    def phases(fleet: _Fleet, s: _Session) -> bool:
        cells, board = fleet.cells, fleet.board
        pids = [shard.pid] + fleet.worker_pids()
        marks["go"] = time.monotonic()
        try:
            if not fleet.wait(lambda: board.total(_Board.READY) == n and cells[_Board.INIT_DONE], deadline):
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
            cells[_Board.STOP_REQ] = 1
            marks["stop"], s.phase = time.monotonic(), "drain"
            return fleet.wait(lambda: board.total(_Board.DONE) == n, deadline)
        finally:
            samples["end"] = [sample(p) for p in pids]
            marks["end"] = time.monotonic()

    s = _run_session(ctx, cfg, job, shard, prober, phases, deadline, port_prober=port_prober)
    marks.setdefault("end", time.monotonic())  # (the phases never ran if the client processes never came up)
    records, errors, examples, leave_errors, crashes = _merge(s.results)
    status = _status(s, shard, crashes, cfg.deadline)
    cells = s.fleet.cells
    stop_at = int(cells[_Board.STOP_AT]) if cells[_Board.STOP_AT] < NO_STOP else None
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
        rounds_total=max((r[3] for r in records), default=0), step=window["step"],
        health=health_stats(s.probes), health_window=health_stats(s.probes, w0, w1), **port,
        health_slowest=_slowest(s.probes, marks),
        shard=dict(pid=shard.pid, cpu_per_s=_round(_cpu_rate(start[:1], end[:1])) if start else None,
                   rss_start_mb=_mb(shard.start_sample, "VmRSS"), rss_end_mb=_mb(end[0], "VmRSS"),
                   peak_rss_mb=_mb(end[0], "VmHWM")),
        client=dict(procs=len(s.fleet.ranks), cpu_per_s=_round(_cpu_rate(start[1:], end[1:])) if start else None),
        errors=dict(Counter(code for _, code in errors)), error_examples=examples, leave_errors=leave_errors,
        crashes=crashes, setup_s=round(marks.get("setup", marks["end"]) - t_begin, 3),
        shard_stats=_shard_stats(shard.address, cfg.token) if shard.alive() else dict(error="the shard exited"),
    )


def measure_stall(ctx, cfg: LoadConfig, shard: _Shard, prober: _Prober, trainers: int, streams: int,
                  connections: int, port_prober: _Prober | None = None) -> dict:
    """A sync job unloaded, then while a stranger holds ``streams`` silent Push streams open, then after."""
    cfg = dataclasses.replace(cfg, mode="sync", rounds=0)
    job = make_job(cfg, shard.address, trainers)
    seconds = cfg.seconds if cfg.seconds > 0 else 5.0
    deadline = time.monotonic() + cfg.deadline + 3 * seconds
    windows = {}

    def phases(fleet: _Fleet, s: _Session) -> bool:
        cells, board = fleet.cells, fleet.board
        if not fleet.wait(lambda: board.total(_Board.READY) == trainers and cells[_Board.INIT_DONE], deadline):
            return False
        s.phase = "warm-up"
        if not fleet.wait(lambda: board.max_version() >= cfg.warmup, deadline):
            return False
        for name in ("unloaded", "stalled", "released"):
            if name == "stalled":
                cells[_Board.STALL_OPEN] = 1
                s.phase = "opening the stalled streams"
                if not fleet.wait(lambda: cells[_Board.STALL_OPENED] > 0 or cells[_Board.STALL_DONE], deadline):
                    return False
            elif name == "released":
                cells[_Board.STALL_RELEASE] = 1
                s.phase = "releasing the stalled streams"
                if not fleet.wait(lambda: cells[_Board.STALL_DONE] > 0, deadline):
                    return False
            s.phase, t0 = name, time.monotonic()
            done = fleet.wait(lambda: time.monotonic() >= t0 + seconds, deadline)
            windows[name] = (t0, time.monotonic())
            if not done:
                return False
        cells[_Board.STOP_REQ] = 1
        s.phase = "drain"
        return fleet.wait(lambda: board.total(_Board.DONE) == trainers, deadline)

    s = _run_session(ctx, cfg, job, shard, prober, phases, deadline, stall=(streams, connections),
                     port_prober=port_prober)
    records, errors, examples, leave_errors, crashes = _merge(s.results)
    counted = (_pb.APPLIED, _pb.ACCEPTED)
    per_round = Counter(r[3] for r in records if r[4] in counted)  # round v -> gradients it closed with
    rows = []
    for name, (t0, t1) in windows.items():
        w = window_summary(records, t0, t1)
        reached = {r[3] for r in records if t0 <= r[2] <= t1 and r[4] in counted}
        rows.append(dict(phase=name, seconds=w["seconds"], rounds=w["rounds"], steps=w["pushes"], step=w["step"],
                         partial_rounds=sum(per_round[v] < trainers for v in reached), outcomes=w["outcomes"],
                         health=health_stats(s.probes, t0, t1),
                         **({} if s.port_probes is None else dict(health_port=health_stats(s.port_probes, t0, t1))),
                         errors=dict(Counter(code for t, code in errors if t0 <= t <= t1))))
    by = {r["phase"]: r for r in rows}
    ratio = {}
    if "unloaded" in by and "stalled" in by:
        for q in ("p50_ms", "p99_ms"):
            a, b = by["unloaded"]["step"][q], by["stalled"]["step"][q]
            ratio[q] = round(b / a, 3) if a and b is not None else None
    return dict(streams=streams, connections=connections, trainers=trainers,
                status=_status(s, shard, crashes, cfg.deadline + 3 * seconds),
                phases=rows, step_ratio=ratio, stranger=s.stranger, errors=dict(Counter(c for _, c in errors)),
                error_examples=examples, leave_errors=leave_errors, crashes=crashes,
                shard_stats=_shard_stats(shard.address, cfg.token) if shard.alive() else dict(error="the shard exited"))


def _mb(sample: dict | None, key: str) -> float | None:
    return round(sample[key] / 2 ** 20, 2) if sample and key in sample else None


def _round(x: float | None, digits: int = 3) -> float | None:
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


# ----------------------------------------------------------------------------------------------- output
def _cell(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _codes(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"


def _health_cell(h: dict | None) -> str:
    """p50 / p99 / max ms of a health stats dict, or "-" when that port was not probed."""
    if h is None:
        return "-"
    return f"{_cell(h['p50_ms'])} / {_cell(h['p99_ms'])} / {_cell(h['max_ms'])}"


def _health_fails(h: dict, port: dict | None) -> str:
    """Failed probes by code: the main port's, then the health port's (marked "port:")."""
    parts = [_codes(h["failures"])] if h["failures"] else []
    if port and port["failures"]:
        parts.append(f"port: {_codes(port['failures'])}")
    return "; ".join(parts) or "-"


def markdown(result: dict) -> str:
    server = " ".join(result["server_args"]) or "default flags"
    if result.get("health_port"):
        server += f", health port: {result['health_port']}"
    lines = [f"ps-loadgen: mode {result['mode']}, P = {result['params']}, window {result['window']}, "
             f"client procs {result['client_procs']}, shard {result['shard']} ({server}), {result['machine']}", ""]
    if result["rows"]:
        lines += ["| N | status | rounds | pushes/s | rounds/s | step p50 / p99 ms | health p50 / p99 / max ms "
                  "| health port p50 / p99 / max ms | health fails | shard CPU s/s | shard RSS MB "
                  "| RSS KB / extra trainer | client CPU s/s | errors |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
        for r in result["rows"]:
            s, h, st = r["shard"], r["health"], r["step"]
            odd = {k: v for k, v in r["outcomes"].items() if k not in ("applied", "accepted")}
            rounds = f"{r['rounds']}" + (f" ({_codes(odd)})" if odd else "")
            lines.append(
                f"| {r['trainers']} | {r['status']} | {rounds} | {_cell(r['pushes_per_s'])} "
                f"| {_cell(r['rounds_per_s'], '{:.2f}')} "
                f"| {_cell(st['p50_ms'])} / {_cell(st['p99_ms'])} | {_health_cell(h)} "
                f"| {_health_cell(r.get('health_port'))} | {_health_fails(h, r.get('health_port'))} "
                f"| {_cell(s['cpu_per_s'], '{:.2f}')} "
                f"| {_cell(s['rss_end_mb'])} | {_cell(s.get('rss_growth_kb_per_trainer'))} "
                f"| {_cell(r['client']['cpu_per_s'], '{:.2f}')} | {_codes(r['errors'])} |")
        lines += ["", "rounds and pushes/s: the measured window after warm-up (sync: exactly the rounds it spans); "
                      "step: one PushPull, round wait included; "
                      "health: Health.Check on the main port -- the standard service on the shard's own port, "
                      "answered by its event loop, so it queues behind the shard's calls; "
                      "health port: Health.Check on ps-server --health-port -- a process of its own, not queued "
                      "behind the loop, that still reads NOT_SERVING if the loop stalls (\"-\": not probed; "
                      "see --health-port, or --health-address with --ps); both probed every "
                      f"{result['config']['health_interval'] * 1000:g} ms over the whole run, setup included; "
                      "health fails: failed probes by code (\"port:\" for the health port's); "
                      "errors: failed calls by status code, each retried."]
    stall = result.get("stall")
    if stall:
        lines += ["", f"Stall: a stranger holds {counted(stall['streams'], 'silent Push stream')} open "
                      f"({counted(stall['connections'], 'connection')}) beside a sync job of "
                      f"{counted(stall['trainers'], 'trainer')} "
                      f"-- {stall['status']}", "",
                  "| phase | rounds | of them without everyone | steps | step p50 / p99 ms | health p50 / p99 / max ms "
                  "| health port p50 / p99 / max ms | health fails | errors |",
                  "|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for p in stall["phases"]:
            h, hp = p["health"], p.get("health_port")
            lines.append(f"| {p['phase']} | {p['rounds']} | {p['partial_rounds']} | {p['steps']} "
                         f"| {_cell(p['step']['p50_ms'])} / {_cell(p['step']['p99_ms'])} | {_health_cell(h)} "
                         f"| {_health_cell(hp)} | {_health_fails(h, hp)} | {_codes(p['errors'])} |")
        r, s = stall["step_ratio"], stall.get("stranger") or {}
        ratio = (f"p50 {r['p50_ms']:.2f}x, p99 {r['p99_ms']:.2f}x" if r.get("p50_ms") is not None
                 and r.get("p99_ms") is not None else "no step completed while stalled")
        stalled = next((p for p in stall["phases"] if p["phase"] == "stalled"), None)
        if stalled and stalled["partial_rounds"]:
            ratio += " (but rounds closed without every trainer, so these are not like steps)"
        expired = (stall["shard_stats"].get("counters") or {}).get("lease_expired")
        dropped = f"; trainers dropped by the shard for silence (lease expired): {expired:g}" if expired else ""
        lines += ["", f"step time stalled / unloaded: {ratio}; stranger streams still open at release: "
                      f"{s.get('open_at_release', '-')}, ended before release: "
                      f"{_codes(s.get('ended_before_release', {}))}{dropped}"]
    examples = {k: v for r in result["rows"] for k, v in r["error_examples"].items()}
    if stall:
        examples.update(stall["error_examples"])
    if examples:
        lines += ["", "First message per status code:"] + [f"* {k}: {v}" for k, v in sorted(examples.items())]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4), constrained_layout=True)
    ns = [r["trainers"] for r in rows]

    def series(ax, values, label, marker="o"):
        pts = [(n, v) for n, v in zip(ns, values) if v is not None]
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=label)

    series(axes[0], [r["pushes_per_s"] for r in rows], "pushes/s")
    series(axes[0], [r["rounds_per_s"] for r in rows], "rounds/s", "s")
    axes[0].set_title("throughput")
    series(axes[1], [r["health"]["p99_ms"] for r in rows], "health p99 (main port)")
    series(axes[1], [r["health"]["max_ms"] for r in rows], "health max (main port)", "^")
    series(axes[1], [(r.get("health_port") or {}).get("p99_ms") for r in rows], "health port p99", "D")
    failed = [(n, h["p99_ms"]) for n, r in zip(ns, rows) for h in (r["health"], r.get("health_port"))
              if h and h["failures"] and h["p99_ms"]]
    if failed:
        axes[1].plot(*zip(*failed), "rx", markersize=12, label="probes failed")
    axes[1].axhline(50, color="grey", linestyle="--", linewidth=1, label="50 ms")
    axes[1].set_title("health-check latency (ms)")
    series(axes[2], [r["step"]["p50_ms"] for r in rows], "step p50")
    series(axes[2], [r["step"]["p99_ms"] for r in rows], "step p99", "s")
    axes[2].set_title("step (PushPull) latency (ms)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("simulated trainers N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------------------- run
def run(cfg: LoadConfig, trainers: list[int], out: Path, ps: str = "", server_args: list[str] | None = None,
        stall: tuple[int, int, int] | None = None, health_port: bool = False, health_address: str = "") -> dict:
    """Every N in turn (a fresh shard each, unless ``ps``), then the stall scenario; writes out/loadgen.*.

    ``health_port``: start each shard with ps-server --health-port on a free loopback port and probe that port
    too; ``health_address``: the same for the external shard ``ps``."""
    check_health_flags(ps, health_port, health_address)
    _raise_fd_limit()
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds gRPC state
    out.mkdir(parents=True, exist_ok=True)
    result = dict(mode=cfg.mode, params=cfg.params, client_procs=cfg.client_procs,
                  window=f"{cfg.seconds:g} s" + (f" or {counted(cfg.rounds, 'round')}" if cfg.rounds else ""),
                  machine=f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}, "
                          f"gRPC {grpc.__version__}",
                  server_args=server_args or [], shard=ps or "started per N", config=dataclasses.asdict(cfg),
                  rows=[], stall=None)
    if health_port or health_address:
        result["health_port"] = health_address or "--health-port on a free loopback port per shard"
    result["config"]["token"] = "set" if cfg.token else ""
    prober = _Prober(ctx, cfg)
    port_prober = _Prober(ctx, cfg, "loadgen-port-prober") if health_port or health_address else None
    shard_kw = dict(health_port=health_port, health_address=health_address)
    try:
        for n in trainers:
            log.info("N = %d: starting", n)
            shard = _Shard(ps, out / "logs", server_args or [], f"{cfg.mode}-n{n}", **shard_kw)
            try:
                row = measure(ctx, cfg, shard, prober, n, port_prober)
            finally:
                code = shard.stop()
            row["shard"]["exit_code"] = code  # after SIGTERM; None: not started here
            result["rows"].append(row)
            log.info("N = %d: %s, %s, %s pushes/s, errors %s", n, row["status"], counted(row["rounds"], "round"),
                     row["pushes_per_s"], row["errors"] or "none")
        add_rss_growth(result["rows"])
        if stall:
            streams, connections, k = stall
            log.info("stall: %d silent streams beside %d sync trainers", streams, k)
            shard = _Shard(ps, out / "logs", server_args or [], f"stall-{streams}", **shard_kw)
            try:
                result["stall"] = measure_stall(ctx, cfg, shard, prober, k, streams, connections, port_prober)
            finally:
                shard.stop()
    finally:
        prober.close()
        if port_prober is not None:
            port_prober.close()
    (out / "loadgen.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "loadgen.md").write_text(markdown(result))
    if result["rows"]:
        plot(result["rows"], out / "loadgen.png")
    return result


def check_health_flags(ps: str, health_port: bool, health_address: str) -> None:
    """--health-port picks the port of a shard started here; a running shard's (--ps) must be given."""
    if health_port and ps:
        raise ValueError("--health-port cannot go with --ps: it picks the port of the shards it starts; "
                         "give the running shard's health port as --health-address HOST:PORT instead")
    if health_address and not ps:
        raise ValueError("--health-address is for a running shard (--ps HOST:PORT); "
                         "for the shards started here use --health-port")


def _raise_fd_limit() -> None:
    """A thousand trainers need a thousand sockets here and in the shard (which inherits the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


# -------------------------------------------------------------------------------------------------- CLI
def build_parser(stall_only: bool = False) -> EnvArgumentParser:
    prog = "ps-loadgen stall" if stall_only else "ps-loadgen"
    p = EnvArgumentParser(prog=prog, description=(
        "Stall scenario: a sync job unloaded, then beside a stranger holding silent Push streams open."
        if stall_only else "Drive one shard with N simulated trainers per measurement and report how it scales. "
        "Also: 'ps-loadgen stall --streams K'."))
    if not stall_only:
        p.add_argument("--trainers", default=DEFAULT_TRAINERS, help="comma list of N, one measurement each")
        p.add_argument("--mode", choices=MODES, default="sync")
        p.add_argument("--stall", type=int, default=0, help="also run the stall scenario with this many streams")
    else:
        p.add_argument("--streams", type=int, default=64, help="silent Push streams the stranger holds open")
    p.add_argument("--stall-connections", type=int, default=0,
                   help="connections the stranger spreads its streams over (0: one per stream)")
    p.add_argument("--stall-trainers", type=int, default=2, help="trainers of the legitimate job in the stall scenario")
    p.add_argument("--ps", default="", help="HOST:PORT of a running shard (default: start a fresh one per N)")
    p.add_argument("--server-args", default="", help="extra ps-server flags for the shards started here")
    p.add_argument("--params", type=int, default=1000, help="parameters in the job (P)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured window per N")
    p.add_argument("--rounds", type=int, default=0, help="or end the window after this many rounds (0: --seconds)")
    p.add_argument("--warmup", type=int, default=3, help="rounds (async: pushes per trainer) before the window")
    p.add_argument("--deadline", type=float, default=120.0, help="hard limit in seconds per N, setup included")
    p.add_argument("--step-timeout", type=float, default=30.0, help="deadline of one PushPull, seconds")
    p.add_argument("--sync-timeout", type=float, default=0.5, help="stale-timeout mode: seconds a round waits")
    p.add_argument("--client-procs", type=int, default=1, help="client processes the trainers are spread over")
    p.add_argument("--health-interval", type=float, default=0.02, help="seconds between health probes")
    p.add_argument("--health-port", action="store_true",
                   help="start each shard with ps-server --health-port on a free loopback port and probe that port "
                        "too (a second prober, same interval), beside the main port")
    p.add_argument("--health-address", default="",
                   help="with --ps: HOST:PORT where that shard answers health checks from its own thread "
                        "(its --health-port); probed beside the main port")
    p.add_argument("--auth-token-file", default="", help="token the trainers send (or set $PS_AUTH_TOKEN)")
    p.add_argument("--out", default="bench-results/loadgen", help="folder for loadgen.json, .md, .png and logs")
    p.add_argument("--quick", action="store_true", help="for CI: N = 1,4 for 2 s each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    return p


def parse_trainers(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--trainers ({text!r}) must be a comma list of whole numbers, e.g. 1,4,16") from None
    if not values or min(values) < 1:
        raise ValueError(f"--trainers ({text!r}) must list at least one N, each at least 1")
    return values


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    stall_only = argv[:1] == ["stall"]
    args = build_parser(stall_only).parse_args(argv[1:] if stall_only else argv)
    setup_logging(args.log_level)
    mode = "sync" if stall_only else args.mode
    trainers = [] if stall_only else parse_trainers(args.trainers)
    seconds, deadline, warmup = args.seconds, args.deadline, args.warmup
    if args.quick:
        trainers = [] if stall_only else [1, 4]
        seconds, deadline, warmup = 2.0, min(deadline, 60.0), min(warmup, 2)
    check_health_flags(args.ps, args.health_port, args.health_address)
    if args.ps and len(trainers) > 1:
        log.warning("--ps: every N registers a new job with the same shard; a shard that keeps its first job "
                    "refuses the later ones (FAILED_PRECONDITION)")
    cfg = LoadConfig(mode=mode, params=args.params, seconds=seconds, rounds=args.rounds, warmup=warmup,
                     deadline=deadline, step_timeout=args.step_timeout, sync_timeout=args.sync_timeout,
                     client_procs=args.client_procs, health_interval=args.health_interval,
                     token=read_token(args.auth_token_file), seed=args.seed)
    streams = args.streams if stall_only else args.stall
    if streams < 0 or args.stall_trainers < 1 or args.stall_connections < 0:
        raise ValueError("--streams/--stall must be >= 0, --stall-trainers >= 1 and --stall-connections >= 0")
    stall = (streams, args.stall_connections or streams, args.stall_trainers) if streams else None
    if stall_only and not stall:
        raise ValueError("ps-loadgen stall needs --streams of at least 1")
    result = run(cfg, trainers, Path(args.out), ps=args.ps, server_args=shlex.split(args.server_args), stall=stall,
                 health_port=args.health_port, health_address=args.health_address)
    print(markdown(result), end="")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def entrypoint() -> None:
    signal.signal(signal.SIGTERM, _interrupt)  # unwinds like Ctrl-C: the shards and client processes are stopped
    run_cli("ps-loadgen", main)
