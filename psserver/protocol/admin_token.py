"""The re-shard's admin token: who may change a running job's layout (docs/security.md).

A live re-shard's ``Reshard`` calls (all but STATUS) move the job's parameters and optimizer state between shards
and switch the layout every trainer follows.  A shard that authenticates no caller (loopback, or ``--insecure``)
used to take them from any process on its host, so one mistyped ``ps-server reshard`` -- or any local program --
could copy the job's weights to a shard of its own or freeze the job.  Now every ``ps-server`` holds an admin
token and takes those calls only with it (``ps-admin-token`` metadata, compared in constant time):

* ``--admin-token-file FILE`` or ``$PS_ADMIN_TOKEN``: the operator's, the same for every shard and for the
  coordinator (what a cluster across hosts uses);
* else the shard makes one at start and writes it, readable by its user alone, to a file named by its port in
  ``token_dir()``; ``ps-server reshard`` reads it from there for a loopback address (never for another host's:
  the token would go to that host), so a re-shard on one machine by the user who started the shards needs no
  setup, and no other user's process drives one.

A shard that authenticates its callers (a shared token or mutual TLS) also takes an admin token given to it;
without one, its authenticated callers may re-shard, as before.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from psserver.protocol.security import is_loopback, read_secret

ADMIN_TOKEN_ENV = "PS_ADMIN_TOKEN"
TOKEN_DIR_ENV = "PS_ADMIN_TOKEN_DIR"
METADATA_KEY = "ps-admin-token"


def token_dir() -> Path:
    """Where shards write the tokens they made: $PS_ADMIN_TOKEN_DIR, else $XDG_RUNTIME_DIR/psgrpc, else
    ~/.cache/psgrpc/admin-tokens -- the user's own (the folder is made readable by its owner alone)."""
    if os.environ.get(TOKEN_DIR_ENV):
        return Path(os.environ[TOKEN_DIR_ENV])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "psgrpc" if runtime else Path.home() / ".cache" / "psgrpc" / "admin-tokens"


def _file_for(address: str) -> Path:
    return token_dir() / f"port-{address.rpartition(':')[2]}"


def read_admin_token(token_file: str = "") -> str:
    """The operator's token: from ``token_file`` if given, else $PS_ADMIN_TOKEN, else "" (none given)."""
    return read_secret(token_file, ADMIN_TOKEN_ENV, "admin token")


def new_token() -> str:
    return secrets.token_hex(16)


def publish(token: str, address: str) -> Path:
    """Write a shard's own token for ``address`` where a coordinator on this host looks (``token_for``): the
    folder and the file readable and writable by this user alone, the file replaced whole."""
    folder = token_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    path = _file_for(address)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)
    return path


def withdraw(token: str, address: str) -> None:
    """Remove the file ``publish`` wrote, if it still holds ``token`` (a shard started later on the same port
    may have replaced it)."""
    path = _file_for(address)
    try:
        if path.read_text().strip() == token:
            path.unlink()
    except OSError:
        pass


def token_for(address: str, given: str = "") -> str:
    """The token a coordinator sends to ``address``: the one ``given`` (``read_admin_token``), else -- for a
    loopback address -- the one the shard on that port published on this host, else ""."""
    if given:
        return given
    if not is_loopback(address.rpartition(":")[0]):
        return ""
    try:
        return _file_for(address).read_text().strip()
    except OSError:
        return ""


def presented(context) -> str:
    """The admin token a call carries, or ""."""
    for key, value in context.invocation_metadata() or ():
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def matches(given: str, expected: str) -> bool:
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())
