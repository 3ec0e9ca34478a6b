"""A real ``ps-server --restore`` of a process a live re-shard drained (issue 24 item 1): it comes back drained and
retired (docs/design/handoff-io.md#draining-a-shard-and-retire), not serving the job's first layout at R again -- GetStats
says so, a Register of the old job is refused ``layout-moved`` naming the newest layout, and it still serves."""

import grpc

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.protocol.rules import refused_layout_moved
from tests.helpers import refused
from tests.unit.test_layout_checkpoints import drained_host
from tests.unit.test_layout_host import JOB
from trainer.local.procs import start_shard


def test_a_drained_process_restarted_with_restore_is_retired_and_refuses_the_old_job_layout_moved(tmp_path):
    drained_host(tmp_path / "ckpt")  # layout 0's files at R = 2 and the drain's record
    proc = start_shard(0, tmp_path / "shard0.log", extra_args=["--checkpoint-dir", str(tmp_path / "ckpt"),
                                                               "--restore"])
    try:
        with grpc.insecure_channel(proc.address) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            stats = stub.GetStats(pb.StatsRequest(), timeout=30)
            assert (stats.drained, stats.initialized, stats.version) == ("retired", False, 0)
            request = pb.RegisterRequest(rank=0, trainer_id="t0", expected_shard=0, job=JOB.to_proto())
            e = refused(lambda: stub.Register(request, timeout=30), grpc.StatusCode.FAILED_PRECONDITION,
                        "layout_epoch is 0", "restarted in layout 1", "holds nothing of layout 0")
            assert refused_layout_moved(e) == 1
            again = stub.GetStats(pb.StatsRequest(), timeout=30)  # it still serves, holding nothing
            assert (again.drained, again.initialized, again.version) == ("retired", False, 0)
            assert again.counters["refused_FAILED_PRECONDITION"] == 1
        assert "restored drained from layout 1" in proc.log_tail(40)
        assert proc.terminate() == 0
    finally:
        proc.kill()
