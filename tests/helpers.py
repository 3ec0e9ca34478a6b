"""What many tests do the same way: a call refused over gRPC, a condition that comes true in its own time, and
trainers run as threads of the test.  (The shared fixtures -- a shard on loopback, the sync job with an open round -- are in conftest.py;
real processes for cluster tests in tests/cluster/helpers.py.)"""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

import grpc
import pytest

T = TypeVar("T")

# Long enough that on a loaded 2-core machine it runs out only when the condition will never hold; a test that
# waits on something slower (a training run) passes its own.
WAIT_TIMEOUT = 120.0


def refused(call: Callable[[], object], code: grpc.StatusCode, *fragments: str, unchanged=None) -> grpc.RpcError:
    """``call()`` fails with gRPC status ``code`` and a message that holds every one of ``fragments``; returns the
    error.  With ``unchanged`` (a shard with a ``digest()``, tests/conftest.py's RawShard), the shard's state
    digest is also the same after the refusal as before it."""
    before = unchanged.digest() if unchanged is not None else None
    with pytest.raises(grpc.RpcError) as e:
        call()
    error = e.value
    details = error.details() or ""
    assert error.code() == code, f"expected {code.name}, got {error.code().name}: {details!r}"
    assert details, f"a {code.name} refusal without a message: every refusal says why"
    missing = [f for f in fragments if f not in details]
    assert not missing, f"{missing} not in the {code.name} message {details!r}"
    if unchanged is not None:
        assert unchanged.digest() == before, f"the refused call changed the shard's state ({details!r})"
    return error


def wait_until(condition: Callable[[], T], what: str, timeout: float = WAIT_TIMEOUT) -> T:
    """Check ``condition()`` until it returns something truthy, and return that; after ``timeout`` s fail the test
    naming ``what`` it waited for (e.g. "rank 0 to register"), instead of hanging.

    For states a test cannot be told about (a metrics file's last step, a shard's counter, a thread blocked in a
    wait).  The pauses between checks (5 ms, growing to 100 ms) only pace the checking: the test goes on as soon
    as the condition holds, never after a fixed time."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


def run_ranks(trainer: Callable[[int], object], ranks: int, timeout: float | None = WAIT_TIMEOUT) -> None:
    """``trainer(rank)`` for every rank, each in a thread of its own; waits for all (each up to ``timeout`` s) and
    fails the test with the first error any raised, or naming a thread still running."""
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            trainer(rank)
        except BaseException as e:  # noqa: BLE001 -- reported in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"{alive} did not finish within {timeout} s"
