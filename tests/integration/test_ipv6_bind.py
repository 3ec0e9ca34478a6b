"""A real ``ps-server --host ::`` (IPv6 any): it binds, prints an address gRPC can dial, serves over IPv6 loopback,
and its health port binds too (issue 24 item 5: ``::`` was formatted ``:::PORT``, which gRPC reads as a host
without a port, so the shard could not start).  Skipped where the machine has no IPv6 loopback."""

import re
import socket

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.serving.ports import host_port
from tests.helpers import wait_until
from trainer import connect
from trainer.local.procs import start_shard


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


NO_IPV6 = pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")


def test_an_ipv6_literal_is_bracketed_in_host_port_and_other_hosts_are_not():
    assert host_port("::", 7000) == "[::]:7000"
    assert host_port("::1", 0) == "[::1]:0"
    assert host_port("[::1]", 7000) == "[::1]:7000"
    assert host_port("127.0.0.1", 7000) == "127.0.0.1:7000"
    assert host_port("shard-0.ps", 7000) == "shard-0.ps:7000"


@NO_IPV6
def test_ps_server_on_ipv6_any_prints_a_dialable_address_serves_stats_health_and_a_trainer_over_ipv6_loopback(
        tmp_path):
    log = tmp_path / "shard0.log"
    proc = start_shard(0, log, host="::", extra_args=["--insecure", "--health-port", "0"])
    try:
        assert re.fullmatch(r"\[::\]:\d+", proc.address), proc.address
        port = int(proc.address.rsplit(":", 1)[1])
        for address in (proc.address, f"[::1]:{port}"):
            with grpc.insecure_channel(address) as channel:
                reply = pb_grpc.ParameterServerStub(channel).GetStats(pb.StatsRequest(), timeout=10)
                assert reply.shard == 0
        line = wait_until(lambda: re.search(r"answers health checks on \[::\]:(\d+)", log.read_text()),
                          "the health port's log line")
        with grpc.insecure_channel(f"[::1]:{line.group(1)}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        model = torch.nn.Linear(4, 2)  # a trainer given the shard as --ps [::1]:PORT
        with connect(f"[::1]:{port}", model, mode="sync", rank=0, num_trainers=1,
                     optimizer={"name": "sgd", "lr": 0.1}, connect_timeout=60) as ps:
            ps.prepare_step(2)
            model(torch.randn(2, 4)).sum().backward()
            assert ps.step(num_samples=2).versions == [1]
        assert proc.terminate() == 0
    finally:
        proc.kill()
