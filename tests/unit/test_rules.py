"""The rules both sides share (psserver.protocol.rules), without network: the shard's decision and the
trainer's prediction are the same function, so these pin it once."""

import grpc
import pytest

from psserver.protocol.errors import VERSION_METADATA_KEY
from psserver.protocol.rules import MODES, STALE, Mode, refused_stale, reply_version, stale_version, version_of_refusal


def test_a_mode_equals_its_name_so_a_specs_string_compares_as_is_and_prints_as_its_name():
    assert MODES == ("sync", "async", "stale-timeout")
    assert Mode.STALE_TIMEOUT == "stale-timeout" and "async" == Mode.ASYNC and Mode("sync") is Mode.SYNC
    assert f"{Mode.STALE_TIMEOUT}" == "stale-timeout" and str(Mode.ASYNC) == "async"


@pytest.mark.parametrize("mode, outcome, expected", [
    ("sync", "accepted", 8),  # the close of the round this gradient (base 7) is in
    ("sync", "duplicate", 8),  # a retry's duplicate waits for the same round
    ("stale-timeout", "scaled", 8),
    ("sync", STALE, 12),  # refused as stale: catch up with the shard's current version
    ("async", "applied", 12),  # its own step
])
def test_the_reply_version_is_the_rounds_close_in_sync_modes_and_the_shards_in_async_or_when_stale(
        mode, outcome, expected):
    assert reply_version(mode, outcome, base=7, version_after=12) == expected


class Refusal(grpc.RpcError):
    def __init__(self, code, trailers=()):
        self._code, self._trailers = code, trailers

    def code(self):
        return self._code

    def trailing_metadata(self):
        return self._trailers


def test_a_stale_refusal_is_aborted_and_carries_the_shards_version_in_its_trailers():
    stale = Refusal(grpc.StatusCode.ABORTED, ((VERSION_METADATA_KEY, "41"),))
    assert refused_stale(stale) and version_of_refusal(stale, default=3) == 41
    assert version_of_refusal(Refusal(grpc.StatusCode.ABORTED), default=3) == 3  # no trailer: stay where it is
    assert not refused_stale(Refusal(grpc.StatusCode.UNAVAILABLE))


def test_the_stale_decode_gives_the_shards_version_for_a_stale_refusal_and_none_for_any_other_error():
    stale = Refusal(grpc.StatusCode.ABORTED, ((VERSION_METADATA_KEY, "41"),))
    assert stale_version(stale, base=3) == 41
    assert stale_version(Refusal(grpc.StatusCode.ABORTED), base=3) == 3  # no trailer: stay where it is
    assert stale_version(Refusal(grpc.StatusCode.UNAVAILABLE, ((VERSION_METADATA_KEY, "41"),)), base=3) is None
