"""What the tools read about processes and ports, in one place: a free loopback port, and a process's memory
and CPU time from Linux's /proc."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (whoever binds it a moment later may race; callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def memory(pid: int | None = None) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process (this one when None), in bytes."""
    out = {}
    for line in Path(f"/proc/{pid or os.getpid()}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def sample(pid: int | None) -> dict | None:
    """CPU seconds (utime + stime) and the memory() of a live process, with the monotonic time of reading;
    None if there is no such process (any more)."""
    if not pid:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        mem = memory(pid)
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return dict(time=time.monotonic(), cpu=(int(fields[11]) + int(fields[12])) / CLK_TCK, **mem)
