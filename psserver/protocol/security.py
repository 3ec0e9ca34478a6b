"""TLS, mutual TLS and a shared token, on both sides of the wire.

* Servers: ``--tls-cert/--tls-key`` turn on TLS; ``--tls-client-ca`` also
  requires client certificates signed by that CA (mutual TLS).
* Trainers and tools: ``--tls-ca`` to verify the server; ``--tls-cert/--tls-key``
  for mutual TLS.
* A shared token (``--auth-token-file`` or the ``PS_AUTH_TOKEN`` environment
  variable -- never a command-line value, which would show in process lists)
  travels as ``authorization: Bearer <token>`` metadata and is checked by a
  server interceptor with a constant-time compare.  The standard health
  service answers without a token so probes need no secret; nothing else does.
  Tokens never appear in logs.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import grpc

log = logging.getLogger(__name__)

TOKEN_ENV = "PS_AUTH_TOKEN"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


def read_secret(token_file: str, env: str, what: str) -> str:
    """A token from ``token_file`` if given (refused, naming the file, if it cannot be read or is empty), else
    from the environment variable ``env``, else "" (none)."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"cannot read the {what} file {token_file}: {e.strerror}") from None
        if not token:
            raise ValueError(f"the {what} file {token_file} is empty")
        return token
    return os.environ.get(env, "").strip()


def read_token(token_file: str = "") -> str:
    """The shared token from ``token_file`` if given, else from $PS_AUTH_TOKEN, else "" (no token)."""
    return read_secret(token_file, TOKEN_ENV, "auth token")


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e.strerror}") from None


@dataclass(frozen=True)
class ServerSecurity:
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""  # set: clients must present a certificate signed by this CA
    token: str = ""
    admin_token: str = ""  # set: a re-shard's Reshard calls need it too (psserver.protocol.admin_token)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key too")

    def __repr__(self) -> str:  # keep the tokens out of logs and tracebacks
        return (f"ServerSecurity(tls={'mutual' if self.tls_client_ca else bool(self.tls_cert)}, "
                f"token={'set' if self.token else 'none'}, admin_token={'set' if self.admin_token else 'none'})")

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert:
            return None
        pair = (_read(self.tls_key, "TLS key"), _read(self.tls_cert, "TLS certificate"))
        client_ca = _read(self.tls_client_ca, "client CA") if self.tls_client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                           require_client_auth=client_ca is not None)

    def interceptors(self, on_refusal: Callable[[str], None] | None = None) -> list:
        return [TokenInterceptor(self.token, on_refusal)] if self.token else []

    def peer_credentials(self) -> grpc.ChannelCredentials | None:
        """A replica's credentials towards another replica of its shard (docs/standby.md): it presents its own
        certificate and verifies the other's against --tls-client-ca -- mutual TLS between replicas.  None
        without TLS."""
        if not self.tls_cert:
            return None
        if not self.tls_client_ca:
            raise ValueError("--etcd with --tls-cert needs --tls-client-ca: replicas present their certificates to "
                             "each other and verify them against it (sign every replica's certificate with that CA)")
        return grpc.ssl_channel_credentials(root_certificates=_read(self.tls_client_ca, "client CA"),
                                            private_key=_read(self.tls_key, "TLS key"),
                                            certificate_chain=_read(self.tls_cert, "TLS certificate"))

    def aio_interceptors(self, on_refusal: Callable[[str], None] | None = None) -> list:
        """The same check for a grpc.aio server."""
        return [AioTokenInterceptor(self.token, on_refusal)] if self.token else []

    @property
    def authenticates(self) -> bool:
        """Every caller proves itself: a shared token or a client certificate (mutual TLS)."""
        return bool(self.token or self.tls_client_ca)

    def check_exposed(self, host: str, insecure: bool) -> None:
        """Refuse to serve beyond loopback without authenticating callers, unless ``insecure`` says so (then warn).

        Raises:
            ValueError: one line naming the host and what to give (ps-server prints it as its error).
        """
        if is_loopback(host) or self.authenticates:
            return
        if not insecure:
            raise ValueError(f"--host {host} listens beyond loopback but no caller is authenticated: give "
                             "--auth-token-file (or $PS_AUTH_TOKEN) or mutual TLS (--tls-client-ca), or --insecure "
                             "on a network you trust (docs/security.md says what a stranger can do then)")
        log.warning("listening on %s beyond loopback with neither a token nor mutual TLS (--insecure): anyone "
                    "who can reach this port can join the job and push gradients (docs/security.md)", host)


