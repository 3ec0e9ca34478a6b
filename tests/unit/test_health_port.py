"""The health port's answer follows the event loop's liveness (a fake clock; no network for the rule)."""

from grpc_health.v1 import health_pb2

from psserver.health import _WatchedHealth

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FakeWatch:
    def __init__(self):
        self.stalled = 0.0

    def stalled_for(self) -> float:
        return self.stalled


def test_a_stalled_event_loop_reads_as_not_serving_and_a_ticking_one_as_serving():
    watch = FakeWatch()
    servicer = _WatchedHealth(watch, stall_seconds=10.0)
    servicer.set("", SERVING)
    request = health_pb2.HealthCheckRequest(service="")
    assert servicer.Check(request, None).status == SERVING
    watch.stalled = 10.5  # the loop has not run for longer than the limit: a hung shard, not a busy one
    assert servicer.Check(request, None).status == NOT_SERVING
    watch.stalled = 0.1
    assert servicer.Check(request, None).status == SERVING


def test_a_shutting_down_shard_is_not_serving_whatever_the_loop_does():
    servicer = _WatchedHealth(FakeWatch(), stall_seconds=10.0)
    servicer.set("", SERVING)
    servicer.enter_graceful_shutdown()
    assert servicer.Check(health_pb2.HealthCheckRequest(service=""), None).status == NOT_SERVING
