"""`ps-server` as a person meets it: start-up mistakes, shutdown wording, `stats` with a shard down."""

import socket
import subprocess

import pytest

from trainer.procs import cli, start_shard


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
