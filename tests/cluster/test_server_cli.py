"""`ps-server` as a person meets it: start-up mistakes, shutdown wording, `stats` with a shard down."""

import select
import signal
import socket
import subprocess
import time

import pytest

from trainer.local.procs import cli, start_shard


@pytest.fixture
def taken_port():
    """A port another program listens on, for as long as the test runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--health-port", "--metrics-port"])
def test_port_in_use_prints_our_one_line_and_not_grpcs_add_port_line(taken_port, flag):
    args = ["--shard", "0"] + ([] if flag == "--port" else ["--port", "0"]) + [flag, str(taken_port)]
    proc = subprocess.run(cli("psserver.cli") + args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"ps-server: error: cannot listen on 127.0.0.1:{taken_port} ({flag}): Address already in use" in proc.stderr
    assert "add_port.cc" not in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 2, proc.stderr  # the cause and the hint


def test_shutdown_log_mentions_a_final_checkpoint_only_with_a_checkpoint_dir(tmp_path):
    plain = start_shard(0, tmp_path / "plain.log")
    saving = start_shard(1, tmp_path / "saving.log", extra_args=["--checkpoint-dir", str(tmp_path / "ckpt")])
    try:
        assert plain.terminate() == 0 and saving.terminate() == 0
    finally:
        plain.kill()
        saving.kill()
    plain_log, saving_log = (tmp_path / "plain.log").read_text(), (tmp_path / "saving.log").read_text()
    assert "shard 0 stopping (version 0): NOT_SERVING, draining calls\n" in plain_log
    assert "final checkpoint" not in plain_log
    assert "shard 1 stopping (version 0): NOT_SERVING, draining calls, final checkpoint" in saving_log


def stats(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli("psserver.cli") + ["stats", *args], capture_output=True, text=True, timeout=120)


def test_stats_shows_the_shards_that_answer_and_marks_a_killed_and_a_hung_one(tmp_path):
    shards = [start_shard(i, tmp_path / f"shard{i}.log") for i in range(3)]
    try:
        shards[1].kill()
        shards[2].popen.send_signal(signal.SIGSTOP)  # alive but silent: its call runs into the deadline
        ps = ",".join(s.address for s in shards)
        some = stats("--ps", ps, "--timeout", "2")
        shards[0].kill()
        none = stats("--ps", ps, "--timeout", "2")
    finally:
        for s in shards:
            s.kill()  # SIGKILL ends a stopped process too
    assert some.returncode == 0, some.stderr
    assert f"shard 0 ({shards[0].address})" in some.stdout.splitlines()[0]
    assert next(line for line in some.stdout.splitlines() if line.startswith("mode")).split()[1:] == ["(no", "job)"]
    assert f"DOWN  shard 1 ({shards[1].address}): UNAVAILABLE" in some.stdout
    assert f"DOWN  shard 2 ({shards[2].address}): DEADLINE_EXCEEDED" in some.stdout
    assert none.returncode == 1
    assert none.stdout.splitlines()[0] == "no shard answered"
    assert [line.split(":")[0] for line in none.stdout.splitlines()[1:]] == ["DOWN  shard 0 (127.0.0.1",
                                                                             "DOWN  shard 1 (127.0.0.1",
                                                                             "DOWN  shard 2 (127.0.0.1"]
    assert "Traceback" not in some.stderr + none.stderr


def read_until(stream, needle: str, count: int, timeout: float) -> str:
    """Lines of ``stream`` until ``needle`` has appeared ``count`` times (or the deadline, or end of file)."""
    deadline, seen, text = time.monotonic() + timeout, 0, ""
    while seen < count and time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        line = stream.readline() if ready else ""
        if not line:
            break
        text += line
        seen += needle in line
    return text


def test_stats_watch_refreshes_until_ctrl_c_and_exits_0_without_a_traceback(tmp_path):
    shard = start_shard(0, tmp_path / "shard0.log")
    watch = subprocess.Popen(cli("psserver.cli") + ["stats", "--ps", shard.address, "--watch", "0.2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        shown = read_until(watch.stdout, "ps-server stats at", 2, timeout=60)
        watch.send_signal(signal.SIGINT)
        rest, err = watch.communicate(timeout=30)
    finally:
        watch.kill()
        watch.wait()
        shard.kill()
    assert shown.count("ps-server stats at") == 2 and shown.count(f"shard 0 ({shard.address})") >= 1
    assert watch.returncode == 0
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
