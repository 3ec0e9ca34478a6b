"""The metrics port closes a connection whose request head has not arrived whole within ``request_seconds`` -- a
total deadline, not a time between reads (docs/design/attacks-2026-11-25.md, review follow-up)."""

from __future__ import annotations

import socket
import time

from prometheus_client import CollectorRegistry

from psserver.state import metrics_http
from tests.integration.test_step_attacks import CALL_TIMEOUT


def _trickle_until_closed(held: list[socket.socket]) -> None:
    """A byte of a request line that never ends on each connection, again and again (each well within the time a
    read may wait), until the server has closed every one; fails the test if it never does."""
    open_ = list(held)
    give_up = time.monotonic() + CALL_TIMEOUT
    while open_:
        assert time.monotonic() < give_up, f"{len(open_)} trickling connections still held after {CALL_TIMEOUT} s"
        for s in list(open_):
            try:
                s.sendall(b"G")
                s.settimeout(0.1)  # (paces the bytes: the server answers a closed connection at once)
                closed = s.recv(1) == b""
            except socket.timeout:
                closed = False
            except OSError:  # reset or broken pipe: closed by the server
                closed = True
            if closed:
                open_.remove(s)


def test_connections_that_trickle_a_byte_at_a_time_are_closed_and_a_scrape_is_served_after_them():
    """Before: the bound was a socket timeout, renewed by every byte: max_connections clients each sending a byte
    just under the idle time apart held every slot for as long as they liked, and every scrape was refused."""
    port = metrics_http.serve(CollectorRegistry(), 0, "127.0.0.1", max_connections=2, request_seconds=1.0)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        _trickle_until_closed(held)  # a slot is given back before its connection is closed
        with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            reply = b"".join(iter(lambda: s.recv(1 << 16), b""))
        assert reply.startswith(b"HTTP/1.0 200"), f"a scrape after the trickling connections closed got {reply[:40]!r}"
    finally:
        for s in held:
            s.close()


def _closed_at_once(s: socket.socket) -> bool:
    """Whether the server closed ``s`` without an answer (its request head was never sent)."""
    s.settimeout(CALL_TIMEOUT)
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def test_one_client_holds_at_most_its_share_of_the_connections_and_another_is_scraped_meanwhile():
    """Issue 35 item 8: 16 connections from one host, each renewed within its deadline, held every slot and 28
    of 40 scrapes from elsewhere failed.  Now one client address holds at most ``max_per_peer``: its next
    connection is closed at once (counted), and a scrape from another address (127.0.0.2: loopback too) is served
    while the first client's connections are held."""
    registry = CollectorRegistry()
    port = metrics_http.serve(registry, 0, "127.0.0.1", max_connections=4, request_seconds=30.0, max_per_peer=2)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        with socket.create_connection(("127.0.0.1", port)) as third:
            assert _closed_at_once(third)
        with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT, source_address=("127.0.0.2", 0)) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            reply = b"".join(iter(lambda: s.recv(1 << 16), b""))
        assert reply.startswith(b"HTTP/1.0 200"), reply[:40]
        assert b"psgrpc_metrics_connections_refused_total 1.0" in reply
    finally:
        for s in held:
            s.close()
