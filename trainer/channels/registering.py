"""Registering with a shard: waiting for it to answer, a join's wait for a job, and when to give up.

``Registrar`` is a collaborator of ``ShardClient`` (trainer.channels.client), handed the stub it calls, the ``Caller``
its requests and messages name and the ``RetriedCalls`` it counts and learns the layout through.  It is its own
because connecting is the one call whose failures are waited out against ``--connect-timeout`` rather than a retry
budget, with its own errors (ShardUnreachable, NoJobToJoin, JobEnded, ConnectAbandoned) and its own pacing and log
lines.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

import grpc

from psserver.protocol.job import JobSpec
from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.rules import refused_job_ended, refused_join_backoff, refused_no_job
from trainer.channels.call_retry import Caller, RetriedCalls

log = logging.getLogger("trainer.channels.client")  # the client's lines, as before the split (trainer.running.cli sets its level)

CONNECT_ATTEMPT_SECONDS = 3.0  # one Register attempt; a shard that never answers is reported after this
CONNECT_RETRY_PAUSE = 0.5  # between Register attempts to a shard that refused
WAIT_LOG_SECONDS = 5.0  # while connecting or waiting for peers, say what is awaited this often
# Every address on loopback and refused this long in a row: a wrong port, not a shard starting late on another
# host -- give up with the usual error instead of waiting out --connect-timeout.  Long enough for a shard started
# beside the trainer on a loaded machine to come up (24-40 s measured at load 3-6, 2026-12-01; it was 5 s).
LOOPBACK_REFUSED_SECONDS = 60.0
LOOPBACK_HOSTS = ("localhost", "127.", "[::1]", "::1")


def on_loopback(addresses: Sequence[str]) -> bool:
    """Whether every address is on this host's loopback."""
    return all(a.startswith(LOOPBACK_HOSTS) for a in addresses)


class ShardUnreachable(ConnectionError):
    """A shard did not answer within the connect timeout; the message names it and its address."""


class RefusalClock:
    """How long a shard has refused connections in a row; ``exhausted`` once that passes ``limit`` (None: never)."""

    def __init__(self, limit: float | None):
        self.limit, self.since = limit, None

    def exhausted(self, cause: str, now: float) -> bool:
        if self.limit is None or not cause.endswith("connection refused"):
            self.since = None  # it answered, or timed out: a shard that is there but slow is waited for
            return False
        self.since = now if self.since is None else self.since
        return now - self.since >= self.limit


class ConnectAbandoned(ConnectionError):
    """Registering was given up because the caller was interrupted (Registrar.register's ``abandon``)."""


class NoJobToJoin(ConnectionError):
    """A joiner waited ``--connect-timeout`` and the shard still ran no job: rank 0 never registered."""


class JobEnded(NoJobToJoin):
    """A joiner found the job ended (every trainer left): nothing to join, and nothing will be (ps-trainer
    exits 0 with this message: a Deployment's replicas that outlive rank 0's Job complete, not crash-loop)."""


CONNECT_RETRY, JOIN_WAIT = "connect_retries", "join_waits"  # what a Register attempt is retried for (counters)
JOIN_BACKOFF = "join_backoff_waits"  # ... a join's admission held back while its host's strikes last
JOB_OVER = "job_ended"  # register_retry's answer for a join to a job that ended: not retried, JobEnded raised


def register_retry(error: grpc.RpcError, join: bool, join_round: int) -> str:
    """Whether a failed Register attempt is tried again, and counted as what: ``CONNECT_RETRY`` (the shard is
    not answering yet), ``JOIN_WAIT`` (a join's admission reached a shard that runs no job yet: the joiner
    started before rank 0 registered the job, as a scaled service's replicas may), ``JOB_OVER`` (a join's
    admission found the job ended: raise JobEnded, not retried), or '' (raise it).
    A commit (``join_round`` > 0) that finds no job is not waited out: that shard restarted empty since
    admitting it, and the joiner leaves and joins again (docs/design/elastic-join.md)."""
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CONNECT_RETRY
    if join and join_round == 0 and refused_no_job(error):
        return JOIN_WAIT
    if join and join_round == 0 and refused_join_backoff(error):
        return JOIN_BACKOFF
    if join and join_round == 0 and refused_job_ended(error):
        return JOB_OVER
    return ""


def _connect_cause(e: grpc.RpcError) -> str:
    """A short reason for a failed connection attempt ("connection refused", "no reply within 3 s")."""
    details = e.details() or ""
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no reply within {CONNECT_ATTEMPT_SECONDS:g} s"
    for known in ("Connection refused", "No route to host", "Name or service not known", "DNS resolution failed",
                  "Connection reset by peer", "Socket closed"):
        if known.lower() in details.lower():
            return f"UNAVAILABLE: {known.lower()}"
    return f"UNAVAILABLE: {details[:200]}"


