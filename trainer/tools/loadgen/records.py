"""The records a measurement is made of, named: what the client processes send back and the summaries read."""

from __future__ import annotations

from typing import NamedTuple


class Step(NamedTuple):
    """One completed PushPull of a simulated trainer."""

    base: int  # the version its gradient was computed on
    t0: float  # monotonic time sent
    t1: float  # monotonic time its reply's header arrived
    version: int  # the reply's version
    outcome: int  # the reply's PushOutcome


class CallError(NamedTuple):
    """A failed call (then retried)."""

    at: float  # monotonic time
    code: str  # gRPC status code name


class Probe(NamedTuple):
    """One health check."""

    sent_at: float  # monotonic time
    seconds: float  # until the answer (or the failure)
    code: str  # "OK", "NOT_SERVING" or a gRPC status code name
