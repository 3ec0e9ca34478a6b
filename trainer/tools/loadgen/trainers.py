"""Simulated trainers: asyncio coroutines on grpc.aio, many per client process."""

from __future__ import annotations

import asyncio
import random
import signal
import time
import traceback
from collections import Counter

import grpc
import grpc.aio
import numpy as np

from psserver.protocol.codec import DEFAULT_CHUNK_BYTES, encode_raw
from psserver.protocol.fastwire import parse_chunk, serialize_chunk
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.stubs import method
from trainer.tools.loadgen.board import Board
from trainer.tools.loadgen.config import CHANNEL_OPTIONS, JobWire, LoadConfig
from trainer.tools.loadgen.records import CallError, Step


class SimTrainer:
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
        self.records: list[Step] = []  # per completed step
        self.errors: list[CallError] = []  # per failed call
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
                self.errors.append(CallError(time.monotonic(), code))
                self.examples.setdefault(code, f"{what}: {e.details()}")
                if self.cells[Board.ABORT]:
                    raise
                await asyncio.sleep(random.uniform(delay / 2, delay))  # backoff, not synchronisation
                delay = min(2 * delay, 1.0)

    async def run(self) -> None:
        try:
            await self._run()
        except Exception:  # a bug, not a refusal (those are retried): tell the orchestrator, which stops the run
            self.cells[self.slot + Board.CRASHED] += 1
            raise

    async def _run(self) -> None:
        cells, cfg = self.cells, self.cfg
        req = _pb.RegisterRequest(rank=self.rank, trainer_id=self.trainer_id, expected_shard=0,
                                  job=_pb.JobSpec.FromString(self.job.job))
        reply = await self._retry("Register", lambda: self._register(
            req, timeout=cfg.connect_timeout, wait_for_ready=True, metadata=self.metadata))
        self.registered, self.base = True, reply.version
        cells[self.slot + Board.READY] += 1
        if self.rank == 0:
            rng = np.random.default_rng(cfg.seed)
            values = (rng.standard_normal(cfg.params, dtype=np.float32) * 0.01).astype("<f4").tobytes()
            header = self._header()
            await self._retry("Init", lambda: self._init(iter(list(encode_raw(values, header, DEFAULT_CHUNK_BYTES))),
                                                         timeout=cfg.connect_timeout, metadata=self.metadata))
            cells[Board.INIT_DONE] = 1
        while not cells[Board.INIT_DONE]:  # rank 0 may live in another process
            await asyncio.sleep(0.01)
        await self._steps()
        cells[self.slot + Board.DONE] += 1

    async def _steps(self) -> None:
        cells, slot = self.cells, self.slot
        sequence = 0
        while not cells[Board.ABORT]:
            if cells[Board.STOP_REQ]:
                if not self.cfg.sync_like:
                    return
                # Sync: this trainer holds the newest version (round `base` cannot close without its push), so
                # every trainer can still reach base + 1 and none is past it: stopping there leaves no round half full.
                if self.base + 1 < cells[Board.STOP_AT]:
                    with self.lock:
                        if self.base + 1 < cells[Board.STOP_AT]:
                            cells[Board.STOP_AT] = self.base + 1
            if self.base >= cells[Board.STOP_AT]:
                return
            sequence += 1
            chunks = list(encode_raw(self.grad, self._header(version=self.base, num_samples=1, sequence=sequence),
                                     DEFAULT_CHUNK_BYTES))
            t0 = time.monotonic()
            header = await self._retry("PushPull", lambda: self._push_pull_once(chunks))
            self.records.append(Step(self.base, t0, time.monotonic(), header.version, header.outcome))
            self.base = header.version
            if header.version > cells[slot + Board.MAXV]:
                cells[slot + Board.MAXV] = header.version

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
    while not cells[Board.ABORT]:
        await asyncio.sleep(0.02)
    for t in tasks:
        t.cancel()


async def _run_trainers(index: int, ranks: list[int], job: JobWire, cfg: LoadConfig, cells, lock) -> dict:
    slot = Board.SLOT0 + index * Board.SLOT_SIZE
    cells[slot + Board.UP] = 1
    while not (cells[Board.GO] or cells[Board.ABORT]):  # the prober starts once every client process is up
        await asyncio.sleep(0.01)
    sims = [SimTrainer(r, job, cfg, cells, lock, slot) for r in ranks]
    tasks = [asyncio.create_task(s.run()) for s in sims]
    watcher = asyncio.create_task(_watch_abort(cells, tasks))
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    watcher.cancel()
    await asyncio.gather(*(s.leave(2.0 if cells[Board.ABORT] else 10.0) for s in sims))
    await asyncio.gather(*(s.channel.close() for s in sims), return_exceptions=True)
    crashes = [f"rank {s.rank}: {o!r}" for s, o in zip(sims, outcomes)
               if isinstance(o, BaseException) and not isinstance(o, (asyncio.CancelledError, grpc.aio.AioRpcError))]
    return dict(records=[r for s in sims for r in s.records], errors=[e for s in sims for e in s.errors],
                examples={k: v for s in sims for k, v in s.examples.items()},
                leave_errors=dict(sum((s.leave_errors for s in sims), Counter())), crashes=crashes)


def worker_main(index: int, ranks: list[int], job: JobWire, cfg: LoadConfig, cells, lock, conn) -> None:
    """A client process: its trainers on one event loop; the results go back through ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator decides when to stop
    try:
        result = asyncio.run(_run_trainers(index, ranks, job, cfg, cells, lock))
    except BaseException:  # noqa: BLE001 -- reported to the orchestrator, which owns the exit code
        result = dict(records=[], errors=[], examples={}, leave_errors={}, crashes=[traceback.format_exc()])
    conn.send(result)
    conn.close()
