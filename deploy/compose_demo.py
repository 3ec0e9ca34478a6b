#!/usr/bin/env python3
"""The docker-compose demo, run for real: `make compose-demo [ARGS=--kill-shard]`.

From a machine with no registry to pull from: start a Docker engine if none answers, build the image
offline (a debootstrapped Debian base, a wheelhouse filled by pip on the host), `docker-compose up` the
demo (rank 0 and `--scale ps-trainer=N` joiners, which take their ranks from the job), optionally SIGKILL a shard's process mid-run, print every container's exit code and the accuracy,
tear down (containers, network, volume) and check that the host's network reads as it did before.

The engine this starts runs in a network namespace of its own: every iptables chain, bridge and the FORWARD
policy it sets stay in there, so the host's rules and links are untouched by construction (other tests on
the machine forward between bridges), and deleting the namespace removes them. Standard library only: it
runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11
    sys.exit("compose-demo: needs Python 3.11 or newer (tomllib)\n  hint: run it with python3.11")

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "deploy" / "docker-compose.yml"
STANDBY_FILE = REPO / "deploy" / "docker-compose.standby.yml"  # --standby: a primary and a standby a shard, etcd
WHEELHOUSE = REPO / "deploy" / "wheelhouse"
SUITE = "bookworm"  # its python3 is 3.11, the version the wheelhouse is downloaded for
BASE_PACKAGES = "python3,python3-venv,python3-pip,ca-certificates,etcd-server"  # (etcd: the standby variant's)
BASE_TAG = f"{SUITE}-{hashlib.sha256(BASE_PACKAGES.encode()).hexdigest()[:8]}"  # a new package list, a new base
DEBIAN_TOOLS = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap",
                "iptables": "iptables", "ip": "iproute2", "nsenter": "util-linux"}
KILL_AT_VERSION = 100  # --standby --kill-shard: the primary's version when it is killed (the job runs 400)
EXIT_NO_ENGINE = 3  # this machine cannot run an engine (no root, no cgroups): the tests skip on it
# What a Docker engine adds to a host's network; a difference naming none of these was made by someone else.
DOCKER_NAMES = re.compile(r"docker0|\bbr-[0-9a-f]{12}\b|\bveth[0-9a-f]{7}\b|DOCKER|\bFORWARD DROP\b")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Where things live; each has an environment variable so CI and a second run can point elsewhere."""
    data_root: Path = Path(os.environ.get("PSGRPC_DOCKER_ROOT", "/var/lib/psgrpc-docker"))  # images persist here
    cache: Path = Path(os.environ.get("PSGRPC_DOCKER_CACHE", "/var/cache/psgrpc-docker"))  # the base image's tar
    run_dir: Path = Path(os.environ.get("PSGRPC_DOCKER_RUN", "/run/psgrpc-docker"))  # socket, pid file, exec root
    netns: str = os.environ.get("PSGRPC_DOCKER_NETNS", "psgrpc-docker")
    project: str = os.environ.get("PSGRPC_COMPOSE_PROJECT", "psgrpc-demo")
    base_image: str = os.environ.get("PSGRPC_BASE_IMAGE", "")  # a base you have; empty: debootstrap one
    logs: Path = REPO / "runs" / "compose-demo"
    train_timeout: float = float(os.environ.get("PSGRPC_DEMO_TIMEOUT", "900"))
    accuracy_bar: float = 0.90
    compose_file: Path = COMPOSE_FILE

    @property
    def socket(self) -> str:
        return f"unix://{self.run_dir}/docker.sock"


class DemoError(Exception):
    """A cause and a hint, printed as one line each; no traceback."""

    def __init__(self, cause: str, hint: str = "", code: int = 2):
        super().__init__(cause)
        self.hint, self.code = hint, code


def say(msg: str) -> None:
    print(f"compose-demo: {msg}", flush=True)


def run(argv: list[str], env: dict | None = None, timeout: float = 600, check: bool = True,
        **kw) -> subprocess.CompletedProcess:
    """A command with its output captured; a failure becomes a DemoError naming the command and its last words."""
    try:
        p = subprocess.run(argv, env=env, timeout=timeout, capture_output=True, text=True, **kw)
    except subprocess.TimeoutExpired:
        raise DemoError(f"`{' '.join(argv[:3])} ...` did not finish in {timeout:.0f} s") from None
    if check and p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise DemoError(f"`{' '.join(argv[:4])} ...` exited {p.returncode}: {' / '.join(tail)}")
    return p


