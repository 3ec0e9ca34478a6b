"""Every process a test starts is killed by PID when the test ends, whatever happened in it.

Two nets, because a test fails at any point (a wait times out, an assert in the
middle) and not every process is its direct child:

* ``subprocess.Popen`` is wrapped for the test's duration: each child is
  recorded, and killed at teardown -- its whole process group if it leads one
  (``trainer.local.procs`` starts every shard and trainer in a session of its own).
* each test marks its environment with a token of its own, which every child
  and grandchild inherits (explicit ``env=`` dicts get it added): at teardown
  any live process carrying the token is found in /proc and killed, so a shard
  whose ``ps-cluster`` was killed on a timeout does not outlive the test.

The token is unique per test, so nothing another test, session or engineer
started on the machine is ever touched.
"""

from __future__ import annotations

import multiprocessing.resource_tracker
import os
import signal
import subprocess
import time
import uuid

import pytest

ENV = "PSGRPC_TEST_TOKEN"
GONE_WITHIN = 30.0  # seconds a SIGKILLed process gets to disappear before teardown reports it


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed process waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class ProcessRegistry:
    def __init__(self, token: str | None = None):
        self.token = token or uuid.uuid4().hex
        self.popens: list[subprocess.Popen] = []

    def record(self, popen: subprocess.Popen) -> None:
        self.popens.append(popen)

    def marked(self) -> list[int]:
        """PIDs of live processes other than this one whose environment carries this registry's token."""
        needle = f"{ENV}={self.token}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                continue
        return pids

    def kill_all(self) -> list[int]:
        """SIGKILL every recorded child (its group if it leads one) and every marked process; reap the
        children, wait until the others are gone, and return the PIDs that were still running."""
        killed = []
        for p in self.popens:
            if p.poll() is None:  # unreaped, so the PID (and a group it leads) is still this child's
                _kill(p.pid, group=os.getpgid(p.pid) == p.pid)
                killed.append(p.pid)
        keep = _session_helpers()
        for pid in self.marked():
            if pid not in keep:
                _kill(pid, group=False)
                killed.append(pid)
        for p in self.popens:
            p.wait(GONE_WITHIN)
        deadline = time.monotonic() + GONE_WITHIN
        while any(alive(pid) for pid in killed):  # SIGKILL is not instant; a wait for a condition
            assert time.monotonic() < deadline, f"processes {[p for p in killed if alive(p)]} survived SIGKILL"
            time.sleep(0.01)
        return killed


def _kill(pid: int, group: bool) -> None:
    try:
        os.killpg(pid, signal.SIGKILL) if group else os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _session_helpers() -> set[int]:
    """multiprocessing's resource tracker: started by the first test that spawns, it serves the whole session."""
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    pid = getattr(tracker, "_pid", None)
    return {pid} if pid else set()


def recording_popen(registry: ProcessRegistry) -> type:
    """A ``subprocess.Popen`` that records each child in ``registry`` and passes the token on in ``env=``."""

    class RecordedPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            env = kwargs.get("env")
            if env is not None:
                key = ENV.encode() if any(isinstance(k, bytes) for k in env) else ENV
                kwargs["env"] = {**env, key: registry.token if key == ENV else registry.token.encode()}
            super().__init__(*args, **kwargs)
            registry.record(self)

    return RecordedPopen


@pytest.fixture(autouse=True)
def process_registry(monkeypatch):
    """Autouse: every process the test starts, killed by PID at teardown -- also after a failure mid-test."""
    registry = ProcessRegistry()
    monkeypatch.setenv(ENV, registry.token)
    monkeypatch.setattr(subprocess, "Popen", recording_popen(registry))
    yield registry
    registry.kill_all()
