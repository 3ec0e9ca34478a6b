"""A TCP proxy whose faults a test switches on and off at exact moments (no randomness).

``swallow_replies()``: requests still reach the shard, but no byte of its answers reaches the
trainer -- a push is applied and its acknowledgement lost.  ``refuse()``: every connection is
closed at once, as if the shard were down.  ``forward()``: back to normal; connections that lost
bytes are reset first (an HTTP/2 stream with a hole in it cannot be resumed).
"""

from __future__ import annotations

import socket
import threading

from tests.cluster.faultproxy import dial, shut_down


class SwitchProxy:
    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.mode = "forward"
        self.connections = 0
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def forward(self) -> None:
        with self._lock:
            damaged = self.mode == "swallow"
            self.mode = "forward"
        if damaged:
            self.reset()

    def swallow_replies(self) -> None:
        self.mode = "swallow"

    def refuse(self) -> None:
        self.mode = "refuse"
        self.reset()

    def reset(self) -> None:
        """Close every open connection (both sides)."""
        with self._lock:
            sockets, self._open = self._open, []
        shut_down(*sockets)
        for s in sockets:
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.mode == "refuse":
                client.close()
                continue
            upstream = dial(self.target, client)
            if upstream is None:
                continue
            with self._lock:
                self.connections += 1
                self._open += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, is_reply: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if is_reply and self.mode == "swallow":
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            shut_down(src, dst)

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self.listener.close()
        self.reset()
        self._thread.join(timeout=10)