def _give_up_if_due(where: str, retry: str, cause: str, now: float, give_up: float, connect_timeout: float,
                    refusals: RefusalClock) -> None:
    """Raise once ``--connect-timeout`` has passed (or a loopback shard refused connections too long);
    ``where``: "shard I at ADDRESS"."""
    if now >= give_up and retry == JOIN_BACKOFF:
        raise ConnectionError(f"{where} still held this host's joins back after {connect_timeout:g} s "
                              f"(--connect-timeout): {cause}")
    if now >= give_up and retry == JOIN_WAIT:
        raise NoJobToJoin(f"{where} still ran no job to join after "
                          f"{connect_timeout:g} s (--connect-timeout): start the job's rank 0 (ps-trainer "
                          f"--rank 0, no --join), or give the joiner a longer --connect-timeout")
    if now >= give_up:
        raise ShardUnreachable(f"{where} did not answer within "
                               f"{connect_timeout:g} s (--connect-timeout): {cause}") from None
    if refusals.exhausted(cause, now):  # a join's wait is an answer: it resets the clock
        raise ShardUnreachable(
            f"{where} did not answer within {refusals.limit:g} s (every "
            f"address is on loopback and it refuses connections: check the port, or start the shard "
            f"first; --connect-timeout waits only for remote shards or ones that answer): {cause}"
        ) from None


class Registrar:
    """``register``: Register retried until the shard answers, a join's job exists, or the timeout passes."""

    def __init__(self, stub, caller: Caller, calls: RetriedCalls):
        self.stub, self.caller, self.calls = stub, caller, calls

    def register(self, job: JobSpec, connect_timeout: float, abandon: threading.Event | None = None,
                 refused_limit: float | None = None, join: bool = False, join_round: int = 0,
                 join_confirm: bool = False, named_timeout: float | None = None) -> _pb.RegisterReply:
        """Register with the shard, waiting up to ``connect_timeout`` for it to answer.

        Each attempt fails fast (no wait_for_ready) and has a short deadline, so an
        address that refuses connections or never answers is logged by shard and
        address within seconds, not after the whole timeout; a shard still starting
        is waited for.  Giving up raises ShardUnreachable naming the address.
        ``abandon``, once set, ends the retries (ConnectAbandoned): the caller was
        interrupted and must know no attempt is left that could register it later.
        ``refused_limit``: give up once the connection has been refused this many seconds in a row (the caller
        passes it when every address is on loopback: a wrong port, not a shard that is late).
        ``join``/``join_round``: a join's admission (0) or commit (trainer.membership.session.Session.join_running), and
        with ``join_confirm`` its confirm.  An
        admission that finds no job yet waits for it within the same timeout (``register_retry``), so joiners
        may start before the job's rank 0; still none then raises NoJobToJoin.
        ``named_timeout``: the --connect-timeout the messages name (default ``connect_timeout``): a caller that
        passes what is left of it (a later attempt of one connect) still names the user's setting.
        """
        c = self.caller
        req = _pb.RegisterRequest(rank=c.rank, trainer_id=c.trainer_id, expected_shard=c.index,
                                  job=job.to_proto(), partition=c.partition, join=join, join_round=join_round,
                                  join_confirm=join_confirm, layout_epoch=c.layout_epoch, follows_layouts=True)
        give_up = time.monotonic() + connect_timeout
        next_log = 0.0
        abandon = abandon or threading.Event()
        refusals = RefusalClock(refused_limit if refused_limit is not None and refused_limit < connect_timeout
                                else None)
        while True:
            if abandon.is_set():
                raise ConnectAbandoned(f"{c.name} at {c.address}: registering was abandoned")
            left = give_up - time.monotonic()
            try:
                reply = self.stub.Register(req, timeout=max(0.01, min(left, CONNECT_ATTEMPT_SECONDS)))
                self.calls.saw_layout(getattr(reply, "layout_epoch", 0))  # (a stand-in stub's reply may carry none)
                return reply
            except grpc.RpcError as e:
                retry = register_retry(e, join, join_round)
                if retry == JOB_OVER:
                    self.calls.count(JOB_OVER)
                    raise JobEnded(f"shard {c.index} at {c.address}: {e.details()}") from None
                if not retry:
                    raise
                cause = _connect_cause(e) if retry == CONNECT_RETRY else e.details()
                now = time.monotonic()
                _give_up_if_due(f"shard {c.index} at {c.address}", retry, cause, now, give_up,
                                connect_timeout if named_timeout is None else named_timeout, refusals)
                self.calls.count(retry)
                if now >= next_log:
                    left = give_up - now
                    if refusals.since is not None:  # refused in a row on loopback: given up sooner than that
                        left = min(left, refusals.limit - (now - refusals.since))
                    self._say_waiting(retry, cause, left)
                    next_log = now + WAIT_LOG_SECONDS
                if abandon.wait(min(CONNECT_RETRY_PAUSE, max(0.0, give_up - now))):  # the pause between attempts
                    raise ConnectAbandoned(f"{c.name} at {c.address}: registering was abandoned")

    def _say_waiting(self, retry: str, cause: str, left: float) -> None:
        """The line ``register`` logs every ``WAIT_LOG_SECONDS`` while it waits: what for, and how much longer."""
        index, address = self.caller.index, self.caller.address
        if retry == JOIN_WAIT:
            log.warning("shard %d at %s runs no job yet: waiting for the job's rank 0 to register it; "
                        "still trying for %.0f s", index, address, left)
        elif retry == JOIN_BACKOFF:
            log.warning("shard %d at %s holds this host's joins back (%s); still trying for %.0f s", index,
                        address, cause, left)
        else:
            log.warning("shard %d at %s is not answering yet (%s); still trying for %.0f s",
                        index, address, cause, left)
