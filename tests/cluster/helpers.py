"""Run real ps-server and ps-trainer processes for a test and collect what they report; the scaffolding the
fault and soak tests share (restart a shard on its port, trainer threads through fault-injecting proxies, the
exact parameters plain SGD must end at)."""

from __future__ import annotations

import contextlib
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest
import torch

from psserver.protocol.proto import ps_pb2 as pb
from psserver.protocol.proto import ps_pb2_grpc as pb_grpc
from psserver.protocol.stubs import fetch_stat
from psserver.resharding.reshard_cmd import reshard_main
from tests.cluster.faultproxy import FaultProxy
from trainer.local.procs import Proc, start_shard, start_trainer, wait_all


def records(path: Path) -> list[dict]:
    """The complete JSON lines a trainer's ``--metrics-file`` holds so far (a line still being written is left
    out); each must be strict JSON (no NaN)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in {path}"))
            for line in text[: text.rfind("\n") + 1].splitlines()]


def last_step(path: Path) -> int:
    """The last step a trainer's ``--metrics-file`` reports (0 before the first): what tests wait on."""
    return max((r["step"] for r in records(path) if r["event"] == "step"), default=0)


def check_nothing_lost(done: list[dict], stats, steps: int) -> None:
    """A hot-standby job's end: every trainer made every step, none lost or re-registered (the standby knew them),
    and the serving replica applied each push once (``stats``: a StatsReply, or anything with its ``counters``)."""
    for d in done:
        assert d["event"] == "done" and d["steps"] == steps
        assert d["steps_lost"] == 0 and d["reconnects"] == 0  # the standby knew them: no rejoin, no rollback
    assert stats.counters["pushes_applied"] == 2 * steps  # every push applied once, none twice
    assert stats.counters.get("replica_capture_failures", 0) == 0  # every shipment captured (none dropped a standby)


def restart_on_its_port(shard: Proc, index: int, log: Path, extra_args: list[str], env: dict | None = None) -> Proc:
    """Shard ``index`` started again with ``--restore`` on the port of ``shard`` (which the test has killed or
    stopped), so the trainers' addresses reach the new process (``env``: e.g. the job's token)."""
    port = int(shard.address.rsplit(":", 1)[1])
    return start_shard(index, log, port=port, extra_args=list(extra_args) + ["--restore"], env=env)


@dataclass
class JobRun:
    shards: list[Proc]
    trainers: list[Proc]
    codes: dict
    run_dir: Path

    def done(self, rank: int) -> dict:
        lines = (self.run_dir / f"trainer{rank}.jsonl").read_text().splitlines()
        last = json.loads(lines[-1])
        assert last["event"] == "done", self.trainers[rank].log_tail()
        return last

    def stats(self, shard: int) -> pb.StatsReply:
        return fetch_stat(self.shards[shard].address)


def reshard_shards(tmp_path: Path, extra_args: list[list[str]] | None = None) -> list[Proc]:
    """Three real ps-server processes for a live re-shard: the job starts on the first two, the third is started
    empty (the new shard of 2 -> 3; drained again by 3 -> 2)."""
    return [start_shard(i, tmp_path / f"shard{i}.log", extra_args=(extra_args or [[], [], []])[i]) for i in range(3)]


