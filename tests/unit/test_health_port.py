"""The health port's answer follows the shard's status and its event loop's liveness (no network, no clock)."""

from grpc_health.v1 import health_pb2

from psserver.serving.health import _WatchedHealth

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REQUEST = health_pb2.HealthCheckRequest(service="")


class Shared:
    """Stands in for the two numbers the shard shares with the probe process."""

    def __init__(self):
        self.serving, self.stalled = True, 0.0


def servicer(shared: Shared) -> _WatchedHealth:
    return _WatchedHealth(lambda: shared.serving, lambda: shared.stalled, stall_seconds=10.0)


def test_a_stalled_event_loop_reads_as_not_serving_and_a_ticking_one_as_serving():
    shared = Shared()
    s = servicer(shared)
    assert s.Check(REQUEST, None).status == SERVING
    shared.stalled = 10.5  # the loop has not run for longer than the limit: a hung shard, not a busy one
    assert s.Check(REQUEST, None).status == NOT_SERVING
    shared.stalled = 0.1
    assert s.Check(REQUEST, None).status == SERVING


def test_a_stopping_shard_is_not_serving_whatever_its_loop_does():
    shared = Shared()
    shared.serving = False
    assert servicer(shared).Check(REQUEST, None).status == NOT_SERVING
