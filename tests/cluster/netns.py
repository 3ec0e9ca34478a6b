"""Test hosts for the compose topology: one network namespace per service, joined by a bridge.

Each namespace gets its own address and an /etc/netns/<ns>/hosts file naming
every service, which `ip netns exec` bind-mounts over /etc/hosts -- so a
process resolves `ps-shard-0` as it would on a compose network.  Where
namespaces are not permitted, ``Hosts`` falls back to 127.0.0.x addresses on
loopback and rewrites service names to them (``fallback`` says so).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SUBNET = "10.213.77"  # inside this machine only: the project's own test hosts, on a private bridge


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Hosts:
    def __init__(self, services: list[str]):
        self.services = services
        self.tag = f"pg{os.getpid() % 100000}"
        self.address = {s: f"{SUBNET}.{10 + i}" for i, s in enumerate(services)}
        self.fallback = False
        self._made: list[str] = []

    def up(self) -> "Hosts":
        try:
            self._netns_up()
        except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as e:
            self.down()
            self.fallback = True
            self.address = {s: f"127.0.0.{10 + i}" for i, s in enumerate(self.services)}
            print(f"network namespaces unavailable ({e}); falling back to 127.0.0.x on loopback")
        return self

    def _ns(self, service: str) -> str:
        return f"{self.tag}-{self.services.index(service)}"

    def _netns_up(self) -> None:
        bridge = f"{self.tag}br"
        _ip("link", "add", bridge, "type", "bridge")
        self._made.append(("link", bridge))
        _ip("link", "set", bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {s}\n" for s, a in self.address.items())
        for i, s in enumerate(self.services):
            ns, host_end, ns_end = self._ns(s), f"{self.tag}h{i}", f"{self.tag}n{i}"
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            self._made.append(("link", host_end))
            _ip("link", "set", ns_end, "netns", ns)
            _ip("link", "set", host_end, "master", bridge)
            _ip("link", "set", host_end, "up")
            _ip("-n", ns, "addr", "add", f"{self.address[s]}/24", "dev", ns_end)
            _ip("-n", ns, "link", "set", ns_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)

    def command(self, service: str, argv: list[str]) -> list[str]:
        """``argv`` as run on the host of ``service``."""
        return self.prefix(service) + argv

    def prefix(self, service: str) -> list[str]:
        return [] if self.fallback else ["ip", "netns", "exec", self._ns(service)]

    def set_link(self, service: str, up: bool) -> None:
        """Pull (or plug back) the cable of ``service``: its veth end on the bridge goes down (or up)."""
        _ip("link", "set", f"{self.tag}h{self.services.index(service)}", "up" if up else "down")

    def rewrite(self, value: str) -> str:
        """In the loopback fallback, service names and 0.0.0.0 become each service's 127.0.0.x address."""
        if not self.fallback:
            return value
        for s, a in sorted(self.address.items(), key=lambda kv: -len(kv[0])):
            value = value.replace(s, a)
        return value

    def down(self) -> None:
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
                shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
            else:
                _ip("link", "del", name, check=False)
        self._made.clear()
