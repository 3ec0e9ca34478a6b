"""ps-trainer as Kubernetes and a person at a terminal treat it: SIGTERM mid-run, SIGTERM while it waits
for its peers, and a wrong --ps address."""

from __future__ import annotations

import signal

import pytest
import torch

from psserver.protocol.stubs import fetch_stat
from tests.cluster.helpers import last_step, records
from tests.helpers import wait_until
from trainer.local.procs import Proc, start_shard, start_trainer
from trainer.tools.procstat import free_port

pytestmark = pytest.mark.cluster


@pytest.fixture
def procs():
    """Processes started by the test; every one is killed on the way out, whatever happened."""
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()


def test_sigterm_finishes_the_step_leaves_the_job_saves_the_model_and_exits_0(tmp_path, procs):
    shard = start_shard(0, tmp_path / "shard0.log")
    procs.append(shard)
    common = ["--num-trainers", "2", "--steps", "100000", "--threads", "1", "--no-progress", "--log-every", "1"]
    for rank in (0, 1):
        extra = ["--output", str(tmp_path / "model.pt")] if rank == 0 else []
        procs.append(start_trainer(rank, shard.address, tmp_path / f"trainer{rank}.log",
                                   [*common, "--metrics-file", str(tmp_path / f"trainer{rank}.jsonl"), *extra]))
    rank0, rank1 = procs[1], procs[2]
    wait_until(lambda: last_step(tmp_path / "trainer0.jsonl") >= 3, "rank 0's third step")

    rank0.popen.send_signal(signal.SIGTERM)
    assert rank0.popen.wait(120) == 0, rank0.log_tail()
    done = records(tmp_path / "trainer0.jsonl")[-1]
    assert done["event"] == "done" and done["stopped"] == "signal" and 3 <= done["steps"] < 100000
    state = torch.load(tmp_path / "model.pt")
    assert state and all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert "finishing the current step" in rank0.log_path.read_text()
    # It left: its peer is the only live trainer at once, not a lease later, and still trains alone.
    stats = fetch_stat(shard.address)
    assert list(stats.live_ranks) == [1] and stats.counters["leaves"] == 1
    at_leave = last_step(tmp_path / "trainer1.jsonl")
    wait_until(lambda: last_step(tmp_path / "trainer1.jsonl") > at_leave + 3, "rank 1 training on alone")

    rank1.popen.send_signal(signal.SIGTERM)
    assert rank1.popen.wait(120) == 0, rank1.log_tail()
    assert records(tmp_path / "trainer1.jsonl")[-1]["stopped"] == "signal"
    assert list(fetch_stat(shard.address).live_ranks) == []


def test_sigterm_while_waiting_for_peers_leaves_at_once_with_128_plus_the_signal(tmp_path, procs):
    shard = start_shard(0, tmp_path / "shard0.log")
    procs.append(shard)
    trainer = start_trainer(0, shard.address, tmp_path / "trainer0.log",
                            ["--num-trainers", "2", "--threads", "1", "--no-progress", "--connect-timeout", "600"])
    procs.append(trainer)
    wait_until(lambda: list(fetch_stat(shard.address).live_ranks) == [0], "rank 0 to register")
    trainer.popen.send_signal(signal.SIGTERM)
    assert trainer.popen.wait(60) == 128 + signal.SIGTERM, trainer.log_tail()
    # The message claims no more than the shard answered, and the shard agrees: rank 0 is gone, by a Leave
    # (also when the SIGTERM lands while the answer to its Register is still on its way).
    assert "stopped by SIGTERM; left the job (shard 0 answered its Leave)" in trainer.log_path.read_text()
    stats = fetch_stat(shard.address)
    assert list(stats.live_ranks) == [] and stats.counters["leaves"] == 1


def test_a_wrong_port_is_named_with_its_address_and_ends_in_one_line(tmp_path, procs):
    port = free_port()  # nothing listens there
    trainer = start_trainer(0, f"127.0.0.1:{port}", tmp_path / "trainer0.log",
                            ["--threads", "1", "--no-progress", "--connect-timeout", "3"])
    procs.append(trainer)
    assert trainer.popen.wait(120) == 1
    out = trainer.log_path.read_text()
    assert f"shard 0 at 127.0.0.1:{port} is not answering yet (UNAVAILABLE: connection refused)" in out
    assert (f"ps-trainer: error: shard 0 at 127.0.0.1:{port} did not answer within 3 s (--connect-timeout): "
            f"UNAVAILABLE: connection refused") in out
    assert "Traceback" not in out


def test_a_refused_port_on_loopback_ends_in_seconds_not_after_the_connect_timeout(tmp_path, procs):
    port = free_port()  # nothing listens there
    trainer = start_trainer(0, f"127.0.0.1:{port}", tmp_path / "trainer0.log",
                            ["--threads", "1", "--no-progress", "--connect-timeout", "600", "--refused-timeout", "7"])
    procs.append(trainer)
    assert trainer.popen.wait(300) == 1  # far below the 600 s it would otherwise wait
    assert "still trying for 7 s" in trainer.log_path.read_text()  # it counts down to --refused-timeout
    out = trainer.log_path.read_text()
    assert (f"ps-trainer: error: shard 0 at 127.0.0.1:{port} did not answer within 7 s "
            f"(every address is on "
            f"loopback and it refuses connections: check the port, or start the shard first;") in out
    assert "Traceback" not in out
