"""The metrics port's HTTP server (``ps-server --metrics-port``), bounded in connections and in idle time.

Why not prometheus_client's ``start_http_server``: it serves every connection on a thread of its own, for as long
as the connection stays open, with no timeout -- 300 connections that each sent half a request line held 300
threads of the shard's process (docs/attacks-2026-11-25.md), and the port answers anyone who reaches it.  Here a
connection past ``max_connections`` is closed at once (counted, ``psgrpc_metrics_connections_refused_total``, and
logged at a bounded rate) and one that sends nothing for ``idle_seconds`` is closed by its thread; a scrape is one
request (HTTP/1.0), so a Prometheus needs one connection at a time.
"""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, make_wsgi_app

from psserver.common.logsafe import RateLimitedLog

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16  # scrapes served at once
IDLE_SECONDS = 10.0  # a connection that sends nothing this long is closed


class _Handler(WSGIRequestHandler):
    timeout = IDLE_SECONDS  # (socketserver sets it on the connection: a read that waits longer ends the request)

    def log_message(self, format, *args):  # noqa: A002 -- a scrape is not logged
        """Nothing: every scrape would be a log line."""


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread a connection, at most ``slots`` at once; past it a connection is closed at once and counted."""

    daemon_threads = True

    def setup_bounds(self, slots: int, refused: Counter) -> None:
        self._slots, self._refused = threading.BoundedSemaphore(slots), refused
        self._max, self._log = slots, RateLimitedLog(log)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self._refused.inc()
            self._log.warning("metrics:refused", "the metrics port already serves %d connections, its limit: a "
                              "connection from %s was closed", self._max, client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve(registry: CollectorRegistry, port: int, host: str, max_connections: int = MAX_CONNECTIONS,
          idle_seconds: float = IDLE_SECONDS) -> int:
    """Serve ``registry`` at http://host:port/metrics on a daemon thread; returns the bound port."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    handler = type("_IdleBoundHandler", (_Handler,), {"timeout": idle_seconds})
    server = type("_MetricsServer", (_BoundedServer,), {"address_family": family})((host, port), handler)
    refused = Counter("psgrpc_metrics_connections_refused", "Connections to the metrics port closed at once because "
                      "it served its limit of connections already.", registry=registry)
    server.setup_bounds(max_connections, refused)
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_port
