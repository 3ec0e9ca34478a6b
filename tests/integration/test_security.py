"""TLS, mutual TLS and the shared token, over real gRPC on loopback."""

import logging

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.protocol.security import ClientSecurity, ServerSecurity
from psserver.serving.server import ServerConfig, ShardServer
from psserver.serving.service import ServiceLimits
from tests.conftest import make_spec
from tests.helpers import refused

trustme = pytest.importorskip("trustme")
TOKEN = "s3cret-token-value"


@pytest.fixture
def pki(tmp_path):
    """A server CA with a certificate for 127.0.0.1, a client CA with one client certificate, and a stranger CA."""
    files = {}
    server_ca, client_ca, stranger = trustme.CA(), trustme.CA(), trustme.CA()
    server = server_ca.issue_cert("127.0.0.1", "localhost")
    client = client_ca.issue_cert("trainer-0")
    for name, blob in {"ca": server_ca.cert_pem, "client_ca": client_ca.cert_pem, "stranger_ca": stranger.cert_pem,
                       "server_cert": server.cert_chain_pems[0], "server_key": server.private_key_pem,
                       "client_cert": client.cert_chain_pems[0], "client_key": client.private_key_pem}.items():
        files[name] = str(tmp_path / f"{name}.pem")
        blob.write_to_path(files[name])
    return files


@pytest.fixture
def start():
    servers = []

    def run(security: ServerSecurity, host="127.0.0.1") -> ShardServer:
        s = ShardServer(ServerConfig(shard=0, host=host, port=0, security=security,
                                                     limits=ServiceLimits(min_chunk_bytes=256))).start()
        servers.append(s)
        return s

    yield run
    for s in servers:
        s.stop(grace=0)


def register(channel: grpc.Channel):
    req = pb.RegisterRequest(rank=0, trainer_id="t0", expected_shard=0, job=make_spec().to_proto())
    return pb_grpc.ParameterServerStub(channel).Register(req, timeout=5)


def stats(channel):
    return pb_grpc.ParameterServerStub(channel).GetStats(pb.StatsRequest(), timeout=5)


def health(channel):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_tls_with_token(pki, start, caplog):
    server = start(ServerSecurity(pki["server_cert"], pki["server_key"], token=TOKEN))
    address = f"127.0.0.1:{server.port}"
    good = ClientSecurity(tls_ca=pki["ca"], token=TOKEN)
    assert register(good.channel(address)).shard == 0

    refused(lambda: register(grpc.insecure_channel(address)), grpc.StatusCode.UNAVAILABLE)  # plaintext: no connection

    before = stats(good.channel(address)).state_digest
    caplog.set_level(logging.DEBUG)
    for client in (ClientSecurity(tls_ca=pki["ca"]), ClientSecurity(tls_ca=pki["ca"], token="wrong")):
        refused(lambda: register(client.channel(address)), grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong auth token")
    assert stats(good.channel(address)).state_digest == before
    assert stats(good.channel(address)).counters["refused_UNAUTHENTICATED"] == 2
    assert TOKEN not in caplog.text and TOKEN not in repr(good) and TOKEN not in repr(server.cfg)

    # the health service answers without a token (probes carry no secrets)
    assert health(ClientSecurity(tls_ca=pki["ca"]).channel(address)) == health_pb2.HealthCheckResponse.SERVING


def test_a_shard_with_a_token_hashes_its_digest_for_any_caller_holding_the_token(start):
    """Every caller of a shard with a token proved itself: a digest needs no membership there."""
    server = start(ServerSecurity(token=TOKEN))
    channel = ClientSecurity(token=TOKEN).channel(f"127.0.0.1:{server.port}")
    register(channel)
    reply = pb_grpc.ParameterServerStub(channel).GetStats(pb.StatsRequest(with_digest=True), timeout=5)
    assert len(reply.state_digest) == 64


def test_wrong_ca_fails_the_handshake(pki, start):
    server = start(ServerSecurity(pki["server_cert"], pki["server_key"]))
    refused(lambda: health(ClientSecurity(tls_ca=pki["stranger_ca"]).channel(f"127.0.0.1:{server.port}")),
            grpc.StatusCode.UNAVAILABLE)


def test_mutual_tls_needs_a_client_certificate_from_the_client_ca(pki, start):
    server = start(ServerSecurity(pki["server_cert"], pki["server_key"], tls_client_ca=pki["client_ca"]))
    address = f"127.0.0.1:{server.port}"
    refused(lambda: register(ClientSecurity(tls_ca=pki["ca"]).channel(address)), grpc.StatusCode.UNAVAILABLE)
    mutual = ClientSecurity(tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"])
    assert register(mutual.channel(address)).shard == 0


def test_trainer_api_over_mutual_tls_with_token(pki, start):
    from trainer import connect
    from trainer.workloads.models import build_model

    server = start(ServerSecurity(pki["server_cert"], pki["server_key"], pki["client_ca"], token=TOKEN))
    model = build_model("mlp", (1, 28, 28))
    sec = ClientSecurity(pki["ca"], pki["client_cert"], pki["client_key"], token=TOKEN)
    before = model.fc1.weight.detach().clone()
    F = torch.nn.functional
    with connect(f"127.0.0.1:{server.port}", model, optimizer={"name": "sgd", "lr": 0.1}, security=sec) as ps:
        F.cross_entropy(model(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))).backward()
        assert ps.step(num_samples=8).versions == [1]
    assert not torch.equal(before, model.fc1.weight)


def test_listening_beyond_loopback_without_a_token_or_mutual_tls_is_refused_unless_insecure(start, caplog):
    with pytest.raises(ValueError, match="listens beyond loopback but no caller is authenticated"):
        start(ServerSecurity(), host="0.0.0.0")
    caplog.set_level(logging.WARNING)
    s = ShardServer(ServerConfig(shard=0, host="0.0.0.0", port=0, insecure=True,
                                 limits=ServiceLimits(min_chunk_bytes=256))).start()
    try:
        assert "beyond loopback with neither a token nor mutual TLS (--insecure)" in caplog.text
        with grpc.insecure_channel(f"127.0.0.1:{s.port}") as channel:
            assert stats(channel).shard == 0
    finally:
        s.stop(grace=0)
    caplog.clear()
    start(ServerSecurity(token=TOKEN), host="0.0.0.0")
    assert "beyond loopback" not in caplog.text


def test_half_configured_tls_is_a_clear_error():
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        ServerSecurity(tls_cert="a.pem")
    with pytest.raises(ValueError, match="needs --tls-ca"):
        ClientSecurity(tls_cert="c.pem", tls_key="k.pem")
