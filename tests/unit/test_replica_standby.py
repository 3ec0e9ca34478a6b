"""The standby's side (psserver.replication.standby): a shipment is taken only with the operator's admin token
and only from the newest epoch seen; every refusal leaves the state it holds as it was."""

from __future__ import annotations

import grpc
import pytest

from psserver.protocol.admin_token import METADATA_KEY
from psserver.protocol.proto import replica_pb2 as _rpb
from psserver.replication.standby import StandbyService


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self, token: str | None):
        self.metadata = ((METADATA_KEY, token),) if token is not None else ()
        self.code = self.details = None

    def invocation_metadata(self):
        return self.metadata

    def set_trailing_metadata(self, pairs):
        pass

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted


def ship(service, epoch, token="secret", states=(b"state",), job="j"):
    return service.Ship(_rpb.ShipRequest(job=job, shard=0, epoch=epoch, shipment=1, primary="a", states=states),
                        FakeContext(token))


@pytest.mark.parametrize("token, word", [(None, "missing"), ("guess", "wrong")])
def test_a_shipment_without_the_admin_token_is_permission_denied_and_changes_nothing(token, word):
    service = StandbyService("j", 0, "secret")
    ship(service, 1, states=(b"one",))
    context = FakeContext(token)
    with pytest.raises(Aborted):
        service.Ship(_rpb.ShipRequest(job="j", shard=0, epoch=5, shipment=2, primary="x", states=[b"two"]), context)
    assert context.code == grpc.StatusCode.PERMISSION_DENIED and word in context.details
    assert "admin token" in context.details
    assert service.held() == (1, [b"one"]) and service.epoch_seen == 1


def test_a_shipment_of_an_older_epoch_is_fenced_and_one_of_another_job_refused_both_changing_nothing():
    service = StandbyService("j", 0, "secret")
    ship(service, 3, states=(b"three",))
    for epoch, job, code in ((2, "j", grpc.StatusCode.FAILED_PRECONDITION), (4, "k", grpc.StatusCode.INVALID_ARGUMENT)):
        context = FakeContext("secret")
        with pytest.raises(Aborted):
            service.Ship(_rpb.ShipRequest(job=job, shard=0, epoch=epoch, shipment=2, primary="x", states=[b"x"]),
                         context)
        assert context.code == code
    assert service.held() == (3, [b"three"])
    assert ship(service, 3, states=(b"again",)).epoch == 3 and service.held() == (3, [b"again"])


def test_a_shipment_building_on_one_the_standby_does_not_hold_is_out_of_range_and_changes_nothing():
    """(The primary then ships a whole state: psserver.replication.shipper.)"""
    service = StandbyService("j", 0, "secret")
    ship(service, 1, states=(b"one",))  # shipment 1, whole
    context = FakeContext("secret")
    with pytest.raises(Aborted):
        service.Ship(_rpb.ShipRequest(job="j", shard=0, epoch=1, shipment=3, primary="a", states=[b"x"], base=2),
                     context)
    assert context.code == grpc.StatusCode.OUT_OF_RANGE and "holds shipment 1" in context.details
    assert service.held() == (1, [b"one"]) and service.shipments == 1
