"""The metrics port's HTTP server (``ps-server --metrics-port``), bounded in connections and in idle time.

Why not prometheus_client's ``start_http_server``: it serves every connection on a thread of its own, for as long
as the connection stays open, with no timeout -- 300 connections that each sent half a request line held 300
threads of the shard's process (docs/design/attacks-2026-11-25.md), and the port answers anyone who reaches it.  Here a
connection past ``max_connections`` is closed at once (counted, ``psgrpc_metrics_connections_refused_total``, and
logged at a bounded rate) and one whose request head has not arrived whole within ``request_seconds`` is closed by
its thread -- a total deadline, not a time between reads: 16 clients each sending a byte every 9 s held every slot
under a per-read bound.  One client address holds at most ``max_per_peer`` of the connections: 16 connections
from one host, each renewed within its deadline, used to starve the scrapes of every other (28 of 40 failed).  A
scrape is one request (HTTP/1.0), so a Prometheus needs one connection at a time.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, make_wsgi_app

from psserver.common.logsafe import RateLimitedLog

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16  # scrapes served at once
MAX_PER_PEER = 4  # ... of them from one client address
REQUEST_SECONDS = 10.0  # a request's head arrives whole within this, and its reply is sent within it again


class _DeadlineReader(io.RawIOBase):
    """The connection's bytes, each read waiting at most what is left until ``deadline`` (time.monotonic)."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within its time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_SECONDS

    def setup(self) -> None:
        """Reads share one deadline: a socket timeout alone bounds each read, which a byte now and then renews."""
        super().setup()
        self.rfile.close()  # (makefile's reader: replaced, so the socket's close is not deferred by it)
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + self.timeout))

    def parse_request(self) -> bool:
        ok = super().parse_request()  # the head is read by now
        self.connection.settimeout(self.timeout)  # the reply: sent within the same time again
        return ok

    def handle(self) -> None:
        try:
            super().handle()
        except TimeoutError:  # the head did not arrive in time: closed without an answer (nor a traceback)
            self.close_connection = True

    def log_message(self, format, *args):  # noqa: A002 -- a scrape is not logged
        """Nothing: every scrape would be a log line."""


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread a connection, at most ``slots`` at once; past it a connection is closed at once and counted."""

    daemon_threads = True

    def setup_bounds(self, slots: int, refused: Counter, per_peer: int = MAX_PER_PEER) -> None:
        self._slots, self._refused = threading.BoundedSemaphore(slots), refused
        self._max, self._per_peer, self._log = slots, per_peer, RateLimitedLog(log)
        self._peers: dict[str, int] = {}  # client address -> connections it holds
        self._peers_lock = threading.Lock()

    def _take_peer(self, peer: str) -> bool:
        with self._peers_lock:
            if self._peers.get(peer, 0) >= self._per_peer:
                return False
            self._peers[peer] = self._peers.get(peer, 0) + 1
            return True

    def _give_peer(self, peer: str) -> None:
        with self._peers_lock:
            left = self._peers.get(peer, 1) - 1
            if left:
                self._peers[peer] = left
            else:
                self._peers.pop(peer, None)

    def process_request(self, request, client_address):
        peer = client_address[0]
        if not self._take_peer(peer):
            self._refused.inc()
            self._log.warning("metrics:refused_peer", "%s already holds %d connections to the metrics port, its "
                              "limit per client: one more was closed", peer, self._per_peer)
            self.shutdown_request(request)
            return
        if not self._slots.acquire(blocking=False):
            self._give_peer(peer)
            self._refused.inc()
            self._log.warning("metrics:refused", "the metrics port already serves %d connections, its limit: a "
                              "connection from %s was closed", self._max, peer)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._slots.release()
            self._give_peer(peer)
            raise

    def process_request_thread(self, request, client_address):
        """socketserver's, with the slot given back before the connection is closed: a client that sees its
        connection closed may connect again at once."""
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 -- as socketserver's: reported, the connection closed
            self.handle_error(request, client_address)
        finally:
            self._slots.release()
            self._give_peer(client_address[0])
            self.shutdown_request(request)


def serve(registry: CollectorRegistry, port: int, host: str, max_connections: int = MAX_CONNECTIONS,
          request_seconds: float = REQUEST_SECONDS, max_per_peer: int = MAX_PER_PEER) -> int:
    """Serve ``registry`` at http://host:port/metrics on a daemon thread; returns the bound port."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    handler = type("_TimeBoundHandler", (_Handler,), {"timeout": request_seconds})
    server = type("_MetricsServer", (_BoundedServer,), {"address_family": family})((host, port), handler)
    refused = Counter("psgrpc_metrics_connections_refused", "Connections to the metrics port closed at once because "
                      "it served its limit of connections already.", registry=registry)
    server.setup_bounds(max_connections, refused, max_per_peer)
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_port
