"""psserver.serving.replies and the loop's watchdog (psserver.serving.health), without a network: the ledger of bytes held by
unread replies, the caps on connections and Watch streams, the stall window on a fake clock, a really blocked
loop, and ps-server's refusal to serve beyond loopback unauthenticated."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from psserver.protocol.errors import TooBusy
from psserver.protocol.security import ServerSecurity
from psserver.serving.health import LoopWatch, StallWindow
from psserver.serving.replies import Connections, OverReplyCap, ReplyLedger, TooManyConnections
from tests.helpers import wait_until

MIB = 1 << 20


# ---------------------------------------------------------------------------------------------- the ledger
def test_a_snapshot_streamed_by_many_pulls_is_counted_once_and_released_by_the_last():
    ledger = ReplyLedger(per_peer_cap=8 * MIB, shard_cap=8 * MIB)
    key = ("snapshot", 1234, 4 * MIB)
    holds = [ledger.hold(f"peer{i}", key, 4 * MIB) for i in range(5)]
    assert ledger.held_bytes == 4 * MIB and ledger.peer_bytes("peer3") == 4 * MIB
    for h in holds[:-1]:
        ledger.release(h)
    assert ledger.held_bytes == 4 * MIB
    ledger.release(holds[-1])
    assert ledger.held_bytes == 0 and ledger.peer_bytes("peer4") == 0


def test_a_connection_past_its_cap_is_refused_naming_the_cap_and_the_bytes_it_holds():
    ledger = ReplyLedger(per_peer_cap=6 * MIB, shard_cap=64 * MIB)
    ledger.hold("a", ("snapshot", 1), 4 * MIB)
    with pytest.raises(OverReplyCap, match=r"connection 'a' holds 4\.0 MiB of unread replies; 4\.0 MiB more would "
                                           r"pass the cap of 6\.0 MiB \(--max-reply-bytes-per-peer\)"):
        ledger.hold("a", ("snapshot", 2), 4 * MIB)
    assert ledger.held_bytes == 4 * MIB and ledger.peer_bytes("a") == 4 * MIB  # the refusal holds nothing
    ledger.hold("b", ("snapshot", 2), 4 * MIB)  # another connection has room of its own


def test_the_shard_past_its_cap_is_refused_naming_the_cap_and_the_bytes_held():
    ledger = ReplyLedger(per_peer_cap=64 * MIB, shard_cap=6 * MIB)
    ledger.hold("a", ("snapshot", 1), 4 * MIB)
    with pytest.raises(OverReplyCap, match=r"the shard holds 4\.0 MiB of unread replies; 4\.0 MiB more would pass "
                                           r"the cap of 6\.0 MiB \(--max-reply-bytes\)") as e:
        ledger.hold("b", ("snapshot", 2), 4 * MIB)
    assert e.value.code.name == "RESOURCE_EXHAUSTED"
    ledger.hold("b", ("snapshot", 1), 4 * MIB)  # the buffer already held costs nothing more


def test_one_reply_larger_than_both_caps_is_allowed_when_nothing_else_is_held():
    ledger = ReplyLedger(per_peer_cap=MIB, shard_cap=MIB)
    h = ledger.hold("a", ("rows", 1), 10 * MIB)
    assert ledger.held_bytes == 10 * MIB
    ledger.release(h)
    assert ledger.held_bytes == 0


def test_bytes_gRPC_still_holds_after_a_cut_are_counted_past_the_caps():
    ledger = ReplyLedger(per_peer_cap=MIB, shard_cap=MIB)
    ledger.hold("a", ("snapshot", 1), MIB)
    ledger.hold("a", ("in-flight", 7), 64 << 10, force=True)
    assert ledger.held_bytes == MIB + (64 << 10)


# ---------------------------------------------------------------------------------------------- connections
def test_calls_past_the_connection_cap_are_refused_and_counted():
    counted = []
    conns = Connections(max_calls_per_peer=2, max_connections=2, max_watch_streams=8, count=counted.append)
    with conns.call("a"), conns.call("a"), conns.call("b"):
        with pytest.raises(TooBusy, match="connection 'a' already has 2 calls in flight, the limit is 2"):
            with conns.call("a"):
                pass
        with pytest.raises(TooManyConnections, match=r"2 connections have calls in flight, the limit is 2 "
                                                     r"\(--max-connections\)"):
            with conns.call("c"):
                pass
        with conns.call("b"):  # a connection already counted may add calls up to its own cap
            pass
    assert counted == ["refused_over_limit", "refused_connections"]
    assert conns.calls == {}
    with conns.call("c"):
        assert conns.calls == {"c": 1}


def test_watch_streams_past_their_cap_are_refused_and_count_as_calls_of_their_connection():
    counted = []
    conns = Connections(max_calls_per_peer=3, max_connections=8, max_watch_streams=2, count=counted.append)
    with conns.watch("a"), conns.watch("b"):
        assert conns.watch_streams == 2 and conns.calls == {"a": 1, "b": 1}
        with pytest.raises(TooBusy, match=r"2 health Watch streams are open, the limit is 2 \(--max-watch-streams\)"):
            with conns.watch("c"):
                pass
    assert counted == ["refused_watch_streams"] and conns.watch_streams == 0 and conns.calls == {}


# ---------------------------------------------------------------------------------------------- the watchdog
def test_the_stall_window_keeps_the_longest_stall_for_one_to_two_windows():
    w = StallWindow(window=10.0)
    w.observe(0.01, now=0.0)
    w.observe(2.5, now=3.0)
    w.observe(0.02, now=4.0)
    assert w.longest(now=9.0) == 2.5
    w.observe(0.01, now=12.0)  # the next window: the last one's longest is still shown
    assert w.longest(now=15.0) == 2.5
    w.observe(0.01, now=21.0)  # two windows on: forgotten, but not from the worst
    assert w.longest(now=21.0) == 0.01 and w.worst == 2.5
    assert w.longest(now=60.0) == 0.0  # a read long after the last tick shows nothing recent


def test_the_watchdog_sees_a_blocked_event_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        ticks = []
        watch = LoopWatch(loop, ticks.append)
        wait_until(lambda: len(ticks) >= 3, "the watchdog to tick")
        assert watch.gauges()["loop_stall_worst_seconds"] < 0.4  # nothing has blocked the loop for that long
        loop.call_soon_threadsafe(time.sleep, 0.5)  # a callback that holds the loop, as inline tensor work would
        # At least 0.5 s minus one tick period late, however loaded the machine (a load only adds lateness).
        wait_until(lambda: watch.gauges()["loop_stall_seconds"] >= 0.4, "the watchdog to record the stall")
        wait_until(lambda: watch.stalls.worst >= 0.4, "the stall to be observed by a tick, not only pending")
        watch.stop()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


# ---------------------------------------------------------------------------------------------- --insecure
@pytest.mark.parametrize("security", [ServerSecurity(), ServerSecurity(tls_cert="s.pem", tls_key="s.key")],
                         ids=["nothing", "server-TLS only"])
def test_a_shard_beyond_loopback_without_a_token_or_mutual_tls_is_refused_unless_insecure(security, caplog):
    with pytest.raises(ValueError, match=r"--host 0\.0\.0\.0 listens beyond loopback but no caller is "
                                         r"authenticated: give --auth-token-file .* or --insecure"):
        security.check_exposed("0.0.0.0", insecure=False)
    security.check_exposed("0.0.0.0", insecure=True)
    assert "beyond loopback with neither a token nor mutual TLS (--insecure)" in caplog.text
    security.check_exposed("127.0.0.1", insecure=False)
    ServerSecurity(token="t").check_exposed("0.0.0.0", insecure=False)
    ServerSecurity("s.pem", "s.key", "ca.pem").check_exposed("10.0.0.5", insecure=False)


def test_ps_server_beyond_loopback_without_a_token_exits_with_one_line_and_a_hint(capsys, monkeypatch):
    from psserver.cli import main
    from psserver.common.cli_support import run_cli

    for env in ("PS_AUTH_TOKEN", "PS_SERVER_INSECURE", "PS_SERVER_AUTH_TOKEN_FILE", "PS_SERVER_HOST"):
        monkeypatch.delenv(env, raising=False)
    import psserver.serving.server

    def serve_nothing(self):  # had the shard got this far it would serve: fail at once rather than wait for a signal
        raise AssertionError("ps-server started a shard beyond loopback without a token or --insecure")

    monkeypatch.setattr(psserver.serving.server.ShardServer, "start", serve_nothing)
    with pytest.raises(SystemExit) as e:
        run_cli("ps-server", lambda: main(["--shard", "0", "--host", "0.0.0.0", "--port", "0"]))
    assert e.value.code == 2  # a command-line mistake, as argparse's own (ServerConfig checks it)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("ps-server: error: --host 0.0.0.0 listens beyond loopback") and "--insecure" in err[0]
    assert err[1].startswith("hint:") and len(err) == 2
