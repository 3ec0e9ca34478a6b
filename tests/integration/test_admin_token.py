"""A live re-shard's changes need the shard's admin token (issue 35 item 7): without it a Reshard (but STATUS) is
PERMISSION_DENIED naming the metadata key and what to do, the state digest unchanged and the shard serving; with
it the coordinator's PREPARE is taken.  On a real ``ps-server`` with no token given, the shard's own token is in
a file only its user reads, which ``ps-server reshard`` on the same host finds, and which goes when it stops."""

import os
import stat
from types import SimpleNamespace

import grpc
import torch

from psserver.protocol import admin_token
from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.security import ServerSecurity
from psserver.resharding.reshard_cmd import Coordinator
from tests.helpers import refused
from tests.integration.test_handoff_io import OLD_RANGES, Op, spec

JOB = spec()


def _shards(shard_server, token):
    shards = [shard_server(shard=i, lease_timeout=0, security=ServerSecurity(admin_token=token)) for i in range(2)]
    for i, (a, b) in enumerate(OLD_RANGES):
        shards[i].register(spec=JOB, expected_shard=i)
        h = shards[i].header(n=b - a, fingerprint=JOB.fingerprint)
        assert shards[i].stub.Init(encode(wire_tensor(torch.zeros(b - a), pb.FLOAT32), h, 1024), timeout=10).accepted
    return shards


def _prepare(shard, old, token=None):
    request = pb.ReshardRequest(op=Op.PREPARE, plan="p1", old_addresses=old, new_addresses=old[:1], you=old[0])
    metadata = ((admin_token.METADATA_KEY, token),) if token is not None else None
    return shard.stub.Reshard(request, timeout=10, metadata=metadata)


class _Digest:
    def __init__(self, shard):
        self.shard = shard

    def digest(self):
        return self.shard.digest(fingerprint=JOB.fingerprint)


def test_a_reshard_without_the_admin_token_is_permission_denied_and_changes_nothing(shard_server):
    shards = _shards(shard_server, "the-token")
    old = [s.server.address for s in shards]
    refused(lambda: _prepare(shards[0], old), grpc.StatusCode.PERMISSION_DENIED, "ps-admin-token is missing",
            "Reshard PREPARE only with its admin token", "--admin-token-file", unchanged=_Digest(shards[0]))
    refused(lambda: _prepare(shards[0], old, "a-guess"), grpc.StatusCode.PERMISSION_DENIED,
            "ps-admin-token is wrong", unchanged=_Digest(shards[0]))
    status = shards[0].stub.Reshard(pb.ReshardRequest(op=Op.STATUS, plan="p1"), timeout=10)
    assert list(status.handoffs) == []  # STATUS is a read: no token needed, and no plan was made
    assert shards[0].stats(fingerprint=JOB.fingerprint).counters["refused_PERMISSION_DENIED"] == 2
    # the coordinator with the token: its plan is taken on every shard
    coordinator = Coordinator(old, old[::-1], admin="the-token", say=lambda line: None)
    try:
        for address in coordinator.everyone:
            coordinator.call(address, Op.PREPARE)
        assert {r.plan for s in shards for r in s.stub.Reshard(
            pb.ReshardRequest(op=Op.STATUS, plan=coordinator.plan), timeout=10).handoffs} == {coordinator.plan}
    finally:
        coordinator.abort_everywhere()
        coordinator.close()


def test_a_shard_without_an_admin_token_takes_a_reshard_from_its_own_host_as_before(shard_server):
    """The library's servers (ServerConfig, as in-process tests and embedders make them) check a token only when
    given one; ``ps-server`` always has one (the next test)."""
    shards = _shards(shard_server, "")
    old = [s.server.address for s in shards]
    assert _prepare(shards[0], old).plan == "p1"
    shards[0].stub.Reshard(pb.ReshardRequest(op=Op.DECIDE, plan="p1", switch=False, old_addresses=old,
                                             new_addresses=old[:1], you=old[0]), timeout=10)


def test_ps_server_publishes_its_own_token_for_its_user_only_and_removes_it_when_it_stops(tmp_path):
    from trainer.local.procs import start_shard

    proc = start_shard(0, tmp_path / "shard.log",  # no operator token: the shard makes its own
                       env={"PS_ADMIN_TOKEN_DIR": str(tmp_path / "tokens"), "PS_ADMIN_TOKEN": ""})
    try:
        path = tmp_path / "tokens" / f"port-{proc.address.rpartition(':')[2]}"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
        token = path.read_text().strip()
        assert len(token) == 32 and token not in (tmp_path / "shard.log").read_text()  # never logged
        os.environ["PS_ADMIN_TOKEN_DIR"], saved = str(tmp_path / "tokens"), os.environ["PS_ADMIN_TOKEN_DIR"]
        try:
            assert admin_token.token_for(proc.address) == token
            assert admin_token.token_for("10.1.2.3:" + proc.address.rpartition(":")[2]) == ""  # never to another host
        finally:
            os.environ["PS_ADMIN_TOKEN_DIR"] = saved
    finally:
        proc.terminate()
    assert not path.exists()


def test_a_shard_with_a_hot_standby_refuses_a_live_reshard_naming_why_and_changes_nothing(shard_server):
    """A replicated shard (ps-server --etcd, docs/standby.md) cannot be re-sharded live yet: PREPARE, even with
    the admin token, is FAILED_PRECONDITION naming the standby, the state digest unchanged; STATUS still reads."""
    shards = _shards(shard_server, "the-token")
    old = [s.server.address for s in shards]
    # (what a primary's shipper is to the servicer: not None, with its gauges for GetStats)
    shards[0].server.service.replication = SimpleNamespace(gauges=lambda: {"replica_unreplicated": 1.0})
    refused(lambda: _prepare(shards[0], old, "the-token"), grpc.StatusCode.FAILED_PRECONDITION,
            "hot standby", "cannot be re-sharded live", unchanged=_Digest(shards[0]))
    assert list(shards[0].stub.Reshard(pb.ReshardRequest(op=Op.STATUS, plan="p1"), timeout=10).handoffs) == []
