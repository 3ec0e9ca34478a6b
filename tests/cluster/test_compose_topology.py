"""The compose topology for real: every service of deploy/docker-compose.yml as a process on its own host.

Commands, environments, health checks and depends_on come from the resolved
compose file itself, so a drift between the file and the code fails here.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.netns import Hosts, firewall_as_others_see_it
from tests.deploy_config import compose_cli, resolved_compose

pytestmark = pytest.mark.skipif(compose_cli() is None and not os.environ.get("CI"),
                                reason="docker-compose is not installed (CI installs it; see .ci/run)")

BIN = Path(sys.executable).parent  # the console scripts of the installed project


def argv_of(command: list[str]) -> list[str]:
    return [str(BIN / command[0]), *command[1:]]


def service_env(hosts: Hosts, service: str, env: dict) -> dict:
    out = {"PATH": f"{BIN}:{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1", "HOME": os.environ.get("HOME", "/")}
    for k, v in env.items():
        v = str(v)
        if hosts.fallback and k == "PS_HOST":
            v = hosts.address[service]
        out[k] = hosts.rewrite(v)
    return out


def wait_healthy(hosts: Hosts, service: str, spec: dict, env: dict, proc: subprocess.Popen) -> None:
    """What Compose does for `condition: service_healthy`: run the health check every interval until it passes."""
    test = spec["healthcheck"]["test"]
    assert test[0] == "CMD"
    argv = [hosts.rewrite(a) if hosts.fallback else a for a in test[1:]]
    if hosts.fallback:
        argv = [a.replace("127.0.0.1:", f"{hosts.address[service]}:") for a in argv]
    interval = float(spec["healthcheck"]["interval"].rstrip("s"))
    for _ in range(int(spec["healthcheck"]["retries"]) + 10):
        assert proc.poll() is None, f"{service} exited with {proc.returncode}"
        if subprocess.run(hosts.command(service, argv_of(argv)), env=env, capture_output=True).returncode == 0:
            return
        time.sleep(interval)  # the compose health-check interval
    raise AssertionError(f"{service} never became healthy")


def test_compose_services_train_to_the_accuracy_bar_on_their_own_hosts(tmp_path):
    services = resolved_compose()["services"]
    names = sorted(services)
    hosts = Hosts(names)
    firewall = firewall_as_others_see_it(hosts.tag)
    hosts.up()
    procs: dict[str, subprocess.Popen] = {}
    try:
        shards = [n for n in names if "healthcheck" in services[n]]
        trainers = [n for n in names if n not in shards]
        envs = {n: service_env(hosts, n, services[n].get("environment", {})) for n in names}
        for n in shards:
            (tmp_path / n).mkdir()
            procs[n] = subprocess.Popen(hosts.command(n, argv_of(services[n]["command"])), env=envs[n],
                                        cwd=tmp_path / n, stdout=open(tmp_path / f"{n}.log", "w"),
                                        stderr=subprocess.STDOUT)
        for n in trainers:
            for dep, cond in services[n]["depends_on"].items():
                assert cond["condition"] == "service_healthy"
                wait_healthy(hosts, dep, services[dep], envs[dep], procs[dep])
        for n in trainers:
            (tmp_path / n).mkdir()
            procs[n] = subprocess.Popen(hosts.command(n, argv_of(services[n]["command"])), env=envs[n],
                                        cwd=tmp_path / n, stdout=subprocess.PIPE,
                                        stderr=open(tmp_path / f"{n}.log", "w"), text=True)
        for n in trainers:
            out, _ = procs[n].communicate(timeout=600)
            assert procs[n].returncode == 0, (tmp_path / f"{n}.log").read_text()[-3000:]
            done = json.loads(out.strip().splitlines()[-1])
            assert done["event"] == "done" and done["test_accuracy"] > 0.90, done
        # PS_EXIT_WHEN_DONE: the shards leave by themselves once every trainer has left
        for n in shards:
            assert procs[n].wait(timeout=60) == 0, (tmp_path / f"{n}.log").read_text()[-3000:]
        assert (tmp_path / "ps-trainer-0" / "model.pt").exists()
        for n in shards:  # the final checkpoint, in the volume's checkpoints/ folder
            assert list((tmp_path / n / "checkpoints").glob("shard*-v*.ckpt")), n
        if not hosts.fallback:
            shard_log = (tmp_path / "ps-shard-0.log").read_text()
            assert "serving on 0.0.0.0:7000" in shard_log
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        hosts.down()
    assert firewall_as_others_see_it(hosts.tag) == firewall  # a rule it needed for its bridge is gone again
