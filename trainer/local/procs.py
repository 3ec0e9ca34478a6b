"""Starting ps-server and ps-trainer as real processes (used by ps-cluster and the tests).

A shard is started with ``--ready-file -``: it prints its HOST:PORT on stdout
once it serves, so the launcher learns the free port the shard picked without
polling.  Everything else a process says goes to its log file.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from psserver.common.cli_support import MALLOC_TUNABLES


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    address: str = ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal(self, signum: int) -> None:
        if self.alive():
            self.popen.send_signal(signum)

    def terminate(self, timeout: float = 10.0, signalled: bool = False) -> int:
        """SIGTERM (unless ``signalled`` already: a second one means "stop at once"), then SIGKILL if it
        does not exit within ``timeout``."""
        if self.alive():
            if not signalled:
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait()


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def cli(module: str) -> list[str]:
    """The command for a psgrpc CLI, run with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-c", f"from {module} import entrypoint; entrypoint()"]


def start_shard(shard: int, log_path: Path, host: str = "127.0.0.1", port: int = 0,
                extra_args: list[str] | None = None, timeout: float = 60.0, env: dict | None = None,
                prefix: list[str] | None = None) -> Proc:
    """Start ``ps-server --shard N`` and return once it serves (its address in ``.address``).

    ``prefix`` runs it through another command (``ip netns exec NS`` in the tests).
    """
    proc = launch_shard(shard, log_path, host, port, extra_args, env, prefix)
    await_ready([proc], timeout)
    return proc


def start_shards(count: int, log_dir: Path, host: str = "127.0.0.1", timeout: float = 60.0,
                 on_up: Callable[[Proc], None] | None = None) -> list[Proc]:
    """Start shards 0..count-1 at once and return them (in shard order) once every one serves.

    Started together because each spends seconds importing torch: one after another, a cluster's start
    waits for the sum.  ``on_up`` is called with each shard as soon as it serves, in the order they do.
    """
    procs = [launch_shard(i, log_dir / f"shard{i}.log", host) for i in range(count)]
    await_ready(procs, timeout, on_up)
    return procs


def launch_shard(shard: int, log_path: Path, host: str = "127.0.0.1", port: int = 0,
                 extra_args: list[str] | None = None, env: dict | None = None,
                 prefix: list[str] | None = None) -> Proc:
    """The ``ps-server`` process, not yet known to serve (``await_ready`` reads its address)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    args = (prefix or []) + cli("psserver.cli") + ["--shard", str(shard), "--host", host, "--port", str(port),
                                                   "--ready-file", "-"]
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(args + (extra_args or []), stdout=subprocess.PIPE, stderr=log,
                                 env=child_env(env), start_new_session=True)
    return Proc(f"shard{shard}", popen, log_path)


def await_ready(procs: list[Proc], timeout: float, on_up: Callable[[Proc], None] | None = None) -> None:
    """Wait until every shard has printed its address; on a shard that does not (exits, or ``timeout``
    passes), kill them all and raise naming it with its log's tail."""
    deadline = time.monotonic() + timeout
    waiting = {p.popen.stdout: p for p in procs}
    try:
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                late = next(iter(waiting.values()))
                raise RuntimeError(f"{late.name.replace('shard', 'shard ')} did not start within {timeout:.0f} s; "
                                   f"its log says:\n{late.log_tail()}")
            for pipe in ready:
                proc = waiting.pop(pipe)
                proc.address = pipe.readline().decode().strip()
                if not proc.address:  # end of file: it exited before serving
                    raise RuntimeError(f"{proc.name.replace('shard', 'shard ')} did not start (it exited); its log "
                                       f"says:\n{proc.log_tail()}")
                if on_up is not None:
                    on_up(proc)
    except BaseException:
        for p in procs:
            p.kill()
        raise


def start_trainer(rank: int | None, ps: str, log_path: Path, args: list[str], env: dict | None = None,
                  prefix: list[str] | None = None, name: str = "") -> Proc:
    """Start ``ps-trainer --ps PS --rank R ARGS`` with its output in ``log_path`` (``rank`` None: no --rank,
    as a joiner of an elastic job is started; ``name`` then names it)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    rank_args = [] if rank is None else ["--rank", str(rank)]
    with open(log_path, "ab") as log:
        popen = subprocess.Popen((prefix or []) + cli("trainer.running.cli") + ["--ps", ps, *rank_args] + args,
                                 stdout=log, stderr=subprocess.STDOUT, env=child_env(env), start_new_session=True)
    return Proc(name or f"trainer{rank}", popen, log_path)


def wait_all(procs: list[Proc], timeout: float | None = None) -> dict[str, int]:
    """Wait for every process; return name -> exit code.  Raises TimeoutError naming the laggards."""
    deadline = None if timeout is None else time.monotonic() + timeout
    codes = {}
    for p in procs:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            codes[p.name] = p.popen.wait(remaining)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{p.name} still running after {timeout:.0f} s; its log says:\n{p.log_tail()}") from None
    return codes


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (for a process that must be told its port up front: a replica, etcd)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


ETCD_HEALTHY = ("import sys, urllib.request\n"
                "try:\n    ok = b'true' in urllib.request.urlopen(sys.argv[1], timeout=1).read()\n"
                "except OSError:\n    ok = False\n"
                "sys.exit(0 if ok else 1)\n")


def start_etcd(data_dir: Path, log_path: Path, host: str = "127.0.0.1", timeout: float = 30.0,
               prefix: list[str] | None = None, advertise: str = "") -> Proc:
    """A one-member etcd on ``host`` (the hot standby's arbiter, docs/standby.md), once it answers; ``.address``
    is its client HOST:PORT (``advertise``'s, where it listens on a wildcard).  Its election timeout is short so a
    lease of one second is honoured (etcd raises a lease's TTL to 1.5 election timeouts).  ``prefix`` runs it
    through another command (``ip netns exec NS`` in the tests), its health asked from there too."""
    import shutil

    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("etcd is not installed: a hot standby needs it (Debian: apt-get install etcd-server)")
    client, peer = free_port(host), free_port(host)
    seen = advertise or host
    log_path.parent.mkdir(parents=True, exist_ok=True)
    args = [binary, "--name", "psgrpc", "--data-dir", str(data_dir),
            "--listen-client-urls", f"http://{host}:{client}", "--advertise-client-urls", f"http://{seen}:{client}",
            "--listen-peer-urls", f"http://{host}:{peer}", "--initial-advertise-peer-urls", f"http://{seen}:{peer}",
            "--initial-cluster", f"psgrpc=http://{seen}:{peer}", "--heartbeat-interval", "10",
            "--election-timeout", "100"]
    with open(log_path, "ab") as log:
        popen = subprocess.Popen((prefix or []) + args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc = Proc("etcd", popen, log_path, f"{seen}:{client}")
    deadline = time.monotonic() + timeout
    health = f"http://{seen}:{client}/health"
    while True:
        if subprocess.run((prefix or []) + [sys.executable, "-c", ETCD_HEALTHY, health], capture_output=True,
                          timeout=30).returncode == 0:  # (asked where it runs: a namespace reaches it, we may not)
            return proc
        if not proc.alive() or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"etcd did not start within {timeout:.0f} s; its log says:\n{proc.log_tail()}")
        time.sleep(0.1)  # polling a process's readiness, not synchronising a test
