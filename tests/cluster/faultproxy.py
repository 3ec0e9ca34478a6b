"""A small fault-injecting TCP proxy for tests: delays, resets and drops connections on purpose.

Each accepted connection gets a byte budget drawn from a seeded RNG; when the
bytes forwarded (either way) pass it, the proxy resets both sides (RST, via
SO_LINGER 0) or just closes them (drop).  Optional per-chunk delay.  Faults
are bounded by ``max_faults`` so a test always terminates.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time


def shut_down(*sockets: socket.socket) -> None:
    """Shut both directions of each socket down (the peer sees the end); already-closed ones are skipped."""
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def dial(target: tuple[str, int], client: socket.socket) -> socket.socket | None:
    """A connection to ``target`` for an accepted ``client``; None (and the client closed) if it is down."""
    try:
        return socket.create_connection(target)
    except OSError:
        client.close()
        return None


class FaultProxy:
    def __init__(self, target: str, seed: int, mean_bytes_between_faults: int = 200_000, max_faults: int = 50,
                 max_delay: float = 0.0):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.rng = random.Random(seed)
        self.mean = mean_bytes_between_faults
        self.max_faults = max_faults
        self.max_delay = max_delay
        self.faults = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = dial(self.target, client)
            if upstream is None:
                continue
            with self._lock:
                self.connections += 1
                budget = int(self.rng.expovariate(1 / self.mean)) if self.faults < self.max_faults else None
                kind = self.rng.choice(["reset", "drop"])
            conn = dict(budget=budget, sent=0, kind=kind, closed=False)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b, client, upstream, conn), daemon=True).start()

    def _pump(self, src, dst, client, upstream, conn) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self.max_delay:
                    time.sleep(self.rng.uniform(0, self.max_delay))  # injected latency
                with self._lock:
                    conn["sent"] += len(data)
                    fault = conn["budget"] is not None and conn["sent"] > conn["budget"] and not conn["closed"]
                    if fault:
                        conn["closed"] = True
                        self.faults += 1
                if fault:
                    self._kill(client, upstream, conn["kind"])
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            shut_down(src, dst)

    @staticmethod
    def _kill(client, upstream, kind: str) -> None:
        for s in (client, upstream):
            if kind == "reset":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            try:
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