# ---------------------------------------------------------------- pure parts (unit-tested)
def debian_mirror(indextargets: str, suite: str = SUITE) -> str:
    """The mirror the machine's apt sources name for `suite` (lines of `apt-get indextargets` 'URI RELEASE')."""
    uris = [line.split() for line in indextargets.splitlines() if len(line.split()) == 2]
    for uri, release in uris:
        if release == suite:
            return uri
    for uri, release in uris:  # another Debian release from the same mirror carries bookworm too
        if "security" not in uri and "-" not in release:
            return uri
    raise DemoError(f"no Debian mirror for {suite} in the machine's apt sources",
                    "add one to /etc/apt/sources.list.d/ (deb.debian.org or a local mirror)")


def network_diff(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Lines that differ between two snapshots of the host's network, '-' gone and '+' new, by command."""
    out = []
    for what in before:
        old, new = before[what].splitlines(), after.get(what, "").splitlines()
        out += [f"{what}: - {line}" for line in old if line not in new]
        out += [f"{what}: + {line}" for line in new if line not in old]
    return out


def docker_made(diff: list[str]) -> list[str]:
    """The lines of a network difference that an engine would have made (chains, bridges, veths, DROP)."""
    return [line for line in diff if DOCKER_NAMES.search(line)]


def trainer_result(stdout: str) -> dict:
    """The trainer's `{"event": "done", ...}` line: the last JSON line of its standard output."""
    for line in reversed(stdout.strip().splitlines()):
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict) and doc.get("event") == "done":
                return doc
    return {}


def verdict(containers: dict[str, dict], bar: float, killed: str | None, standby: bool = False) -> list[str]:
    """Why the run failed (empty when it passed): exit codes, the accuracy bar, a rank held by two trainers
    (ranks come from the job, one each), the restart of the killed shard; with standbys, a step lost."""
    problems = []
    if standby:
        problems += [f"{name} lost {c.get('steps_lost')} steps (a standby should have lost none)"
                     for name, c in sorted(containers.items()) if c["role"] == "trainer" and c.get("steps_lost") != 0]
    ranks = sorted(c.get("rank") for c in containers.values() if c["role"] == "trainer" and c.get("rank") is not None)
    if len(set(ranks)) != len(ranks):
        problems.append(f"trainer ranks {ranks} repeat: the job hands each trainer its own")
    for name, c in sorted(containers.items()):
        if c["exit_code"] is None:
            problems.append(f"{name} was still running after the trainers were done")
        elif c["exit_code"] != 0:
            problems.append(f"{name} exited {c['exit_code']}")
        if c["role"] == "trainer" and (c.get("test_accuracy") is None or c["test_accuracy"] < bar):
            problems.append(f"{name} reached test accuracy {c.get('test_accuracy')} (bar {bar})")
    if killed and containers.get(killed, {}).get("restarts", 0) < 1:
        problems.append(f"{killed} was killed but never restarted")
    return problems


# ---------------------------------------------------------------- the host
def engine_unavailable_reason() -> str | None:
    """Why no engine can be started here (None: one can), for the tests to skip with."""
    if os.geteuid() != 0:
        return "starting a Docker engine needs root"
    cg = Path("/sys/fs/cgroup")
    if not (cg / "devices").is_dir() and not (cg / "cgroup.controllers").exists():
        return "no cgroups mounted at /sys/fs/cgroup (a container runtime needs them)"
    return None


