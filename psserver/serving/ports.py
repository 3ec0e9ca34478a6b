"""Check that an address can be listened on before gRPC binds it.

When gRPC's C core cannot bind, it logs its own line (``add_port.cc ... Address
already in use``) to stderr before Python hears of it, and the exception it then
raises says only "Failed to bind".  Trying the bind with a plain socket first
lets a shard refuse to start with one line that names the address, the flag and
the cause.  The port could still be taken between the check and gRPC's bind;
that rare race keeps gRPC's own message.  No torch import: psserver.serving.health,
which the health-port process imports, uses this module.
"""

from __future__ import annotations

import errno
import socket


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC and a --ps list read it: an IPv6 literal goes in brackets (``::`` -> ``[::]:7000``),
    else gRPC reads ``:::7000`` as a host without a port and cannot bind or dial it."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def check_bindable(host: str, port: int, flag: str) -> None:
    """Raise OSError naming ``host:port``, ``flag`` and the cause if a listener could not bind there.

    Port 0 (the system picks one) is always bindable.  SO_REUSEADDR is set as gRPC
    sets it, so a port that only has connections in TIME_WAIT is not reported in use.
    """
    if port == 0:
        return
    where = f"{host_port(host, port)} ({flag})"
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {where}: {host!r} does not resolve ({e.strerror})") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
            except OSError as e:
                hint = (f"another process listens on port {port}" if e.errno == errno.EADDRINUSE
                        else f"is {host} an address of this machine?")
                raise OSError(f"cannot listen on {where}: {e.strerror or e} ({hint})") from None
