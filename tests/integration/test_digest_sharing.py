"""GetStats' state digest over gRPC (psserver.serving.digest_gate): callers asking together cost the state worker one
pass, not one each, and each still gets the digest of the state after it asked."""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from tests.conftest import P
from tests.helpers import wait_until

CALLERS = 10


def test_ten_digests_asked_while_the_state_worker_is_busy_run_at_most_two_passes_and_all_agree(shard_server):
    """Before: each caller's digest was a pass of its own on the state worker (10 callers, 10 passes)."""
    shard = shard_server(lease_timeout=0)
    shard.register()
    shard.init(torch.zeros(P))
    before = shard.digest()
    base = shard.stats().counters
    calls0, passes0 = base["state_digest_calls"], base["state_digests"]
    release = threading.Event()
    blocker = shard.server.runtime.state.submit(release.wait, 120)  # the worker busy, as with a big push
    try:
        with ThreadPoolExecutor(CALLERS) as pool:
            answers = [pool.submit(shard.digest) for _ in range(CALLERS)]
            wait_until(lambda: shard.stats().counters["state_digest_calls"] - calls0 == CALLERS,
                       "every caller's digest to be asked", timeout=60)
            release.set()
            assert [a.result(60) for a in answers] == [before] * CALLERS
    finally:
        release.set()
        blocker.result(60)
    counters = shard.stats().counters
    passes = counters["state_digests"] - passes0
    assert passes <= 2 and passes + counters["state_digests_shared"] == CALLERS
    assert shard.push(torch.ones(P)).outcome  # still serves
