"""The replication port under TLS (docs/standby.md): a standby of a shard with --tls-cert/--tls-key/--tls-client-ca
serves its port with the shard's certificate and takes shipments only from a replica presenting a certificate
signed by that CA (mutual TLS between replicas); a plaintext primary or one with a stranger's certificate gets
no state in, and what the standby holds is unchanged."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from psserver.protocol.admin_token import METADATA_KEY
from psserver.protocol.proto import replica_pb2 as _rpb
from psserver.protocol.security import ServerSecurity
from psserver.replication.shipper import open_channel
from psserver.replication.standby import StandbyServer, StandbyService

trustme = pytest.importorskip("trustme")
ADMIN = "operator-secret"


@pytest.fixture
def pki(tmp_path):
    """The replicas' CA with a certificate for each replica (127.0.0.1), and a stranger's CA and certificate."""
    ca, stranger = trustme.CA(), trustme.CA()
    files = {}
    for name, issuer in (("a", ca), ("b", ca), ("x", stranger)):
        cert = issuer.issue_cert("127.0.0.1", "localhost")
        for kind, blob in (("cert", cert.cert_chain_pems[0]), ("key", cert.private_key_pem)):
            files[f"{name}_{kind}"] = tmp_path / f"{name}.{kind}.pem"
            blob.write_to_path(str(files[f"{name}_{kind}"]))
    for name, issuer in (("ca", ca), ("stranger_ca", stranger)):
        files[name] = tmp_path / f"{name}.pem"
        issuer.cert_pem.write_to_path(str(files[name]))
    return {k: str(v) for k, v in files.items()}


def ship(address: str, credentials, shipment: int) -> None:
    async def go():
        channel, stub = open_channel(address, credentials)
        try:
            await stub.Ship(_rpb.ShipRequest(job="j", shard=0, epoch=1, shipment=shipment, primary="a",
                                             states=[f"state {shipment}".encode()]),
                            timeout=5, metadata=((METADATA_KEY, ADMIN),))
        finally:
            await channel.close()
    asyncio.run(go())


def test_the_replication_port_takes_shipments_only_over_mutual_tls_from_a_replica_of_the_shards_ca(pki):
    b = ServerSecurity(pki["b_cert"], pki["b_key"], pki["ca"], admin_token=ADMIN)
    service = StandbyService("j", 0, ADMIN)
    server = StandbyServer(service, "127.0.0.1", 0, credentials=b.credentials()).start()
    try:
        a = ServerSecurity(pki["a_cert"], pki["a_key"], pki["ca"], admin_token=ADMIN)
        ship(server.address, a.peer_credentials(), 1)
        assert service.held() == (1, [b"state 1"])
        stranger = ServerSecurity(pki["x_cert"], pki["x_key"], pki["stranger_ca"])
        strangers_trusting_us = ServerSecurity(pki["x_cert"], pki["x_key"], pki["ca"])
        for credentials in (None, stranger.peer_credentials(), strangers_trusting_us.peer_credentials()):
            with pytest.raises(grpc.aio.AioRpcError) as e:  # plaintext; a stranger; a stranger's cert trusting us
                ship(server.address, credentials, 2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert service.held() == (1, [b"state 1"]) and service.shipments == 1
    finally:
        server.stop()


def test_a_replica_with_tls_but_no_ca_to_verify_its_peer_is_refused_naming_the_flag(pki):
    with pytest.raises(ValueError, match="--tls-client-ca"):
        ServerSecurity(pki["a_cert"], pki["a_key"]).peer_credentials()
