"""Transport floors for ps-bench: what raw loopback TCP and raw Python gRPC move for one step's bytes.

One step is a push of N bytes then a pull of the same N bytes, split over M connections to M server
*processes*.  Driven from one client process (M threads), and -- for gRPC -- from P client processes
(shared-nothing, each M/P of the connections and of the bytes), to see whether more than one interpreter
moves more bytes (issue 11 item 4).  Floors do the least work a transport allows: nothing is copied out of
the received messages or packed into the sent ones (gRPC: identity serializers, 1 MiB messages).

This module imports nothing from ``trainer`` and is run as a script for its server and driver processes, so
they start without torch.  The parent talks to them over their stdin/stdout, one line per step; they exit
when their stdin closes, so none outlives the bench even if it is killed.  A step's time is the latest end
minus the earliest start over the drivers (CLOCK_MONOTONIC is one clock for every process of the host).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # run as a script: its folder (trainer/tools/) is not a place to import from
    del sys.path[0]

import os  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

CHUNK = 1 << 20  # bytes per gRPC message
HEADER = struct.Struct("!Q")
SERVICE = "psbench.Floor"


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# -------------------------------------------------------------------------------------------- server process
def serve() -> None:
    """A floor server: a TCP echo port and a gRPC Push/Pull port; prints both, serves until stdin closes."""
    import grpc

    block = os.urandom(CHUNK)

    def push(requests, context):
        return HEADER.pack(sum(len(m) for m in requests))

    def pull(request, context):
        n = HEADER.unpack(request)[0]
        for _ in range(n // CHUNK):
            yield block
        if n % CHUNK:
            yield block[: n % CHUNK]

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(push), "Pull": grpc.unary_stream_rpc_method_handler(pull)})
    server = grpc.server(ThreadPoolExecutor(max_workers=4), handlers=[handler])
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=accept_echo, args=(listener,), daemon=True).start()
    print(listener.getsockname()[1], grpc_port, flush=True)
    sys.stdin.read()  # until the parent closes it (or dies)
    server.stop(0)


def accept_echo(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


def echo(conn: socket.socket) -> None:
    """Per message: an 8-byte length, that many bytes in, the same number of bytes back (buffers reused)."""
    buf = bytearray(CHUNK)
    with conn:
        while True:
            head = recv_exactly(conn, bytearray(HEADER.size))
            if head is None:
                return
            n = HEADER.unpack(head)[0]
            if len(buf) < n:
                buf = bytearray(n)
            view = memoryview(buf)[:n]
            if recv_exactly(conn, view) is None:
                return
            conn.sendall(view)


def recv_exactly(conn: socket.socket, into) -> bytes | None:
    """Fill ``into`` from ``conn``; None at end of stream."""
    view, got = memoryview(into), 0
    while got < len(view):
        k = conn.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return into


# -------------------------------------------------------------------------------------------- driver process
class TcpLink:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.out = bytearray(os.urandom(CHUNK))
        self.back = bytearray(CHUNK)

    def step(self, n: int) -> None:
        if len(self.out) < n:
            self.out, self.back = bytearray(n), bytearray(n)
        self.sock.sendall(HEADER.pack(n))
        self.sock.sendall(memoryview(self.out)[:n])
        if recv_exactly(self.sock, memoryview(self.back)[:n]) is None:
            raise ConnectionError("the floor server closed the connection")


class GrpcLink:
    def __init__(self, port: int):
        import grpc

        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.push = self.channel.stream_unary(f"/{SERVICE}/Push")  # no serializers: bytes as they are
        self.pull = self.channel.unary_stream(f"/{SERVICE}/Pull")
        self.block = os.urandom(CHUNK)

    def chunks(self, n: int):
        for _ in range(n // CHUNK):
            yield self.block
        if n % CHUNK:
            yield self.block[: n % CHUNK]

    def step(self, n: int) -> None:
        pushed = HEADER.unpack(self.push(self.chunks(n)))[0]
        pulled = sum(len(m) for m in self.pull(HEADER.pack(n)))
        if pushed != n or pulled != n:
            raise ConnectionError(f"the floor server moved {pushed} and {pulled} bytes, not {n}")


def drive(kind: str, ports: list[int]) -> None:
    """A floor driver: per stdin line of byte counts (one per connection), one step; prints its start and end."""
    links = [(TcpLink if kind == "tcp" else GrpcLink)(p) for p in ports]
    pool = ThreadPoolExecutor(max_workers=len(links)) if len(links) > 1 else None
    print("ready", flush=True)
    for line in sys.stdin:
        sizes = [int(x) for x in line.split()]
        t0 = now()
        if pool is None:
            links[0].step(sizes[0])
        else:
            list(pool.map(lambda ls: ls[0].step(ls[1]), zip(links, sizes)))
        print(t0, now(), flush=True)


# -------------------------------------------------------------------------------------------- the parent side
class Child:
    """A server or driver process of this script, spoken to line by line; it exits when its stdin closes."""

    def __init__(self, args: list[str], log_dir: Path, script: Path | None = None):
        self.log = tempfile.NamedTemporaryFile(dir=log_dir, prefix="floor-", suffix=".log", delete=False)
        script = (script or Path(__file__)).resolve()  # this file, or another floor's (trainer.tools.stepfloor)
        self.popen = subprocess.Popen([sys.executable, str(script), *args], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)

    def ask(self, line: str | None = None) -> str:
        if line is not None:
            self.popen.stdin.write(line + "\n")
            self.popen.stdin.flush()
        answer = self.popen.stdout.readline()
        if not answer:
            tail = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"a floor process ({' '.join(self.popen.args[2:])}) exited: " + " / ".join(tail))
        return answer.strip()

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self.log.close()


def split(nbytes: int, parts: int) -> list[int]:
    """``nbytes`` over ``parts`` connections, the remainder on the first ones."""
    return [nbytes // parts + (i < nbytes % parts) for i in range(parts)]


def setups(connections: list[int], processes: list[int]) -> list[tuple[int, str, int]]:
    """(M, transport, P) to measure: TCP and gRPC from one process, and gRPC from each P that divides M."""
    return [(m, t, p) for m in connections
            for t, p in [("tcp", 1), ("grpc", 1)] + [("grpc", p) for p in processes if 1 < p <= m and m % p == 0]]


def measure(byte_counts: dict[str, int], connections: list[int], processes: list[int], repeats: int,
            log_dir: Path) -> list[dict]:
    """Median step time of every (model bytes, M, transport, P); one warm-up step each is left out."""
    children: list[Child] = []
    rows = []
    try:
        servers = []
        for _ in range(max(connections)):
            children.append(Child(["serve"], log_dir))
            servers.append([int(x) for x in children[-1].ask().split()])
        for m, transport, p in setups(connections, processes):
            ports = [s[0 if transport == "tcp" else 1] for s in servers[:m]]
            drivers = []
            for k in range(p):
                children.append(Child(["drive", transport, *map(str, ports[k::p])], log_dir))
                drivers.append(children[-1])
            for d in drivers:
                d.ask()  # ready
            for model, nbytes in byte_counts.items():
                sizes = split(nbytes, m)
                times = [one_step(drivers, [sizes[k::p] for k in range(p)]) for _ in range(repeats + 1)][1:]
                step = statistics.median(times)
                rows.append(dict(model=model, bytes=nbytes, connections=m, transport=transport, processes=p,
                                 step_seconds=step, gb_per_sec=2 * nbytes / step / 1e9))
            for d in drivers:
                d.stop()
    finally:
        for c in children:
            c.stop()
    return rows


def one_step(drivers: list[Child], sizes: list[list[int]]) -> float:
    for d, s in zip(drivers, sizes):
        d.popen.stdin.write(" ".join(map(str, s)) + "\n")
        d.popen.stdin.flush()
    spans = [tuple(map(float, d.ask().split())) for d in drivers]
    return max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        drive(sys.argv[2], [int(p) for p in sys.argv[3:]])
