"""The transport floor of one sparse step (`ps-bench --sections sparse-grid`): a step's bytes over bare gRPC Python.

Why: a grid row's gap to one process is part transport (what any gRPC Python step of this design pays: one unary
call a shard a step, serialised bytes in, bytes out) and part psgrpc's own (its checks, tables, replies).  The
floor replays the step sizes the sharded run measured -- each shard's Step request and reply bytes, step by step --
as one unary call per shard per step to as many bare echo servers (``grpc.aio`` servers, identity serializers,
a reply of the asked size), from one client the way the trainer calls (shard 0 on the calling thread, the others
on a pool's threads).  Its steps/s add the one-process compute time (trainer.tools.gridplan.floor_figures).

The echo servers are this file run as a script (no torch, nothing of ``trainer`` imported) and exit when their
stdin closes, so none outlives the bench (trainer.tools.floors.Child).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # run as a script: its folder (trainer/tools/) is not a place to import from
    del sys.path[0]

import os  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

SERVICE = "psbench.StepFloor"
HEADER = struct.Struct("!Q")  # a request's first 8 bytes: the reply's size
OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
WARMUP_CALLS = 3


# -------------------------------------------------------------------------------------------- echo server
def serve() -> None:
    """An echo server on an ephemeral port: each unary call answered with as many bytes as its first 8 ask for;
    prints the port, serves until stdin closes."""
    import asyncio

    import grpc

    block = os.urandom(1 << 20)

    async def step(request: bytes, context) -> bytes:
        nonlocal block
        n = HEADER.unpack_from(request)[0]
        if n > len(block):
            block = os.urandom(n)
        return block[:n]  # one copy, as a shard makes its reply's bytes

    async def main() -> None:
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"Step": grpc.unary_unary_rpc_method_handler(step)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
        await server.stop(0)

    asyncio.run(main())


# -------------------------------------------------------------------------------------------- the client side
def requests(sizes: list[list[tuple[int, int]]]) -> list[list[bytes]]:
    """Each step's request per shard, made before the timing (the trainer's serialising is psgrpc's own work)."""
    longest = max(max(req for req, _ in step) for step in sizes)
    body = os.urandom(max(longest, HEADER.size))
    return [[HEADER.pack(rep) + body[:max(0, req - HEADER.size)] for req, rep in step] for step in sizes]


def replay(ports: list[int], sizes: list[list[tuple[int, int]]]) -> float:
    """Seconds a step, on average, to send each step's requests and take in its replies, one unary call a shard
    (shard 0 on this thread, the others on a pool's), after WARMUP_CALLS untimed steps."""
    import grpc

    channels = [grpc.insecure_channel(f"127.0.0.1:{p}", options=OPTIONS) for p in ports]
    calls = [c.unary_unary(f"/{SERVICE}/Step") for c in channels]  # no serializers: bytes as they are
    pool = ThreadPoolExecutor(max_workers=len(calls) - 1) if len(calls) > 1 else None
    msgs = requests(sizes)

    def call(i: int, msg: bytes, want: int) -> None:
        got = len(calls[i](msg, timeout=60))
        if got != want:
            raise ConnectionError(f"the echo server answered {got} bytes, not {want}")

    def one_step(step: int) -> None:
        rest = [pool.submit(call, i, msgs[step][i], sizes[step][i][1]) for i in range(1, len(calls))]
        call(0, msgs[step][0], sizes[step][0][1])
        for f in rest:
            f.result()

    try:
        for k in range(WARMUP_CALLS):
            one_step(k % len(sizes))
        t0 = time.perf_counter()
        for step in range(len(sizes)):
            one_step(step)
        return (time.perf_counter() - t0) / len(sizes)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        for c in channels:
            c.close()


def measure(sizes: list[list[tuple[int, int]]], log_dir: Path) -> float:
    """Seconds a step of ``sizes`` (per step, per shard: request and reply bytes) over as many echo servers."""
    from trainer.tools.floors import Child
    servers = []
    try:
        for _ in range(len(sizes[0])):
            servers.append(Child(["serve"], log_dir, script=Path(__file__)))
        return replay([int(s.ask()) for s in servers], sizes)
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    serve()
