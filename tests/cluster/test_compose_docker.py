"""The compose demo in real containers: `deploy/compose_demo.py`, the one command, run as a person runs it.

It starts its own Docker engine in a network namespace, builds the image without a registry, trains with
2 shard and 3 trainer containers (rank 0 and the scalable service's 2 joiners, ranked by the job), SIGKILLs a shard mid-run (Docker restarts it, it restores from its
checkpoint volume), tears everything down and checks the host's network. Skipped with the reason where no
engine can be started (no root, no cgroups), or, outside CI, where Docker's Debian packages are missing.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy_config import compose_demo

demo = compose_demo()
SCRIPT = Path(demo.__file__)
MISSING = sorted({pkg for tool, pkg in demo.DEBIAN_TOOLS.items() if shutil.which(tool) is None})

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(demo.engine_unavailable_reason() is not None and not os.environ.get("DOCKER_HOST"),
                       reason=f"no Docker engine can run here: {demo.engine_unavailable_reason()}"),
    pytest.mark.skipif(bool(MISSING) and not os.environ.get("CI"),
                       reason=f"not installed: {', '.join(MISSING)} (CI installs them; see .ci/run)"),
]


def run_demo(*args: str, timeout: float = 1500, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """The script to its end; on a timeout or any failure it is stopped, and its engine and namespace go."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args, "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the script tears down on TERM
            try:
                proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        with demo.demo_lock():  # whatever a killed script left: its dockerd, its namespace
            demo.remove_leftovers(demo.Settings())
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), summary


def test_compose_demo_trains_through_a_killed_shard_and_leaves_the_host_as_it_was():
    before = demo.host_network()
    result, summary = run_demo("--kill-shard")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    containers = summary["containers"]
    trainers = {n: c for n, c in containers.items() if c["role"] == "trainer"}
    shards = {n: c for n, c in containers.items() if c["role"] == "shard"}
    assert sorted(trainers) == ["ps-trainer-0", "ps-trainer.1", "ps-trainer.2"]
    assert trainers["ps-trainer-0"]["rank"] == 0 and sorted(c["rank"] for c in trainers.values()) == [0, 1, 2]
    assert sorted(shards) == ["ps-shard-0", "ps-shard-1"]
    for name, c in trainers.items():  # no trainer was restarted: each rode out the shard's restart
        assert (c["exit_code"], c["restarts"]) == (0, 0), name
        assert c["test_accuracy"] >= 0.90, (name, c)
        assert c["steps_lost"] is not None and c["steps_lost"] >= 0, (name, c)
    assert summary["killed"]["service"] == "ps-shard-0" and summary["killed"]["checkpoint_version"] > 0
    assert shards["ps-shard-0"] == {"role": "shard", "exit_code": 0, "restarts": 1, "restored": True, "promoted": False}
    assert shards["ps-shard-1"]["exit_code"] == 0 and shards["ps-shard-1"]["restarts"] == 0
    assert "host network unchanged" in result.stdout or not demo.docker_made(summary["network_diff"])
    # afterwards: no engine, no namespace, and nothing an engine makes on the host's network
    assert not Path("/run/netns", demo.Settings().netns).exists()
    assert not demo.Settings().run_dir.exists()
    assert demo.docker_made(demo.network_diff(before, demo.host_network())) == []


def test_the_standby_compose_file_loses_no_step_when_a_primary_container_is_killed():
    """deploy/docker-compose.standby.yml for real: etcd, a primary and a standby a shard; shard 0's primary
    SIGKILLed mid-run (whichever replica etcd made primary); its standby takes over, the killed one comes back as
    the standby, the trainers lose no step, and every replica leaves once the job is done."""
    result, summary = run_demo("--standby", "--kill-shard")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    containers, killed = summary["containers"], summary["killed"]
    trainers = {n: c for n, c in containers.items() if c["role"] == "trainer"}
    assert sorted(trainers) == ["ps-trainer-0", "ps-trainer-1"]
    for name, c in trainers.items():
        assert (c["exit_code"], c["restarts"], c["steps_lost"]) == (0, 0, 0), (name, c)
        assert c["test_accuracy"] >= 0.90, (name, c)
    assert killed["service"] in ("ps-shard-0a", "ps-shard-0b") and killed["version"] >= demo.KILL_AT_VERSION
    assert containers[killed["taken_over_by"]]["promoted"] and containers[killed["service"]]["restarts"] == 1
    assert all(c["exit_code"] == 0 for c in containers.values())
    assert not demo.docker_made(summary["network_diff"])


def test_a_failed_build_is_one_line_with_a_hint_and_leaves_no_engine_namespace_or_firewall_change():
    before = demo.host_network()
    # No registry answers here, so a base image that is not in the engine cannot be had: the build fails.
    result, summary = run_demo(env={"PSGRPC_BASE_IMAGE": "psgrpc-no-such-base:0"}, timeout=600)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    cause, hint = result.stderr.strip().splitlines()[-2:]
    assert cause.startswith("compose-demo: the image did not build") and hint.startswith("  hint: its log: ")
    assert "image did not build" in summary["error"]
    assert "stopped dockerd" in result.stdout
    assert not Path("/run/netns", demo.Settings().netns).exists()
    assert demo.docker_made(demo.network_diff(before, demo.host_network())) == []
