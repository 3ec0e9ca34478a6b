"""Shared fixtures: in-process shards on loopback and helpers for raw gRPC calls."""

from __future__ import annotations

import os
import tempfile

import grpc
import pytest
import torch

from psserver.protocol.codec import encode, wire_tensor
from psserver.protocol.job import JobSpec, OptimizerConfig
from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.serving.server import ServerConfig, ShardServer
from psserver.serving.service import ServiceLimits
from tests.procreg import process_registry  # noqa: F401 -- autouse: no test leaves a process behind

# One operator admin token for every ps-server and coordinator the tests start, as a cluster across hosts (or behind
# the tests' fault proxies, whose ports are not the shards') is run: each shard's own token is found by its port
# (psserver.protocol.admin_token; tests/integration/test_admin_token.py starts one without this token).  A shard
# that still makes its own writes it to a folder of this run, not the user's.  Inherited by every process.
os.environ.setdefault("PS_ADMIN_TOKEN", "psgrpc-tests-admin-token")
os.environ.setdefault("PS_ADMIN_TOKEN_DIR", tempfile.mkdtemp(prefix="psgrpc-admin-tokens-"))

P = 1000  # parameters in the test job


def make_spec(num_shards=1, mode="sync", num_trainers=1, **kw) -> JobSpec:
    return JobSpec(mode=mode, num_trainers=num_trainers, num_shards=num_shards, total_params=P,
                   fingerprint="f" * 16, optimizer=OptimizerConfig("sgd", lr=0.5, momentum=0.9),
                   tensors=(("w", (P,), "float32"),), **kw)


class RawShard:
    """A real shard on 127.0.0.1 and a raw stub to poke it with hand-made messages."""

    def __init__(self, server: ShardServer):
        self.server = server
        # A subchannel of its own: gRPC shares subchannels by address across a process's channels, and a port the
        # OS hands out again after an earlier test's shard stopped could still be in that shard's connect backoff
        # (an immediate UNAVAILABLE "Connection refused" from a shard that is in fact listening).
        self.channel = grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = pb_grpc.ParameterServerStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "RawShard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def register(self, rank=0, spec=None, expected_shard=0, trainer_id=None):
        spec = spec or make_spec()
        return self.stub.Register(pb.RegisterRequest(rank=rank, trainer_id=trainer_id or f"t{rank}",
                                                     expected_shard=expected_shard, job=spec.to_proto()), timeout=10)

    def header(self, rank=0, n=P, version=0, num_samples=4, dtype=pb.FLOAT32, fingerprint="f" * 16, trainer_id=None,
               sequence=0):
        return pb.ChunkHeader(rank=rank, trainer_id=trainer_id or f"t{rank}", fingerprint=fingerprint, dtype=dtype,
                              length=n, version=version, num_samples=num_samples, sequence=sequence)

    def init(self, values: torch.Tensor, rank=0, chunk_bytes=1024):
        h = self.header(rank=rank, n=values.numel())
        return self.stub.Init(encode(wire_tensor(values, pb.FLOAT32), h, chunk_bytes), timeout=10)

    def push(self, grad: torch.Tensor, chunk_bytes=1024, **header):
        h = self.header(n=header.pop("n", grad.numel()), **header)
        return self.stub.Push(encode(wire_tensor(grad, h.dtype), h, chunk_bytes), timeout=10)

    def push_chunks(self, chunks):
        return self.stub.Push(iter(chunks), timeout=10)

    def push_pull(self, grad: torch.Tensor, chunk_bytes=1024, **header):
        """PushPull: (reply header, weights) -- the header carries outcome, version and staleness."""
        h = self.header(n=header.pop("n", grad.numel()), **header)
        chunks = list(self.stub.PushPull(encode(wire_tensor(grad, h.dtype), h, chunk_bytes), timeout=10))
        data = b"".join(c.data for c in chunks)
        return chunks[0].header, torch.frombuffer(bytearray(data), dtype=torch.float32)

    def pull(self, rank=0, min_version=0, timeout=10):
        chunks = list(self.stub.Pull(pb.PullRequest(rank=rank, trainer_id=f"t{rank}", fingerprint="f" * 16,
                                                    min_version=min_version, dtype=pb.FLOAT32), timeout=timeout))
        data = b"".join(c.data for c in chunks)
        return chunks[0].header.version, torch.frombuffer(bytearray(data), dtype=torch.float32)

    def stats(self, digest=False, rank=0, trainer_id=None, fingerprint="f" * 16, partition=0):
        """GetStats of ``partition``; with ``digest``, the state digest too, asked as a member (rank 0 as
        ``register`` names it, by default): the shard refuses a digest to strangers."""
        return self.stub.GetStats(pb.StatsRequest(with_digest=digest, rank=rank, trainer_id=trainer_id or f"t{rank}",
                                                  fingerprint=fingerprint, partition=partition), timeout=10)

    def digest(self, **member) -> str:
        return self.stats(digest=True, **member).state_digest


@pytest.fixture
def shard_server():
    servers, raws = [], []

    def start(shard=0, **cfg) -> RawShard:
        # Small chunks let the tests tile a 1,000-element slice in several pieces; the default minimum
        # chunk size has a test of its own.
        cfg.setdefault("limits", ServiceLimits(min_chunk_bytes=256))
        s = ShardServer(ServerConfig(shard=shard, host="127.0.0.1", port=0, **cfg)).start()
        servers.append(s)
        raws.append(RawShard(s))
        return raws[-1]

    yield start
    for r in raws:
        r.close()
    for s in servers:
        s.stop(grace=0)


OPEN_ROUND_MAX_PUSH = 1 << 20  # the open-round shard's max_push_bytes


@pytest.fixture(scope="module")
def open_round_shard():
    """A sync job of 2 trainers on a real shard with round 0 open: both ranks registered, the parameters
    initialised to zeros, rank 0's push of ones accepted (rank 1 has not pushed).  One per test module, so its
    tests must leave the state as they found it: the refusal tests check exactly that (the open round is part
    of the hashed state).  Leases are off: one running out would close the round mid-test on its own."""
    server = ShardServer(ServerConfig(shard=0, host="127.0.0.1", port=0, max_push_bytes=OPEN_ROUND_MAX_PUSH,
                                      lease_timeout=0, limits=ServiceLimits(min_chunk_bytes=256))).start()
    shard = RawShard(server)
    try:
        spec = make_spec(num_trainers=2)
        shard.register(rank=0, spec=spec)
        shard.register(rank=1, spec=spec)
        shard.init(torch.zeros(P))
        assert shard.push(torch.ones(P), rank=0).outcome == pb.ACCEPTED
        yield shard
    finally:
        shard.close()
        server.stop(grace=0)