def ensure_tools() -> None:
    """Install the Debian packages that are missing (a fresh machine of this kind has none of them)."""
    missing = sorted({pkg for tool, pkg in DEBIAN_TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise DemoError(f"missing tools: {', '.join(missing)}", f"install them: apt-get install {' '.join(missing)}")
    say(f"installing {', '.join(missing)} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env)


def host_network() -> dict[str, str]:
    """What the host's network reads now: the lines an engine would change."""
    state = {}
    for argv in (["iptables", "-S"], ["iptables", "-t", "nat", "-S"], ["ip", "-o", "link"]):  # -o: a line a link
        state[" ".join(argv).replace(" -o", "")] = run(argv).stdout
    sysctls = ["net/ipv4/ip_forward", "net/bridge/bridge-nf-call-iptables"]
    state["sysctl"] = "\n".join(f"{k}={Path('/proc/sys', k).read_text().strip()}" for k in sysctls
                                if Path("/proc/sys", k).exists())
    return state


class Engine:
    """A Docker engine to talk to: the one that answers, or one started here in its own network namespace.

    Only an engine this started is stopped, by its own pid; its images stay in the data root for the next run.
    """

    def __init__(self, cfg: Settings):
        self.cfg, self.proc, self.env, self.netns = cfg, None, dict(os.environ), False

    def answers(self, env: dict) -> bool:
        return run(["docker", "version", "--format", "{{.Server.Version}}"], env=env, timeout=20,
                   check=False).returncode == 0

    def start(self) -> None:
        if self.answers(self.env):
            say(f"using the engine that answers at {self.env.get('DOCKER_HOST', 'unix:///var/run/docker.sock')}")
            return
        reason = engine_unavailable_reason()
        if reason:
            raise DemoError(f"no Docker engine answers, and {reason}",
                            "run as root, or set DOCKER_HOST to a running engine", EXIT_NO_ENGINE)
        cfg = self.cfg
        remove_leftovers(cfg)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.data_root.mkdir(parents=True, exist_ok=True)
        run(["ip", "netns", "add", cfg.netns])
        self.netns = True
        run(["ip", "netns", "exec", cfg.netns, "ip", "link", "set", "lo", "up"])
        # nsenter --net, not `ip netns exec`: that one remounts /sys, hiding the cgroup mounts from dockerd.
        argv = ["nsenter", f"--net=/run/netns/{cfg.netns}", "dockerd", "--data-root", str(cfg.data_root),
                "--exec-root", str(cfg.run_dir / "exec"), "-H", cfg.socket, "--pidfile", str(cfg.run_dir / "pid")]
        with open(cfg.run_dir / "dockerd.log", "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.env = {**os.environ, "DOCKER_HOST": cfg.socket}
        deadline = time.monotonic() + 60
        while not self.answers(self.env):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (cfg.run_dir / "dockerd.log").read_text().strip().splitlines()[-1:]
                raise DemoError(f"dockerd did not come up: {' '.join(tail)}", f"its log: {cfg.run_dir}/dockerd.log",
                                EXIT_NO_ENGINE)
            time.sleep(0.5)  # polling a daemon's socket, bounded by the deadline above
        say(f"started dockerd (pid {self.proc.pid}) in network namespace {cfg.netns}, socket {cfg.socket}")

    def stop(self) -> None:
        """Only what start() made: its dockerd (by its own pid), its namespace, its run directory."""
        if self.proc is not None:
            self.proc.terminate()  # dockerd stops its containerd on the way out
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            say(f"stopped dockerd (pid {self.proc.pid}, exit {self.proc.returncode})")
            self.proc = None
        if self.netns:
            run(["ip", "netns", "del", self.cfg.netns], check=False)
            shutil.rmtree(self.cfg.run_dir, ignore_errors=True)
            self.netns = False


def remove_leftovers(cfg: Settings) -> list[str]:
    """What an earlier run killed before its teardown left: its dockerd (by its pid file) and its namespace."""
    removed = []
    pidfile = cfg.run_dir / "pid"
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
        pid = int(pidfile.read_text())
        if Path(f"/proc/{pid}/comm").read_text().strip() == "dockerd":
            os.kill(pid, signal.SIGTERM)
            for _ in range(600):  # up to 60 s for it to stop its containers and containerd
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
            removed.append(f"dockerd {pid}")
    if Path("/run/netns", cfg.netns).exists():
        run(["ip", "netns", "del", cfg.netns], check=False)
        removed.append(f"netns {cfg.netns}")
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    return removed


# ---------------------------------------------------------------- the image
def base_image(cfg: Settings, env: dict) -> str:
    """A Debian base made here (no registry): debootstrap once, its tar cached, imported into the engine."""
    if cfg.base_image:
        return cfg.base_image
    name = f"psgrpc-base:{BASE_TAG}"
    if run(["docker", "image", "inspect", name], env=env, check=False).returncode == 0:
        say(f"base image {name}: already in the engine")
        return name
    tar = cfg.cache / f"base-{BASE_TAG}.tar"
    if not tar.exists():
        mirror = debian_mirror(run(["apt-get", "indextargets", "--format", "$(REPO_URI) $(RELEASE)"]).stdout)
        cfg.cache.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(dir=cfg.cache) as root:
            say(f"debootstrap {SUITE} from {mirror} (once; cached in {tar})")
            run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE, root, mirror], timeout=900)
            for junk in ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale",
                         "usr/share/info"):  # no package lists, caches or documentation in the image
                shutil.rmtree(Path(root, junk), ignore_errors=True)
            run(["tar", "-C", root, "-cf", f"{tar}.part", "."])
            os.replace(f"{tar}.part", tar)
        say(f"base root file system made in {time.monotonic() - t0:.0f} s")
    run(["docker", "import", str(tar), name], env=env)
    return name


def fill_wheelhouse(python: str = sys.executable) -> None:
    """pip on the host downloads every wheel the image needs: the CPU build of torch first, then the rest.

    Wheels for CPython 3.11 on manylinux, whatever the host's Python, so they fit the Debian base.
    """
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    torch = os.environ.get("TORCH", "torch==2.13.0")
    # the build requirements too: pip builds the project in the image, offline
    wanted = [torch, *pyproject["project"]["dependencies"], *pyproject["build-system"]["requires"], "wheel"]
    data_wheels = REPO / "data-wheels.txt"  # downloaded without their dependencies, as the image installs them
    stamp = WHEELHOUSE / ".complete"
    key = hashlib.sha256(json.dumps([wanted, data_wheels.read_text()]).encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == key:
        say(f"wheelhouse: up to date ({len(list(WHEELHOUSE.glob('*.whl')))} wheels)")
        return
    target = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--platform",
              "manylinux2014_x86_64", *[a for m in range(17, 37) for a in ("--platform", f"manylinux_2_{m}_x86_64")]]
    if run([python, "-m", "pip", "--version"], check=False).returncode != 0:
        raise DemoError(f"{python} has no pip to fill the wheelhouse with", "apt-get install python3-pip")
    t0 = time.monotonic()
    index = os.environ.get("TORCH_INDEX_URL")
    for what in ([torch], wanted):  # torch alone first, so the resolver meets the CPU build before any other
        extra = ["--extra-index-url", index] if index and what == [torch] else []
        run([python, "-m", "pip", "download", "-q", "-d", str(WHEELHOUSE), "--find-links", str(WHEELHOUSE), *extra,
             *target, *what], timeout=1200)
    run([python, "-m", "pip", "download", "-q", "-d", str(WHEELHOUSE), "--no-deps", *target, "-r", str(data_wheels)],
        timeout=1200)
    stamp.write_text(key)
    size = sum(p.stat().st_size for p in WHEELHOUSE.glob("*.whl")) / 2**20
    say(f"wheelhouse: {len(list(WHEELHOUSE.glob('*.whl')))} wheels, {size:.0f} MiB, in {time.monotonic() - t0:.0f} s")


# ---------------------------------------------------------------- the demo
class Compose:
    """docker-compose on the demo's file, under one project name."""

    def __init__(self, cfg: Settings, env: dict):
        self.cfg, self.env, self.started = cfg, env, False

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return self.run(*args, timeout=timeout, check=True)

    def run(self, *args: str, timeout: float = 600, check: bool = False) -> subprocess.CompletedProcess:
        return run(["docker-compose", "-p", self.cfg.project, "-f", str(self.cfg.compose_file), *args], env=self.env,
                   timeout=timeout, check=check)

    def container(self, service: str) -> str:
        return self("ps", "-q", service).stdout.strip()

    def containers(self, service: str) -> dict[str, str]:
        """A service's containers by name: the service's own, or ``service.N`` for the replicas of a scaled one."""
        ids = self("ps", "-q", service).stdout.split()
        if len(ids) == 1:
            return {service: ids[0]}
        label = '{{index .Config.Labels "com.docker.compose.container-number"}}'
        return {f"{service}.{self.inspect(cid, label)}": cid for cid in ids}

    def inspect(self, cid: str, fmt: str) -> str:
        return run(["docker", "inspect", "-f", fmt, cid], env=self.env).stdout.strip()

    def down(self) -> None:
        if self.started:
            self("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=300)
            self.started = False
            say("removed the containers, the network and the volume")


def image_id(env: dict, name: str = "psgrpc:latest") -> str:
    return run(["docker", "image", "inspect", "-f", "{{.Id}}", name], env=env, check=False).stdout.strip()


def build(compose: Compose, base: str) -> None:
    """The image from deploy/Dockerfile, offline; the one it replaces is removed (the build cache stays)."""
    t0 = time.monotonic()
    previous = image_id(compose.env)
    compose.env.update(PSGRPC_BASE_IMAGE=base, PSGRPC_WHEELHOUSE="1")
    log = compose.cfg.logs / "build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    out = compose.run("build", "--force-rm", timeout=1800)  # no containers of a failed step left
    log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        step = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("Step ")][-1:]
        raise DemoError(f"the image did not build ({' '.join(step)[:70] or 'before its first step'})", f"its log: {log}")
    if previous and previous != image_id(compose.env):
        run(["docker", "image", "rm", previous], env=compose.env, check=False)  # ~1 GB a code change otherwise
    size = run(["docker", "image", "inspect", "-f", "{{.Size}}", "psgrpc:latest"], env=compose.env).stdout
    say(f"image psgrpc:latest built in {time.monotonic() - t0:.0f} s: {int(size) / 1e9:.2f} GB")


def kill_shard(compose: Compose, service: str, timeout: float) -> dict:
    """Once the shard has written a checkpoint, SIGKILL its process the way a crash or the OOM killer would.

    Not `docker kill`: Docker counts that as a manual stop and never restarts the container, whatever its
    restart policy. A process that dies on its own is what `restart: on-failure` is for.
    """
    cid = compose.container(service)
    shard = service.rsplit("-", 1)[1]
    deadline = time.monotonic() + timeout
    while True:
        ls = run(["docker", "exec", cid, "ls", "checkpoints"], env=compose.env, check=False).stdout.split()
        versions = sorted(int(m[1]) for f in ls if (m := re.match(rf"shard{shard}-v(\d+)\.ckpt$", f)))
        if versions:
            break
        if time.monotonic() > deadline:
            raise DemoError(f"{service} wrote no checkpoint in {timeout:.0f} s")
        time.sleep(0.5)  # polling the volume for the first checkpoint, bounded by the deadline
    pid = int(compose.inspect(cid, "{{.State.Pid}}"))
    os.kill(pid, signal.SIGKILL)
    say(f"killed {service} (pid {pid}, SIGKILL) after its checkpoint of version {versions[-1]}")
    while compose.inspect(cid, "{{.RestartCount}} {{.State.Running}}") != "1 true":
        if time.monotonic() > deadline:
            raise DemoError(f"{service} was not restarted after the kill", "its restart policy: on-failure")
        time.sleep(0.2)  # waiting for Docker's restart, bounded by the deadline
    say(f"{service} restarted by its restart policy (restore from the checkpoint volume)")
    return {"service": service, "checkpoint_version": versions[-1]}


def primary_version(compose: Compose, service: str) -> int | None:
    """The version a replica serves the shard at, or None while it is not the primary (its port stays closed)."""
    out = run(["docker", "exec", compose.container(service), "python", "-c",
               "from psserver.protocol.stubs import fetch_stat; print(fetch_stat('127.0.0.1:7000', timeout=3).version)"],
              env=compose.env, check=False)
    return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip().isdigit() else None


def kill_primary(compose: Compose, shard: int, at_version: int, timeout: float) -> dict:
    """The standby variant: once shard ``shard``'s primary (whichever replica etcd made it) serves version
    ``at_version``, SIGKILL its process (as kill_shard does); its standby takes over, and compose restarts the
    killed one, which rejoins as the standby."""
    deadline = time.monotonic() + timeout
    replicas = [f"ps-shard-{shard}a", f"ps-shard-{shard}b"]
    while True:
        found = {r: primary_version(compose, r) for r in replicas}
        primary = next((r for r, v in found.items() if v is not None and v >= at_version), None)
        if primary is not None:
            break
        if time.monotonic() > deadline:
            raise DemoError(f"shard {shard}'s primary did not reach version {at_version} in {timeout:.0f} s "
                            f"(versions served: {found})")
        time.sleep(0.5)  # polling the primary's version, bounded by the deadline
    cid = compose.container(primary)
    pid = int(compose.inspect(cid, "{{.State.Pid}}"))
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    say(f"killed shard {shard}'s primary {primary} (pid {pid}, SIGKILL) at version {found[primary]}")
    standby = next(r for r in replicas if r != primary)
    while primary_version(compose, standby) is None:
        if time.monotonic() > deadline:
            raise DemoError(f"{standby} did not take over shard {shard}", f"its log: docker logs {compose.container(standby)}")
        time.sleep(0.2)  # waiting for the promotion, bounded by the deadline
    say(f"{standby} serves shard {shard} {time.monotonic() - killed_at:.1f} s after the kill")
    return {"service": primary, "version": found[primary], "taken_over_by": standby,
            "seconds": round(time.monotonic() - killed_at, 1)}


def wait_and_collect(compose: Compose, services: list[str]) -> dict[str, dict]:
    """Wait for the trainers, then the shards (they leave once every trainer has); each one's result, by
    container (``ps-trainer.N``: the Nth replica of the joiners; its ``rank`` is the one the job handed it)."""
    ids = {name: cid for service in services if service != "etcd"  # (the standby variant's: runs until down)
           for name, cid in compose.containers(service).items()}
    trainers = [s for s in ids if "trainer" in s]
    shards = [s for s in ids if s not in trainers]
    run(["docker", "wait", *[ids[s] for s in trainers]], env=compose.env, timeout=compose.cfg.train_timeout)
    try:
        run(["docker", "wait", *[ids[s] for s in shards]], env=compose.env, timeout=120)
    except DemoError as e:  # (the logs are still collected: they say why)
        say(f"a shard did not exit after the trainers: {e}")
    compose.cfg.logs.mkdir(parents=True, exist_ok=True)
    results = {}
    for s in ids:
        logs = run(["docker", "logs", ids[s]], env=compose.env)
        (compose.cfg.logs / f"{s}.log").write_text(logs.stdout + logs.stderr)
        code, restarts, running = compose.inspect(ids[s], "{{.State.ExitCode}} {{.RestartCount}} {{.State.Running}}").split()
        c = {"role": "trainer" if s in trainers else "shard", "exit_code": None if running == "true" else int(code),
             "restarts": int(restarts)}
        if s in trainers:
            done = trainer_result(logs.stdout)
            c.update({k: done.get(k) for k in ("rank", "test_accuracy", "steps_lost", "reconnects", "join_waits")})
        else:
            text = logs.stderr + logs.stdout
            c["restored"] = "restored version" in text and "promoted to primary" not in text
            c["promoted"] = "promoted to primary" in text
        results[s] = c
    return results


def print_summary(results: dict[str, dict]) -> None:
    for s, c in sorted(results.items()):
        extra = (f"rank {c['rank']}, test accuracy {c['test_accuracy']:.4f}, steps lost {c['steps_lost']}"
                 if c["role"] == "trainer"
                 and c.get("test_accuracy") is not None else f"restarts {c['restarts']}"
                 + (", restored from its checkpoint" if c.get("restored") else "")
                 + (", promoted from standby to primary" if c.get("promoted") else ""))
        say(f"  {s:<14} exit {c['exit_code']}  {extra}")


def demo(cfg: Settings, engine: Engine, kill: str | None, summary: dict, scale: int | None = None) -> None:
    """Build, up (``scale`` joiners: ``--scale ps-trainer=N``; None: the file's), (kill), wait, collect; the
    caller tears down whatever happens here."""
    fill_wheelhouse()
    base = base_image(cfg, engine.env)
    compose = Compose(cfg, {**engine.env})
    summary["compose"] = compose
    build(compose, base)
    services = sorted(compose("config", "--services").stdout.split())
    compose.started = True
    compose("down", "--volumes", "--remove-orphans", timeout=300)  # what a run killed mid-way left in the engine
    t0 = time.monotonic()
    scaled = ["--scale", f"ps-trainer={scale}"] if scale is not None else []
    compose("up", "-d", "--no-build", *scaled, timeout=300)  # returns once the trainers start: the shards are healthy
    say(f"up: services {', '.join(services)}" + (f" (ps-trainer scaled to {scale})" if scale is not None else ""))
    if kill and cfg.compose_file == STANDBY_FILE:
        summary["killed"] = kill_primary(compose, int(kill.removeprefix("ps-shard-")[0]), KILL_AT_VERSION,
                                         timeout=cfg.train_timeout)
    elif kill:
        summary["killed"] = kill_shard(compose, kill, timeout=cfg.train_timeout)
    results = wait_and_collect(compose, services)
    summary["train_seconds"] = round(time.monotonic() - t0, 1)
    summary["containers"] = results
    say(f"all containers exited after {summary['train_seconds']:.0f} s:")
    print_summary(results)


def run_and_tear_down(cfg: Settings, engine: Engine, kill: str | None, before: dict, summary: dict,
                      scale: int | None = None) -> None:
    """The demo, then whatever happened: compose down, the engine stopped, the host's network compared."""
    try:
        engine.start()
        demo(cfg, engine, kill, summary, scale)
    finally:
        with contextlib.suppress(DemoError):
            if "compose" in summary:
                summary.pop("compose").down()
        engine.stop()
        diff = network_diff(before, host_network())
        summary["network_diff"] = diff
        if diff:
            say("the host's network changed during the run (lines naming docker0, br-, veth or DOCKER would be "
                "ours; others are another program's):\n  " + "\n  ".join(diff))
        else:
            say("host network unchanged: iptables -S, iptables -t nat -S, ip link and ip_forward read as before")


@contextlib.contextmanager
def demo_lock():
    """One demo at a time on a machine: they share the engine's paths and namespace."""
    with open(Path(tempfile.gettempdir()) / "psgrpc-compose-demo.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compose-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--kill-shard", nargs="?", const="ps-shard-0", default=None, metavar="SERVICE",
                   help="SIGKILL this shard's process mid-run (default ps-shard-0); compose restarts it")
    p.add_argument("--scale", type=int, default=None, metavar="N",
                   help="run N joining trainers besides rank 0 (docker-compose up --scale ps-trainer=N; N <= "
                   "PS_MAX_TRAINERS - 1, 7 by default); default: the compose file's 2")
    p.add_argument("--standby", action="store_true",
                   help="the hot-standby variant (deploy/docker-compose.standby.yml: etcd, a primary and a standby a "
                        "shard); with --kill-shard, the primary of that shard is killed at version "
                        f"{KILL_AT_VERSION} and its standby takes over, no step lost")
    p.add_argument("--json", action="store_true", help="end with the summary as one JSON line")
    args = p.parse_args(argv)
    if args.scale is not None and args.scale < 0:
        p.error(f"--scale is {args.scale} but must be 0 or more (the joiners besides rank 0)")
    cfg = dataclasses.replace(Settings(), compose_file=STANDBY_FILE) if args.standby else Settings()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a TERM tears down like an error does
    t0 = time.monotonic()
    summary: dict = {"event": "compose-demo"}
    try:
        ensure_tools()
        with demo_lock():
            before = host_network()
            engine = Engine(cfg)
            run_and_tear_down(cfg, engine, args.kill_shard, before, summary, args.scale)
    except KeyboardInterrupt:
        summary["error"], code = "interrupted", 130
    except DemoError as e:
        summary["error"] = str(e)
        print(f"compose-demo: {e}", file=sys.stderr)
        if e.hint:
            print(f"  hint: {e.hint}", file=sys.stderr)
        code = e.code
    else:
        problems = verdict(summary["containers"], cfg.accuracy_bar,
                           summary.get("killed", {}).get("service") if args.kill_shard else None, args.standby)
        problems += [f"host network changed: {line}" for line in docker_made(summary["network_diff"])]
        summary["problems"] = problems
        code = 1 if problems else 0
        accs = [c["test_accuracy"] for c in summary["containers"].values() if c.get("test_accuracy") is not None]
        say(f"final test accuracy {min(accs, default=0):.4f} (bar {cfg.accuracy_bar}); "
            f"{'PASS' if not problems else 'FAIL: ' + '; '.join(problems)} in {time.monotonic() - t0:.0f} s")
    summary["seconds"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(summary), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