@dataclass(frozen=True)
class ClientSecurity:
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token: str = ""

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("a client certificate (mutual TLS) needs --tls-ca to verify the server too")

    def __repr__(self) -> str:
        return f"ClientSecurity(tls={bool(self.tls_ca)}, mutual={bool(self.tls_cert)}, token={'set' if self.token else 'none'})"

    def channel(self, address: str, options: list | None = None) -> grpc.Channel:
        """A channel to ``address`` with TLS if configured and the token on every call.  ``A|B``: a shard's
        replicas (docs/standby.md): gRPC's pick-first connects to whichever of them accepts connections -- only a
        primary opens the shard's port -- and moves on when that one goes away."""
        options = options or []
        if "|" in address:  # a replicated shard: its channel's options are REPLICA_CHANNEL's, whatever was asked
            options = [o for o in options if o[0] not in dict(REPLICA_CHANNEL)] + list(REPLICA_CHANNEL)
        address = channel_target(address)
        if self.tls_ca:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(self.tls_ca, "CA certificate"),
                private_key=_read(self.tls_key, "TLS key") if self.tls_key else None,
                certificate_chain=_read(self.tls_cert, "TLS certificate") if self.tls_cert else None,
            )
            channel = grpc.secure_channel(address, creds, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token:
            channel = grpc.intercept_channel(channel, _TokenMetadata(self.token))
        return channel


# A channel to a shard's replicas (``PRIMARY|STANDBY``), whoever makes it:
# * it probes its connection every second and drops it when a probe is not answered within two: a primary whose
#   host dropped off the network answers nothing -- no reset, no refusal -- and its standby serves about a lease
#   after; without the probes a call to it waited for the kernel's timeout (~20 s measured,
#   tests/cluster/test_standby_partition.py).  Every probe, with or without a call under way: a sync step waiting
#   for its round sends no data.  The shard's server accepts pings this often (psserver.serving.server);
# * it reconnects at least every quarter second: a failover takes about a second (gRPC's default waits 1 s+).
REPLICA_CHANNEL = (("grpc.keepalive_time_ms", 1_000), ("grpc.keepalive_timeout_ms", 2_000),
                   ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                   ("grpc.max_reconnect_backoff_ms", 250))


def channel_target(address: str) -> str:
    """``host:port`` as it is; ``a:1|b:2`` as ``ipv4:IP:1,IP:2`` (names resolved once, now): gRPC's
    pick-first over the addresses, in order."""
    if "|" not in address:
        return address
    hosts = []
    for one in address.split("|"):
        host, port = split_host_port(one)
        ip = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0][4][0]
        hosts.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return ("ipv6:" if hosts[0].startswith("[") else "ipv4:") + ",".join(hosts)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the right bearer token, except the health service's."""

    def __init__(self, token: str, on_refusal: Callable[[str], None] | None = None):
        self._expected = f"Bearer {token}".encode()
        self._on_refusal = on_refusal

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong auth token: send 'authorization: Bearer <token>' metadata "
                          "(--auth-token-file or $PS_AUTH_TOKEN)")

        self._deny = deny

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(presented.encode(), self._expected):
            return continuation(handler_call_details)
        if self._on_refusal:
            self._on_refusal(method)
        log.warning("refused %s: missing or wrong auth token", method)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(lambda it, ctx: self._deny(None, ctx))
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(lambda it, ctx: self._deny(None, ctx))
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(self._deny)
        return grpc.unary_unary_rpc_method_handler(self._deny)


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """TokenInterceptor for grpc.aio servers: the health service answers without a token, nothing else does."""

    def __init__(self, token: str, on_refusal: Callable[[str], None] | None = None):
        self._expected = f"Bearer {token}".encode()
        self._on_refusal = on_refusal

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return await continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if isinstance(presented, str) and hmac.compare_digest(presented.encode(), self._expected):
            return await continuation(handler_call_details)
        if self._on_refusal:
            self._on_refusal(method)
        log.warning("refused %s: missing or wrong auth token", method)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong auth token: send 'authorization: Bearer <token>' metadata "
                                "(--auth-token-file or $PS_AUTH_TOKEN)")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call's metadata."""

    def __init__(self, token: str):
        self._pair = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        metadata = list(details.metadata or []) + [self._pair]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def add_client_flags(parser) -> None:
    """--tls-ca, --tls-cert, --tls-key, --auth-token-file for every CLI that calls shards."""
    parser.add_argument("--tls-ca", default="", help="CA certificate to verify the shards (turns on TLS)")
    parser.add_argument("--tls-cert", default="", help="client certificate, for mutual TLS")
    parser.add_argument("--tls-key", default="", help="client private key, for mutual TLS")
    parser.add_argument("--auth-token-file", default="", help=f"file holding the shared token (or set ${TOKEN_ENV})")


def client_security(args) -> ClientSecurity:
    return ClientSecurity(args.tls_ca, args.tls_cert, args.tls_key, read_token(args.auth_token_file))


def parse_addresses(ps: str | Sequence[str]) -> list[str]:
    """'h0:p0,h1:p1' -> ['h0:p0', 'h1:p1'], with a clear error for a malformed entry.  A shard with a hot
    standby is one entry 'primary:p|standby:p' (docs/standby.md)."""
    items = [a.strip() for a in (ps.split(",") if isinstance(ps, str) else ps) if a.strip()]
    if not items:
        raise ValueError("no parameter-server address given: pass --ps HOST:PORT[,HOST:PORT...]")
    for item in items:
        for a in item.split("|"):
            split_host_port(a)
    return items


def split_host_port(address: str) -> tuple[str, int]:
    """``'h:p'`` -> ``('h', p)``, with a clear error for anything else (one replica of a ``--ps`` entry)."""
    host, _, port = address.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"the address {address.strip()!r} is not HOST:PORT with a port between 1 and 65535")
    return host, int(port)
