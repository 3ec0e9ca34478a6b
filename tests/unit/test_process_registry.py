"""The process registry (tests/procreg.py): a test that fails mid-way leaves no process running.

Each check runs a small test file in a pytest of its own that starts processes
the way the suite does -- a child leading its own process group with a
grandchild in it, and a launcher whose grandchild is orphaned in a session of
its own -- and then fails in ``wait_all`` on a timeout.  Once that pytest has
exited, the PIDs it recorded must be gone; without the registry they are not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.procreg import alive

ROOT = Path(__file__).resolve().parents[2]

INNER_TEST = '''
import json, os, subprocess, sys
from pathlib import Path
from trainer.local.procs import Proc, wait_all

SLEEPER = "import time; time.sleep(600)"
SPAWN = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', {sleeper!r}], "
         "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session={new_session}); print(c.pid, flush=True); {then}")


def test_a_wait_times_out_while_children_run(tmp_path):
    # like a trainer: leads its own process group, and has a child in that group
    leader = subprocess.Popen([sys.executable, "-c", SPAWN.format(sleeper=SLEEPER, new_session=False, then="c.wait()")],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    in_group = int(leader.stdout.readline())
    # like ps-cluster killed on a timeout: its child, in a session of its own, is orphaned
    launcher = subprocess.run([sys.executable, "-c", SPAWN.format(sleeper=SLEEPER, new_session=True, then="")],
                              capture_output=True, text=True, check=True, timeout=60)
    orphan = int(launcher.stdout)
    Path(os.environ["PIDS_FILE"]).write_text(json.dumps([leader.pid, in_group, orphan]))
    wait_all([Proc("trainer0", leader, tmp_path / "log")], timeout=0.1)  # TimeoutError: the test fails here
'''


def run_failing_test(tmp_path: Path, conftest: str) -> list[int]:
    """Run INNER_TEST in a pytest of its own with ``conftest``; return the PIDs it started (it must fail)."""
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    pids_file = tmp_path / "pids.json"
    env = {**os.environ, "PIDS_FILE": str(pids_file), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          str(tmp_path / "test_inner.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    assert "TimeoutError: trainer0 still running" in run.stdout, run.stdout[-3000:]
    return json.loads(pids_file.read_text())


def test_a_test_failing_in_a_timed_out_wait_leaves_none_of_its_processes_running(tmp_path):
    pids = run_failing_test(tmp_path, "from tests.procreg import process_registry  # noqa: F401\n")
    assert len(set(pids)) == 3
    assert [pid for pid in pids if alive(pid)] == []


def test_without_the_registry_the_same_test_leaves_its_processes_running(tmp_path, process_registry):
    """The control: the check above could fail.  (This test's own registry kills them afterwards.)"""
    pids = run_failing_test(tmp_path, "")
    assert [pid for pid in pids if alive(pid)] == pids
    assert sorted(process_registry.kill_all()) == sorted(pids)  # found by the token they inherited
    assert [pid for pid in pids if alive(pid)] == []
