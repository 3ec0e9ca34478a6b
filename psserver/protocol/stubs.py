"""The service's name and its methods' paths, spelled once (from the generated descriptor), and the one-call
GetStats that tools and tests use.

Trainers open their chunk streams with ``method(name)``: the generated stubs would decode each message into a
class first, the fast paths bypass them (``fastwire``) on the same method paths.
"""

from __future__ import annotations

from psserver.protocol.proto import ps_pb2 as _pb
from psserver.protocol.proto import ps_pb2_grpc as _grpc
from psserver.protocol.security import ClientSecurity

_DESCRIPTOR = _pb.DESCRIPTOR.services_by_name["ParameterServer"]
SERVICE_NAME = _DESCRIPTOR.full_name  # "psgrpc.v1.ParameterServer"
METHODS = tuple(_DESCRIPTOR.methods_by_name)


def method(name: str) -> str:
    """``/psgrpc.v1.ParameterServer/NAME``; KeyError for an RPC the protocol does not define."""
    if name not in _DESCRIPTOR.methods_by_name:
        raise KeyError(f"{SERVICE_NAME} has no RPC {name!r}; it has {', '.join(METHODS)}")
    return f"/{SERVICE_NAME}/{name}"


def stub(channel) -> _grpc.ParameterServerStub:
    """The generated stub on ``channel``."""
    return _grpc.ParameterServerStub(channel)


# A GetStats reply is as big as the shard makes it: counters of up to limits.MAX_TABLES tables and, for a member
# or on a shard with a token, the job's spec -- which may be as big as the shard's own message limit
# (ServerConfig.max_message_bytes, 16 MB by default), past gRPC's default receive limit of 4 MB.
# The tools that read it accept a reply of any size the shard sends.
# A connection of its own that reconnects within ~0.1-1 s: gRPC otherwise shares one subchannel among every channel
# of a process to an address, and one that saw "Connection refused" (a shard restarting, or an earlier shard on a
# port the OS handed out again) fails calls at once until its reconnect backoff -- up to 120 s -- runs out, though
# a shard listens there by then.  (Not grpc.min_reconnect_backoff_ms: gRPC also takes it as how long one connection
# attempt may last, and a hung shard would be reported UNAVAILABLE in that time instead of at the call's deadline.)
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1), ("grpc.initial_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 1000)]
STATS_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), *OWN_CONNECTION]


def fetch_stat(address: str, timeout: float = 10.0, security: ClientSecurity = ClientSecurity()) -> _pb.StatsReply:
    """One shard's GetStats over a channel of its own (for tools and tests; trainers use their client)."""
    with security.channel(address, options=STATS_CHANNEL_OPTIONS) as ch:
        return stub(ch).GetStats(_pb.StatsRequest(), timeout=timeout)
