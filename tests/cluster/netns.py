"""Test hosts for the compose topology: one network namespace per service, joined by a bridge.

Each namespace gets its own address and an /etc/netns/<ns>/hosts file naming
every service, which `ip netns exec` bind-mounts over /etc/hosts -- so a
process resolves `ps-shard-0` as it would on a compose network.  Where
namespaces are not permitted, ``Hosts`` falls back to 127.0.0.x addresses on
loopback and rewrites service names to them (``fallback`` says so, and
``fallback_reason`` why).

The bridge between the namespaces is checked at once: a TCP connection to a
closed port must be refused within 2 s.  Where the host firewall drops bridged
traffic (an iptables FORWARD policy of DROP, as a Docker engine leaves it),
``up`` inserts one ACCEPT rule for this bridge alone and ``down`` deletes
exactly that rule, so the firewall ends as it was; if traffic still does not
pass, it falls back to loopback with the reason rather than letting a test
wait out its timeouts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

SUBNET = "10.213.77"  # inside this machine only: the project's own test hosts, on a private bridge


PROBE_SECONDS = 2.0
# Exit 0 if a TCP connection to argv[1] port 9 is answered (refused, or accepted), 1 if it is lost.
PROBE = ("import socket, sys\n"
         "try:\n    socket.create_connection((sys.argv[1], 9), timeout=float(sys.argv[2])).close()\n"
         "except ConnectionRefusedError:\n    pass\n"
         "except OSError:\n    sys.exit(1)\n")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def firewall_rules() -> str:
    """``iptables -S`` (every chain's policy and rules), or "" where there is no iptables to ask."""
    if shutil.which("iptables") is None:
        return ""
    return subprocess.run(["iptables", "-S"], capture_output=True, text=True, timeout=30).stdout


class Hosts:
    def __init__(self, services: list[str]):
        self.services = services
        self.tag = f"pg{os.getpid() % 100000}"
        self.address = {s: f"{SUBNET}.{10 + i}" for i, s in enumerate(services)}
        self.fallback = False
        self.fallback_reason = ""
        self._made: list[tuple] = []

    def up(self) -> "Hosts":
        try:
            self._netns_up()
            blocked = self._open_bridge()
        except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as e:
            blocked = f"network namespaces unavailable ({e})"
        if blocked:
            self.down()
            self.fallback, self.fallback_reason = True, blocked
            self.address = {s: f"127.0.0.{10 + i}" for i, s in enumerate(self.services)}
            print(f"{blocked}; falling back to 127.0.0.x on loopback")
        return self

    def reachable(self, src: str, dst: str) -> bool:
        """From the host of ``src``, ``dst``'s address answers a TCP connection within PROBE_SECONDS."""
        probe = self.prefix(src) + [sys.executable, "-c", PROBE, self.address[dst], str(PROBE_SECONDS)]
        return subprocess.run(probe, capture_output=True, timeout=30 + PROBE_SECONDS).returncode == 0

    def _open_bridge(self) -> str:
        """"" once the first two hosts reach each other -- after allowing this bridge's traffic through the
        host firewall if it had to -- else why they do not."""
        if len(self.services) < 2 or self.reachable(*self.services[:2]):
            return ""
        policy = next((line for line in firewall_rules().splitlines() if line.startswith("-P FORWARD")), "")
        if shutil.which("iptables"):
            rule = ["FORWARD", "-i", f"{self.tag}br", "-o", f"{self.tag}br", "-j", "ACCEPT"]
            if subprocess.run(["iptables", "-I", *rule], capture_output=True, timeout=30).returncode == 0:
                self._made.append(("rule", rule))
                if self.reachable(*self.services[:2]):
                    return ""
        return (f"the host firewall drops traffic between this test's network namespaces "
                f"({policy or 'no iptables FORWARD policy to read'}) and an ACCEPT rule for its bridge did not help")

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
            if kind == "rule":
                subprocess.run(["iptables", "-D", *name], capture_output=True, timeout=30)
            elif kind == "netns":
                _ip("netns", "del", name, check=False)
                shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
            else:
                _ip("link", "del", name, check=False)
        self._made.clear()


def firewall_as_others_see_it(tag: str) -> list[str]:
    """``iptables -S`` without the rules other tests' bridges hold for their own duration (they run in parallel
    on a shared machine); this test's own rules and everything else stay in."""
    other = re.compile(r"-i (pg\d+br) ")
    return [line for line in firewall_rules().splitlines()
            if not ((m := other.search(line)) and m.group(1) != f"{tag}br")]


def links() -> str:
    return _ip("-o", "link").stdout