def live_reshard(capsys, old: list[str], new: list[str]) -> tuple[int, str]:
    """``ps-server reshard --ps OLD --to NEW`` in-process (the command's code and argv: a subprocess would spend
    seconds importing while the trainers train), asserted to exit 0: (R, the round the new layout takes over at;
    its lines)."""
    rc = reshard_main(["--ps", ",".join(old), "--to", ",".join(new), "--wait", "120"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    return int(re.search(r"takes over at round (\d+)", out).group(1)), out


def run_job(run_dir: Path, num_shards: int, num_trainers: int, args: list[str], per_rank: dict | None = None,
            timeout: float = 300.0) -> JobRun:
    """Start the shards, then the trainers with ``args`` (plus per-rank extras); wait for the trainers.

    Trainers run on one thread and on the CPU unless ``args`` say otherwise: the exactness tests compare with a
    reference computed so, and on a GPU host ``--device auto`` would round differently (seen on an H100: Adam's
    bit-for-bit replica off by 1.2e-4).

    The shards are left running so the test can read their stats; the caller's
    fixture (``cluster``) stops them.  If starting or waiting fails, everything started is killed here
    (and the autouse process registry would kill it at teardown anyway).
    """
    shards, trainers = [], []
    try:
        for i in range(num_shards):
            shards.append(start_shard(i, run_dir / f"shard{i}.log"))
        ps = ",".join(s.address for s in shards)
        for r in range(num_trainers):
            extra = (per_rank or {}).get(r, [])
            trainers.append(start_trainer(r, ps, run_dir / f"trainer{r}.log",
                                          ["--num-trainers", str(num_trainers), "--metrics-file",
                                           str(run_dir / f"trainer{r}.jsonl"), "--no-progress", "--threads", "1",
                                           "--device", "cpu"]
                                          + args + extra))
        codes = wait_all(trainers, timeout)
    except BaseException:  # a shard that did not start, or a wait that timed out: the fixture never sees them
        for p in trainers + shards:
            p.kill()
        raise
    return JobRun(shards, trainers, codes, run_dir)


# -- trainer threads through faults, and what exact SGD must give ------------------------------------------------

@contextlib.contextmanager
def trainers_through_faults(tmp_path: Path, trainer: Callable, args: tuple, num_trainers: int, seeds: list[int],
                            timeout: float = 300.0, shard_args: tuple = (), shards: list | None = None,
                            **faults) -> Iterator[tuple[list[Proc], list[list]]]:
    """Two real shards (started with ``shard_args``), shard i behind a FaultProxy seeded ``seeds[i]``
    (``faults``: its mean_bytes_between_faults, max_faults, max_delay), and ``num_trainers`` threads, each running
    ``trainer(rank, addresses, *args, records, errors)``.  Yields (the shards, each rank's records) once every
    thread finished without an error and the proxies really injected faults; kills the shards on the way out.
    ``shards``: the list the shards are put in, for a trainer that restarts one (it puts the new process in the
    old one's place, so that one is yielded and killed too)."""
    shards = [] if shards is None else shards
    started, proxies = shards, []
    try:
        for i in range(2):  # one by one: a second that fails to start leaves the first in the list, killed below
            shards.append(start_shard(i, tmp_path / f"shard{i}.log", extra_args=list(shard_args)))
        started = list(shards)
        proxies += [FaultProxy(s.address, seed=seeds[i], **faults) for i, s in enumerate(shards)]
        addresses = ",".join(p.address for p in proxies)
        records, errors = [[] for _ in range(num_trainers)], []
        threads = [threading.Thread(target=trainer, args=(r, addresses, *args, records[r], errors))
                   for r in range(num_trainers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=timeout)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        assert sum(p.faults for p in proxies) > 0  # the faults really happened
        yield shards, records
    finally:
        for p in proxies:
            p.close()
        for s in started + shards:
            s.kill()


def exact_sgd(by_base: dict, mode: str, version: int | None = None) -> torch.Tensor:
    """Where plain SGD with lr 1 from zeros ends, given the acknowledged gradients by the version they were pushed
    on: minus the sum of every one in async mode, of each round's mean in the sync modes (exact in fp32 for
    integer-valued gradients).

    ``version``: the shard's version at the end.  In the sync modes the round of that base is still open: a rank
    whose lease lapsed while it was slow to start is left out of round 0 and pushes one round ahead of the others
    from then on, so its last push is accepted into a round no other rank joins -- held there, not applied.  No
    push may name a later round."""
    if mode == "async":
        return -sum(g for gs in by_base.values() for g in gs)
    assert version is None or max(by_base, default=0) <= version, (sorted(by_base), version)
    return -sum(torch.stack(gs).mean(0) for b, gs in by_base.items() if version is None or b < version)


def closed_rounds(bases, version: int) -> int:
    """How many of the sync rounds the acknowledged pushes' ``bases`` name were closed by ``version`` (see exact_sgd):
    the shard's version counts exactly these when every round 0..version-1 got a push."""
    return len({b for b in bases if b < version})


def pull_params(address: str, trainer_id: str, fingerprint: str, partition: int = 0,
                layout_epoch: int = 0) -> torch.Tensor:
    """A shard's current parameters (of one partition), pulled as rank 0 with ``trainer_id``: a member, so the
    test reads them as a trainer would.  ``fingerprint``: the test's own model's (make_job), since GetStats shows
    the job only to members; ``layout_epoch``: the layout it is pulled in (a live re-shard's)."""
    with grpc.insecure_channel(address) as ch:
        chunks = list(pb_grpc.ParameterServerStub(ch).Pull(
            pb.PullRequest(rank=0, trainer_id=trainer_id, fingerprint=fingerprint, partition=partition,
                           layout_epoch=layout_epoch), timeout=30))
    return torch.frombuffer(bytearray(b"".join(c.data for c in chunks)), dtype=torch.float32)
